"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023; Megatron-LM's
`--cp-comm-type a2a`): the `cp_method` "ulysses" of the `cp` axis (`contracts.config.CP_METHODS`).

Each of `cp` ranks holds 1/cp of every sequence, as under the all-gather method (the same
load-balanced chunks, `executor.parallel.context`). Before attention an all-to-all over the CP
group (cp ranks tp apart) turns q, k and v from sequence shards of all local heads into head
shards of the whole sequence: each rank then holds every token of heads/(tp*cp) query heads,
runs causal attention on the whole sequence locally, and a fourth all-to-all turns the output
back into sequence shards of all heads. Backward mirrors it: the output's gradient in, the
gradients of q, k and v out.

Per rank and micro-batch, against the same layer without CP (T = mbs*s/cp tokens, d = head_dim,
b = bytes of the compute dtype, h = heads/tp, g = kv_heads/tp):
- per-token work and attention are 1/cp: the rank runs the whole sequence's causal attention
  for h/cp of the heads, balanced by construction (no load-balancing layout needed);
- K/V heads: split over the CP ranks when cp divides g; when g divides cp (grouped-query or
  multi-query attention with fewer K/V heads than ranks) each K/V head is replicated cp/g times
  before the all-to-all, so every rank receives the one K/V head its query heads read, and the
  replicas' gradients are summed in backward (`ulysses_kv_heads`). Anything else is refused
  (`ulysses_head_problem`), as is h not divisible by cp;
- communication: four blocking all-to-alls in forward, of T*h*d*b (q), T*kv*d*b (k and v each,
  kv = g split or cp replicated) and T*h*d*b (the output), each rank keeping 1/cp of its buffer
  (`collectives`' all-to-all over cp ranks tp apart); the same four in backward; full
  recomputation plays the forward's again;
- memory: the attention kernel keeps the head shard's q, k, v and output over the whole
  sequence, as many bytes as the rank's own sequence shard of all heads (what the layer keeps
  without CP at 1/cp of the tokens), plus the replicated K/V heads' excess, 2*T*(kv - g)*d*b;
  without recomputation the o projection also keeps its input, the output turned back into the
  rank's sequence shard (T*h*d*b), which under a single layout is the kernel's own output.
  Selective recomputation reruns the kernel, which then keeps only its inputs; full keeps the
  layer's input alone.
"""
from __future__ import annotations


from meshplan.planner.costing.collectives import collective_time_s
from meshplan.planner.costing.device_time import DTYPE_BYTES, infer_seq

ULYSSES = "ulysses"


def local_heads(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int]:
    """(query heads, K/V heads) of one TP rank: split tp ways; K/V heads tp does not divide are
    replicated on every TP rank."""
    kv = num_kv_heads or num_heads
    return num_heads // tp, (kv // tp if kv % tp == 0 else kv)


def ulysses_kv_heads(kv_local: int, cp: int) -> int:
    """K/V heads each rank sends through the all-to-all: its `kv_local`, or cp when kv_local
    divides cp (each head replicated cp/kv_local times, one per rank after the exchange)."""
    if kv_local % cp == 0:
        return kv_local
    if cp % kv_local == 0:
        return cp
    raise ValueError(f"Ulysses needs cp={cp} to divide the {kv_local} K/V heads per tensor-parallel rank, "
                     f"or those heads to divide cp")


def ulysses_head_problem(num_heads: int, num_kv_heads: int, tp: int, cp: int, label: str) -> str | None:
    """Why Ulysses cannot split `num_heads` (K/V: `num_kv_heads`, 0 = as many) over tp*cp ranks
    (None: it can). A tp that does not divide the heads is `executable.tp_split_problem`'s."""
    if cp == 1 or not num_heads or num_heads % tp:
        return None
    heads, kv = local_heads(num_heads, num_kv_heads, tp)
    if heads % cp:
        return (f"{label} with --cp-method ulysses gives each CP rank heads/(tp*cp) attention heads: the "
                f"{num_heads} heads / tp {tp} = {heads} are not divisible by cp {cp}; use a cp that divides "
                f"{heads} or --cp-method all-gather")
    if kv % cp and cp % kv:
        return (f"{label} with --cp-method ulysses splits the {kv} K/V heads per tensor-parallel rank over cp {cp} "
                f"ranks, or replicates them when they divide cp: neither holds; use a cp that {kv} divides or "
                f"divides {kv}, or --cp-method all-gather")
    return None


def exchanged_bytes(layer, config, info, profile_dtype: str, compute_dtype: str) -> tuple[float, float]:
    """(query-or-output, key-or-value) bytes of one all-to-all's buffer on one rank and
    micro-batch (0, 0 for a layer without attention)."""
    if layer.kind != "block" or not info.num_heads or not info.hidden:
        return 0.0, 0.0
    heads, kv = local_heads(info.num_heads, info.num_kv_heads, config.tp)
    tokens = config.microbatch_size * infer_seq(layer, info, profile_dtype) / config.cp
    head_dim = info.attention_head_dim
    per_head = tokens * head_dim * DTYPE_BYTES[compute_dtype]
    return heads * per_head, ulysses_kv_heads(kv, config.cp) * per_head


def ulysses_comm_s(q_bytes: float, kv_bytes: float, config, cluster) -> tuple[float, float]:
    """(forward, backward) blocking all-to-alls of one micro-batch: q, k, v and the output
    (backward: their gradients); full recomputation repeats the forward's."""
    if q_bytes <= 0 or config.cp == 1:
        return 0.0, 0.0
    q_s = collective_time_s("all_to_all", q_bytes, config.cp, cluster, config.tp)
    kv_s = collective_time_s("all_to_all", kv_bytes, config.cp, cluster, config.tp)
    fwd = 2 * q_s + 2 * kv_s
    return fwd, fwd + (fwd if config.recompute == "full" else 0.0)


def kept_bytes(q_bytes: float, kv_bytes: float, layer, config, info) -> float:
    """Bytes a rank keeps for backward beyond the layer's own 1/cp share: the replicated K/V heads'
    excess (unless fully recomputed) and, without recomputation, the o projection's input."""
    if q_bytes <= 0 or config.recompute == "full":
        return 0.0
    _, kv = local_heads(info.num_heads, info.num_kv_heads, config.tp)
    replicated = 2 * kv_bytes * (1 - kv / ulysses_kv_heads(kv, config.cp))
    return replicated + (q_bytes if config.recompute == "none" else 0.0)


def with_ulysses(local, layer, config, cluster, info, profile_dtype: str, compute_dtype: str):
    """A Ulysses CP rank's `LayerCost` from its per-token work (`local`): plus the four
    all-to-alls each way (`cp_fwd_comm_s`, `cp_bwd_comm_s`) and the bytes `kept_bytes` adds."""
    q_bytes, kv_bytes = exchanged_bytes(layer, config, info, profile_dtype, compute_dtype)
    fwd_s, bwd_s = ulysses_comm_s(q_bytes, kv_bytes, config, cluster)
    return local.replaced(cp_fwd_comm_s=fwd_s, cp_bwd_comm_s=bwd_s,
                   activation_bytes=local.activation_bytes + kept_bytes(q_bytes, kv_bytes, layer, config, info))
