"""Context parallelism (CP): each of `cp` ranks holds 1/cp of every sequence.

The rules below are the all-gather method's (`ParallelConfig.cp_method`, the default); the
Ulysses method's all-to-alls are `costing.ulysses`'.

Layout (the executor's, `executor.parallel.context`): the sequence is cut into 2*cp chunks and
rank i holds chunks i and 2cp-1-i, so that under a causal mask every rank does the same
attention work. Each rank computes its queries against the whole sequence's keys: before
attention it all-gathers K and V over the CP group (as Llama 3 was trained), and in backward
reduce-scatters their gradients. Only the K/V heads travel, so grouped-query attention moves
kv_heads/heads of what full K/V would.

Per rank and micro-batch, against the same layer without CP:
- every per-token quantity (FLOPs, saved activations, TP collectives, boundary transfers,
  logits) is 1/cp: the rank holds mbs*s/cp tokens; causal attention work is 1/cp too with the
  load-balanced layout (`attention_work_share`; without balancing the last rank would do
  (2cp-1)/cp^2 of it, nearly twice its share);
- the gathered K and V of the whole sequence are saved for the attention backward:
  (1 - 1/cp) of the full K/V bytes beyond the rank's own share;
- communication: how K/V travel is the engine's (`EngineOverlap.cp_exchange`; F = 2 * mbs * s *
  kv_heads/tp * head_dim * bytes, the whole sequence's K/V on one TP rank; t: one ring step's
  attention, the rank's attention over cp, at the kernel's speed on the rank's s/cp queries):
  - "all_gather" (meshplan's executor): all-gather of F in forward, reduce-scatter of dK/dV in
    backward, both blocking; on the compute stream, the copies its batch-first K/V make around them
    (`gather_copy_bytes`, as `costing.sp_layout` explains for sequence parallelism);
  - "ring_p2p" (Megatron-Core with Transformer Engine, cp_comm_type "p2p"): cp steps, the
    rank's F/cp sent to the next rank during each step's attention: (cp-1) max(0, p2p(F/cp) - t)
    in forward; K/V and dK/dV (2F/cp) during each backward step of 2t;
  - "torch_ring" (torchtitan, torch's context_parallel with the all-gather rotation): K/V at the
    query heads (torchtitan's Llama repeats them before SDPA), all-gathered during the first
    step's attention; each later step's output merged into an fp32 accumulator (memory-bound:
    `TORCH_RING_FWD_BYTES`); backward gathers K/V again, accumulates dQ, dK, dV in fp32 and
    rotates dK/dV (fp32) to the next rank behind the next step, the last rotation exposed;
  full recomputation repeats the forward's exchange;
- gradients are averaged, and ZeRO shards, over the dp * cp ranks (tp apart): data
  parallelism sees dp*cp ranks of mbs/cp samples each (`ParallelConfig.data_ranks`,
  `rank_microbatch`, which the rest of the cost model reads).
"""
from __future__ import annotations


from meshplan.planner.costing.collectives import collective_time_s, send_recv_time_s
from meshplan.planner.costing.device_time import (ATTENTION_BMMS_PER_BLOCK, DTYPE_BYTES, attention_time_s,
                                                  causal_skipped_flops, compute_time_s, flash_attention_flops,
                                                  memory_time_s)
from meshplan.planner.costing.overlap import exposed_ring_s, overlap_of
from meshplan.planner.costing.precision import COMPUTE_DTYPE
from meshplan.planner.costing.sp_layout import BATCH_FIRST_SP_ENGINES, COPY_PASSES
from meshplan.planner.costing.tp_split import is_split

# torch's ring attention (convert_to_f32), memory traffic per element of the rank's attention
# output (= per element of its K or V at the query heads), counted from `_SDPAMerger` and
# `_templated_ring_attention_backward` (torch/distributed/tensor/experimental/_context_parallel):
# forward, per step after the first: the block's output cast to fp32 (read 2, write 4 bytes), then
# out - sigmoid(lse_block - lse) * (out - block_out): three fp32 element-wise kernels (read 8 write
# 4, read 4 write 4, read 8 write 4): 38; once at the end, the fp32 result cast back (read 4, write 2).
TORCH_RING_FWD_BYTES = 38
TORCH_RING_FWD_ONCE_BYTES = 6
# backward, per step: dQ added into its fp32 accumulator (read 4 + 2, write 4) and dK, dV each added
# into theirs (10) and packed for the rotation (read 4, write 4): 10 + 2 * 18; once: the three fp32
# accumulators zeroed (write 12) and cast back (read 12, write 6).
TORCH_RING_BWD_BYTES = 46
TORCH_RING_BWD_ONCE_BYTES = 30
from meshplan.planner.costing.ulysses import ULYSSES, with_ulysses


def attention_work_share(cp: int, balanced: bool = True) -> float:
    """The busiest CP rank's share of causal attention work: 1/cp with the 2*cp-chunk layout
    (rank i: chunks i and 2cp-1-i, (i + 1/2) + (2cp-1-i + 1/2) = 2cp of the 2cp^2 chunk-pair
    units), else (2cp-1)/cp^2 for the rank holding the last contiguous 1/cp of the sequence."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    return 1.0 / cp if balanced else (2 * cp - 1) / cp**2


def kv_gather_bytes(layer, config, info, profile_dtype: str, compute_dtype: str, *, query_heads: bool = False) -> float:
    """F: the whole sequence's K and V for one micro-batch on one TP rank, in the compute dtype
    (`query_heads`: K and V repeated to the query heads, as torchtitan's Llama passes them)."""
    if layer.kind != "block" or not info.num_heads or not info.hidden:
        return 0.0
    tokens = layer.input_bytes / (info.hidden * DTYPE_BYTES.get(profile_dtype, 2))  # per sample
    heads = info.num_heads if query_heads else (info.num_kv_heads or info.num_heads)
    head_dim = info.attention_head_dim
    return 2 * config.microbatch_size * tokens * _rank_heads(heads, config.tp) * head_dim * DTYPE_BYTES[compute_dtype]


def _rank_heads(heads: int, tp: int) -> float:
    """The heads one TP rank holds: split where tp divides them, else replicated on every rank."""
    return heads / tp if heads % tp == 0 else heads


def cp_comm_s(gather_bytes: float, config, cluster) -> tuple[float, float]:
    """(forward, backward) blocking all-gather / reduce-scatter of K/V over the CP group, one
    micro-batch ("all_gather")."""
    if gather_bytes <= 0 or config.cp == 1:
        return 0.0, 0.0
    fwd = collective_time_s("all_gather", gather_bytes, config.cp, cluster, config.tp)
    bwd = collective_time_s("reduce_scatter", gather_bytes, config.cp, cluster, config.tp)
    if config.recompute == "full":
        bwd += fwd  # the recomputed forward gathers K/V again
    return fwd, bwd


def gather_copy_bytes(gathered: float, config, info) -> tuple[float, float, float]:
    """(forward, backward, rerun) bytes meshplan's executor copies around its K/V all-gather, one
    micro-batch (`executor.parallel.context.SequenceShard.exchange`, batch-first (b, heads, s, d)
    K and V gathered on the sequence, dim 2; `costing.sp_layout` for why): the local K and V made
    contiguous (F/cp), the gathered result re-concatenated (F; a view only where one sequence and
    one K/V head a rank put nothing before dim 2), and in backward the reduce-scatter's input
    regrouped (F); the recomputed forward copies again. Each copy reads and writes its tensor."""
    view = config.microbatch_size == 1 and _rank_heads(info.num_kv_heads or info.num_heads, config.tp) == 1
    fwd = COPY_PASSES * (gathered / config.cp + gathered * (not view))
    return fwd, COPY_PASSES * gathered, fwd if config.recompute == "full" else 0.0


def ring_p2p_comm_s(gather_bytes: float, step_s: float, config, cluster) -> tuple[float, float]:
    """(forward, backward) exposed seconds of Transformer Engine's p2p ring, one micro-batch:
    `step_s` is one step's forward attention."""
    if gather_bytes <= 0 or config.cp == 1:
        return 0.0, 0.0
    link = cluster.link_for_group(config.cp, config.tp)
    chunk = gather_bytes / config.cp
    fwd = exposed_ring_s(send_recv_time_s(chunk, link), step_s, config.cp - 1)
    bwd = exposed_ring_s(send_recv_time_s(2 * chunk, link), 2 * step_s, config.cp - 1)
    return fwd, bwd + (fwd if config.recompute == "full" else 0.0)


def torch_ring_comm_s(gather_bytes: float, step_s: float, config, cluster, dtype: str) -> tuple[float, float]:
    """(forward, backward) exposed seconds of torch's ring attention (all-gather rotation), one
    micro-batch: `gather_bytes` the K/V at the query heads, `step_s` one step's forward attention."""
    cp = config.cp
    if gather_bytes <= 0 or cp == 1:
        return 0.0, 0.0
    gather_s = collective_time_s("all_gather", gather_bytes, cp, cluster, config.tp)
    elements = gather_bytes / cp / (2 * DTYPE_BYTES[dtype])  # the rank's output (and K, V) elements
    fwd = max(0.0, gather_s - step_s) + memory_time_s(
        elements * ((cp - 1) * TORCH_RING_FWD_BYTES + TORCH_RING_FWD_ONCE_BYTES), cluster)
    rotate_s = send_recv_time_s(2 * gather_bytes / cp, cluster.link_for_group(cp, config.tp))  # dK, dV in fp32
    bwd = (max(0.0, gather_s - 2 * step_s) + exposed_ring_s(rotate_s, 2 * step_s, cp - 1) + rotate_s
           + memory_time_s(elements * (cp * TORCH_RING_BWD_BYTES + TORCH_RING_BWD_ONCE_BYTES), cluster))
    return fwd, bwd + (fwd if config.recompute == "full" else 0.0)


def ring_step_s(layer, config, cluster, attention: str, kernel: float) -> float:
    """One ring step's forward attention on the rank: its attention over cp (the load-balanced
    layout gives every step the same work: a causal s/cp square, or half of an s/cp x s/cp block)."""
    dtype = COMPUTE_DTYPE[config.precision]
    shard = config.tp if is_split(layer, config.tp) else 1
    flash = flash_attention_flops(layer, attention, cluster) * config.rank_microbatch / shard
    if flash:
        return attention_time_s(flash, cluster, dtype, kernel) / config.cp
    core = (layer.attn_fwd_flops - causal_skipped_flops(layer, attention)) * config.rank_microbatch / shard
    return compute_time_s(core, ATTENTION_BMMS_PER_BLOCK, cluster, dtype) / config.cp


def with_context_parallel(local, layer, config, cluster, info, profile_dtype: str | None, attention: str = "flash",
                          kernel: float = 0.0):
    """A CP rank's `LayerCost` from the cost of its per-token work (`local`, priced at the rank's
    `rank_microbatch` over the `data_ranks`): plus the K/V exchange as the engine runs it
    (`EngineOverlap.cp_exchange`) and the gathered K/V that attention's backward keeps. `kernel`:
    the attention kernel's efficiency on the rank's queries."""
    dtype = COMPUTE_DTYPE[config.precision]
    if config.cp_method == ULYSSES:  # all-to-alls of q, k, v and the output instead (`costing.ulysses`)
        return with_ulysses(local, layer, config, cluster, info, profile_dtype or dtype, dtype)
    exchange = overlap_of(config).cp_exchange
    source_dtype = profile_dtype or dtype
    gathered = kv_gather_bytes(layer, config, info, source_dtype, dtype)
    if exchange == "all_gather":
        fwd_s, bwd_s = cp_comm_s(gathered, config, cluster)
        # the batch-first engine's gathers copy (meshplan's executor: the one that runs this exchange)
        if config.engine in BATCH_FIRST_SP_ENGINES and gathered > 0 and config.cp > 1:
            fwd_copy, bwd_copy, rerun_copy = gather_copy_bytes(gathered, config, info)
            local = local.replaced(fwd_compute_s=local.fwd_compute_s + memory_time_s(fwd_copy, cluster),
                                   bwd_compute_s=local.bwd_compute_s + memory_time_s(bwd_copy, cluster),
                                   recompute_s=local.recompute_s + memory_time_s(rerun_copy, cluster))
    elif exchange == "ring_p2p":
        fwd_s, bwd_s = ring_p2p_comm_s(gathered, ring_step_s(layer, config, cluster, attention, kernel), config,
                                       cluster)
    else:
        fwd_s, bwd_s = torch_ring_comm_s(kv_gather_bytes(layer, config, info, source_dtype, dtype, query_heads=True),
                                         ring_step_s(layer, config, cluster, attention, kernel), config, cluster,
                                         dtype)
    kept = gathered * (1 - 1 / config.cp) if config.recompute != "full" else 0.0
    return local.replaced(cp_fwd_comm_s=fwd_s, cp_bwd_comm_s=bwd_s, activation_bytes=local.activation_bytes + kept)
