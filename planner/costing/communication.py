"""A layer's communication under a `ParallelConfig`: tensor parallelism's blocking collectives, data
parallelism's gradient reductions and ZeRO's parameter gathers, and pipeline boundary transfers.
The collectives themselves are priced by `planner.costing.collectives`."""
from __future__ import annotations

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.engine_rules import GATHERED_INPUT_ENGINES, SHARD_REGATHER_ENGINES
from meshplan.planner.contracts.graph import LayerProfile
from meshplan.planner.costing import fp8
from meshplan.planner.costing.collectives import (all_gather_time_s, all_reduce_time_s, collective_time_s,
                                                  reduce_scatter_time_s, send_recv_time_s)
from meshplan.planner.costing.overlap import gathers_in_a_forward
from meshplan.planner.costing.state_memory import grad_wire_bytes_per_param
from meshplan.planner.costing.precision import recipe
from meshplan.planner.costing.tp_split import is_split

# PyTorch DDP's default gradient bucket (bucket_cap_mb=25): a software default, not hardware.
DDP_BUCKET_BYTES = 25 * 2**20
# Megatron-Core's DistributedDataParallel default bucket, in parameters: max(40M, 1M x the data-parallel
# size), "to ensure that chunks used in NCCL ring-reduce implementations are large enough to remain
# bandwidth-bound rather than latency-bound" (megatron/core/distributed/distributed_data_parallel.py).
MEGATRON_BUCKET_MIN_PARAMS = 40_000_000
MEGATRON_BUCKET_PARAMS_PER_DP_RANK = 1_000_000


def megatron_bucket_scale(params_per_rank: float, config: ParallelConfig) -> float:
    """How many times a layer's parameters its Megatron-Core bucket holds (1 where the layer fills
    one or more): its gradient reduction and its parameter gather run as part of the bucket's
    collectives, so the layer pays its share of the bucket's, whose ring latency is paid once a
    bucket, not once a layer. 1 outside Megatron's distributed data parallelism (ZeRO 0-2)."""
    if config.engine != "megatron" or config.zero == 3 or params_per_rank <= 0:
        return 1.0
    bucket = max(MEGATRON_BUCKET_MIN_PARAMS, MEGATRON_BUCKET_PARAMS_PER_DP_RANK * config.dp)
    return max(1.0, bucket / params_per_rank)


def regathers(config: ParallelConfig) -> bool:
    """Whether a sequence-parallel block's backward all-gathers each region's input once more: it
    kept only its shard for the weight gradients, with no recomputation to gather it again, or under
    an engine whose Linears keep the shard whatever reran (`SHARD_REGATHER_ENGINES`). Never under an
    engine whose Linears keep the gathered input itself (`GATHERED_INPUT_ENGINES`)."""
    if config.engine in GATHERED_INPUT_ENGINES:
        return False
    return config.recompute == "none" or config.engine in SHARD_REGATHER_ENGINES


def regather_s(gathers_s: float, config: ParallelConfig) -> float:
    """Seconds of a block's backward regathers (`regathers`): each moves what its region's forward
    all-gather moved, so `gathers_s`, the forward's, or nothing. The one rule `tp_comm_parts_s` adds
    into the backward gathers and `fused_tp` and `tp_backward` take back out of them."""
    return gathers_s if regathers(config) else 0.0


def tp_comm_parts_s(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile,
                    act_scale: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """((forward gathers, forward scatters), (backward gathers, backward scatters)) seconds of one
    micro-batch's blocking TP collectives, Megatron pattern; all-reduces count as scatters (the
    gathers and scatters apart because async TP fuses them by different rules,
    `overlap.unpipelined_tp_comm_s`).

    Block: `num_allreduce_per_pass` all-reduces of the (b, s, h) output per pass; with SP each
    becomes an all-gather + reduce-scatter of the same tensor (same ring volume; the all-gather
    moves fp8 where the engine casts before it, `fp8.tp_gather_bytes_share`), and a block without
    recomputation all-gathers each region's input once more in backward (it kept the shard).
    Vocab-parallel embedding: one all-reduce (SP: reduce-scatter) of its output in forward.
    Vocab-parallel head: its column-parallel input gradient is all-reduced in backward (SP:
    all-gather of the input in forward, reduce-scatter of its gradient in backward); the loss's
    tiny per-token reductions are left out.
    """
    tp = config.tp
    if not is_split(layer, tp):
        return (0.0, 0.0), (0.0, 0.0)
    link = cluster.link_for_group(tp, 1)
    mbs = config.rank_microbatch
    if layer.tp_split.kind == "block":
        size = layer.output_bytes * mbs * act_scale
        count = layer.tp_split.num_allreduce_per_pass
        if not config.sp:
            one = count * all_reduce_time_s(size, tp, link)
            return (0.0, one), (0.0, one)
        gather = count * all_gather_time_s(size * fp8.tp_gather_bytes_share(layer, config), tp, link)
        scatter = count * reduce_scatter_time_s(size, tp, link)
        regather = regather_s(gather, config)  # the kept shard, for the weight gradients
        return (gather, scatter), (gather + regather, scatter)
    if layer.kind == "embedding":
        size = layer.output_bytes * mbs * act_scale
        return (0.0, reduce_scatter_time_s(size, tp, link) if config.sp else all_reduce_time_s(size, tp, link)), (0.0, 0.0)
    size = layer.input_bytes * mbs * act_scale
    if config.sp:
        return (all_gather_time_s(size, tp, link), 0.0), (0.0, reduce_scatter_time_s(size, tp, link))
    return (0.0, 0.0), (0.0, all_reduce_time_s(size, tp, link))


def dp_comm_s(params_per_rank: float, config: ParallelConfig, cluster: ClusterProfile,
              gather_bytes_per_param: float | None = None, *, state_recipe: str = "executor",
              group: tuple[int, int] | None = None) -> tuple[float, float, float, float]:
    """(gradient reduction per step, parameter all-gather per step, all-gather before each
    micro-batch's forward, all-gather before each micro-batch's backward).

    ZeRO-0 all-reduces gradients once per step (DDP / FSDP2 replicate, sync deferred to the last
    micro-batch). ZeRO-1/2/3 reduce-scatter. Parameter gathers follow the recipe:
    - "zero-paper" (Megatron-LM's distributed optimizer): ZeRO-1/2 all-gather the updated
      parameters once after the optimizer; ZeRO-3 gathers before every forward and backward;
    - "executor" (FSDP2): ZeRO-3 gathers before every micro-batch's forward and again before its
      backward (split-backward schedules run ZeRO-2/3 as ZeRO-1: `executed_zero`). ZeRO-1/2
      (`reshard_after_forward=False`) gather once per step under pipelining, and without it as
      the engine reshards (`EngineOverlap.param_gather`): once per micro-batch where FSDP2
      reshards after every backward (torchtitan), once per step where the parameters stay
      gathered across micro-batches (meshplan's executor: `executor.runtime`) or are gathered in
      the next forward (Megatron's distributed optimizer).
    What of a once-per-step gather stays exposed is `overlap.exposed_step_gather_s`.
    Gradient reductions are counted once per step here; the simulator repeats them per
    micro-batch where the executor does (`grad_sync_mode`). Gathers move the compute dtype, or
    `gather_bytes_per_param` (fp8's float8 all-gather, `fp8_memory.gather_bytes_per_param`).
    `group`: (ranks, stride) of a data group of its own, without HSDP (routed experts': the
    expert-data group); None: all `data_ranks`, `tp` apart, sharded over `shard_degree`.
    """
    dp, stride, shard = ((config.data_ranks, config.tp, config.shard_degree) if group is None
                         else (group[0], group[1], group[0]))
    if dp == 1:
        return 0.0, 0.0, 0.0, 0.0
    zero = config.zero
    per_param = recipe(config.precision)
    scale = megatron_bucket_scale(params_per_rank, config)  # the layer's bucket, priced whole, then its share

    def share_s(kind: str, size: float, ranks: int, ranks_stride: int) -> float:
        return collective_time_s(kind, size * scale, ranks, cluster, ranks_stride) / scale

    grad_bytes = params_per_rank * grad_wire_bytes_per_param(config.precision, state_recipe, config.grad_reduce_in_bf16)
    param_bytes = params_per_rank * (per_param["param"] if gather_bytes_per_param is None else gather_bytes_per_param)
    if zero == 0:
        return share_s("all_reduce", grad_bytes, dp, stride), 0.0, 0.0, 0.0
    # ZeRO shards over `shard` ranks spaced tp apart (all of dp, or HSDP's shard group); HSDP then
    # all-reduces each rank's 1/shard of the reduced gradient across the dp/shard replicas, whose
    # ranks are shard*tp apart (FSDP2's HSDP: reduce-scatter, then all-reduce of the shard).
    gather_s = share_s("all_gather", param_bytes, shard, stride)
    paper = state_recipe == "zero-paper"
    reduce = "all_reduce" if zero == 1 and paper else "reduce_scatter"
    grad_s = share_s(reduce, grad_bytes, shard, stride)
    if shard < dp:
        grad_s += share_s("all_reduce", grad_bytes / shard, dp // shard, stride * shard)
    if zero == 3:
        return grad_s, 0.0, gather_s, gather_s
    if paper or config.pp > 1 or gathers_in_a_forward(config):  # once per step
        return grad_s, gather_s, 0.0, 0.0
    return grad_s, 0.0, gather_s, 0.0  # FSDP2 resharding after every backward: per micro-batch



def p2p_time_s(size_bytes: float, config: ParallelConfig, cluster: ClusterProfile) -> float:
    """One pipeline boundary transfer of `size_bytes` between neighbouring stages.

    Neighbours are `config.stride("pp")` = dp*cp*tp ranks apart, so they share a node only when
    that is below gpus_per_node.
    """
    if config.pp <= 1:
        return 0.0
    link = cluster.link_for_group(2, config.stride("pp"))
    return send_recv_time_s(size_bytes, link)
