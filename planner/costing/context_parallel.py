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
- communication: all-gather of K/V (full size F = 2 * mbs * s * kv_heads/tp * head_dim * bytes)
  in forward, reduce-scatter of dK/dV (F) in backward, both blocking; full recomputation gathers
  again;
- gradients are averaged, and ZeRO shards, over the dp * cp ranks (tp apart): data
  parallelism sees dp*cp ranks of mbs/cp samples each (`ParallelConfig.data_ranks`,
  `rank_microbatch`, which the rest of the cost model reads).
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.costing.collectives import collective_time_s
from meshplan.planner.costing.device_time import DTYPE_BYTES
from meshplan.planner.costing.precision import COMPUTE_DTYPE
from meshplan.planner.costing.ulysses import ULYSSES, with_ulysses


def attention_work_share(cp: int, balanced: bool = True) -> float:
    """The busiest CP rank's share of causal attention work: 1/cp with the 2*cp-chunk layout
    (rank i: chunks i and 2cp-1-i, (i + 1/2) + (2cp-1-i + 1/2) = 2cp of the 2cp^2 chunk-pair
    units), else (2cp-1)/cp^2 for the rank holding the last contiguous 1/cp of the sequence."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    return 1.0 / cp if balanced else (2 * cp - 1) / cp**2


def kv_gather_bytes(layer, config, info, profile_dtype: str, compute_dtype: str) -> float:
    """F: the whole sequence's K and V for one micro-batch on one TP rank, in the compute dtype."""
    if layer.kind != "block" or not info.num_heads or not info.hidden:
        return 0.0
    tokens = layer.input_bytes / (info.hidden * DTYPE_BYTES.get(profile_dtype, 2))  # per sample
    kv_heads = info.num_kv_heads or info.num_heads
    local_kv_heads = kv_heads / config.tp if kv_heads % config.tp == 0 else kv_heads
    head_dim = info.head_dim or info.hidden // info.num_heads
    return 2 * config.microbatch_size * tokens * local_kv_heads * head_dim * DTYPE_BYTES[compute_dtype]


def cp_comm_s(gather_bytes: float, config, cluster) -> tuple[float, float]:
    """(forward, backward) blocking CP collectives of one micro-batch."""
    if gather_bytes <= 0 or config.cp == 1:
        return 0.0, 0.0
    fwd = collective_time_s("all_gather", gather_bytes, config.cp, cluster, config.tp)
    bwd = collective_time_s("reduce_scatter", gather_bytes, config.cp, cluster, config.tp)
    if config.recompute == "full":
        bwd += fwd  # the recomputed forward gathers K/V again
    return fwd, bwd


def with_context_parallel(local, layer, config, cluster, info, profile_dtype: str | None):
    """A CP rank's `LayerCost` from the cost of its per-token work (`local`, priced at the rank's
    `rank_microbatch` over the `data_ranks`): plus the K/V exchange and the gathered K/V that
    attention's backward keeps."""
    dtype = COMPUTE_DTYPE[config.precision]
    if config.cp_method == ULYSSES:  # all-to-alls of q, k, v and the output instead (`costing.ulysses`)
        return with_ulysses(local, layer, config, cluster, info, profile_dtype or dtype, dtype)
    gathered = kv_gather_bytes(layer, config, info, profile_dtype or dtype, dtype)
    fwd_s, bwd_s = cp_comm_s(gathered, config, cluster)
    kept = gathered * (1 - 1 / config.cp) if config.recompute != "full" else 0.0
    return replace(local, cp_fwd_comm_s=fwd_s, cp_bwd_comm_s=bwd_s, activation_bytes=local.activation_bytes + kept)
