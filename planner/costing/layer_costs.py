"""Cost model: time and memory of one layer under one strategy, and of a whole configuration.

(Owned by the cost model; the dataclasses below are the contract the simulator and the solver
read. Add fields freely; do not rename.)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.planner.costing import fixed_costs
from meshplan.planner.costing.collectives import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s, send_recv_time_s
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.costing.state_memory import executed_zero, grad_wire_bytes_per_param, state_bytes


@dataclass(frozen=True)
class Strategy:
    """How one layer runs: mesh degrees it sees, ZeRO stage, recomputation, SP, micro-batch size.

    Mesh order is (pp, dp, tp) with tp innermost: a TP group is `tp` consecutive ranks, a DP group
    is `dp` ranks spaced `tp` apart, pipeline neighbours are `dp * tp` ranks apart.
    """

    tp: int = 1
    dp: int = 1
    zero: int = 0
    recompute: str = "none"  # none | selective | full
    sp: bool = False
    microbatch_size: int = 1
    precision: str = "bf16-mixed"  # bf16-mixed | fp32
    pp: int = 1  # only for which link pipeline transfers cross
    # Where model states live: "executor" (what `meshplan train` allocates) or "zero-paper"
    # (Rajbhandari et al.'s 2 + 2 + 12 bytes per parameter); see planner.costing.state_memory.
    state_recipe: str = "executor"


@dataclass(frozen=True)
class LayerCost:
    """One layer on one rank. Times are per micro-batch unless marked per step."""

    fwd_compute_s: float  # forward compute
    bwd_compute_s: float  # backward compute (without recomputation)
    recompute_s: float  # extra forward compute during backward (0 without recomputation)
    tp_fwd_comm_s: float  # blocking TP collectives in forward
    tp_bwd_comm_s: float  # blocking TP collectives in backward (incl. the recomputed forward's)
    fwd_gather_s: float  # parameter all-gather before each micro-batch's forward (ZeRO-3; FSDP2's ZeRO-1/2)
    bwd_gather_s: float  # parameter all-gather before each micro-batch's backward (ZeRO-3)
    dp_grad_comm_s: float  # per step: this layer's gradient reduction (all-reduce or reduce-scatter)
    dp_param_gather_s: float  # per step: all-gather of the updated parameters, once (see `_dp_comm_s`)
    optimizer_step_s: float  # per step: this layer's share of the optimizer step
    param_bytes: float  # resident, per rank
    grad_bytes: float  # resident, per rank
    optimizer_bytes: float  # resident, per rank (fp32 master + Adam moments)
    activation_bytes: float  # saved for backward, per in-flight micro-batch
    buffer_bytes: float  # transient peak (gathered ZeRO-3 params, comm buffers, recompute working set)
    output_bytes: float  # boundary tensor sent to the next stage, per micro-batch (after SP sharding)


# ---------------------------------------------------------------------------------------------
# The model. Everything below is a pure function of (layer, strategy, cluster, info).
# ---------------------------------------------------------------------------------------------


# Bytes per parameter of each precision recipe (the ZeRO paper's mixed-precision
# Adam; plain fp32 Adam needs no master copy: 4 param + 4 grad + 2 x 4 moments).
PRECISION_RECIPES: dict[str, dict[str, float]] = {
    "bf16-mixed": {"param": 2.0, "grad": 2.0, "optimizer": 12.0},
    "fp32": {"param": 4.0, "grad": 4.0, "optimizer": 8.0},
}
COMPUTE_DTYPE = {"bf16-mixed": "bf16", "fp32": "fp32"}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# PyTorch DDP's default gradient bucket (bucket_cap_mb=25): a software default, not hardware.
DDP_BUCKET_BYTES = 25 * 2**20
# GEMMs in one transformer block beyond its Linears: QK^T and (softmax) x V.
ATTENTION_BMMS_PER_BLOCK = 2


def recipe(precision: str) -> dict[str, float]:
    if precision not in PRECISION_RECIPES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_RECIPES)}, got {precision!r}")
    return PRECISION_RECIPES[precision]


def _is_split(layer: LayerProfile, tp: int) -> bool:
    return tp > 1 and layer.tp_split.kind in ("block", "vocab")


def _vocab_scale(layer: LayerProfile, tp: int, info: ModelInfo) -> float:
    """Megatron pads the vocabulary to a multiple of 128*t: the profile was built for t = 1."""
    if layer.tp_split.kind != "vocab" or tp == 1 or not info.vocab or not info.padded_vocab:
        return 1.0
    multiple = 128 * tp
    padded = -(-info.vocab // multiple) * multiple
    return padded / info.padded_vocab


def _extra_vocab_params(layer: LayerProfile, tp: int, info: ModelInfo) -> float:
    scale = _vocab_scale(layer, tp, info)
    if scale == 1.0 or layer.num_params < info.padded_vocab * info.hidden:
        return 0.0  # a head whose weight is tied to the embedding owns no vocab rows
    return (scale - 1.0) * info.padded_vocab * info.hidden


def _num_gemms(layer: LayerProfile) -> int:
    if layer.tp_split.kind == "block":
        return len(layer.tp_split.column_linears) + len(layer.tp_split.row_linears) + ATTENTION_BMMS_PER_BLOCK
    return 1


def compute_time_s(flops: float, num_gemms: int, cluster: ClusterProfile, dtype: str, num_launches: int = 1) -> float:
    """Time of `flops` split over `num_gemms` equal GEMMs on one device.

    Achieved throughput per GEMM of f FLOPs: peak * matmul_efficiency * f / (f + f_half): large
    GEMMs approach `matmul_efficiency` of peak, a GEMM of `matmul_half_efficiency_flops` reaches
    half of that. Plus `kernel_overhead_s` per kernel sequence (launch/dispatch).
    """
    device = cluster.device
    overhead_s = device.kernel_overhead_s * num_launches
    if flops <= 0:
        return overhead_s
    per_gemm = flops / max(1, num_gemms)
    efficiency = device.matmul_efficiency * per_gemm / (per_gemm + device.matmul_half_efficiency_flops)
    return flops / (device.peak_flops(dtype) * efficiency) + overhead_s


def memory_time_s(traffic_bytes: float, cluster: ClusterProfile) -> float:
    """Time to stream `traffic_bytes` through device memory at the achieved bandwidth."""
    device = cluster.device
    return traffic_bytes / (device.memory_bw_bytes_per_s * device.memory_efficiency)


def infer_seq(layer: LayerProfile, info: ModelInfo, dtype: str) -> int:
    """Sequence length of a block from its input (batch 1, seq, hidden) in the profile dtype."""
    if not info.hidden:
        return 0
    return round(layer.input_bytes / (info.hidden * DTYPE_BYTES.get(dtype, 2)))


def selective_recompute_flops(layer: LayerProfile, info: ModelInfo, dtype: str) -> float:
    """Forward FLOPs of the attention core (QK^T, softmax x V) per sample: 4 s^2 h (Korthikanti).

    Only math attention stores the scores that selective recomputation drops; flash attention
    already recomputes them in its own backward, so selective costs nothing extra there.
    """
    if layer.tp_split.kind != "block" or layer.act_attn_score_bytes == 0:
        return 0.0
    seq = infer_seq(layer, info, dtype)
    return 4.0 * seq * seq * info.hidden


def layer_cost(layer: LayerProfile, strategy: Strategy, cluster: ClusterProfile, info: ModelInfo,
               *, profile_dtype: str | None = None, holds_shared: bool = False,
               attention: str = "flash") -> LayerCost:
    """Time and memory of `layer` on one rank under `strategy` (see LayerCost for units).

    `profile_dtype`: dtype the profile's byte counts were taken in (default: the precision's
    compute dtype); activations scale by the element-size ratio. `holds_shared`: this rank holds a
    copy of parameters another stage owns (a tied head on the last stage), with its gradient and
    optimizer state, and all-reduces that gradient with the owner once per step. `attention`:
    the graph's attention kernel; a flash kernel skips the masked half of causal attention, so
    step time uses the causal FLOPs (MFU keeps counting attention in full, as Megatron-LM does).
    """
    tp, dp, mbs = strategy.tp, strategy.dp, strategy.microbatch_size
    if not layer.tp_split.max_degree_ok(tp):
        raise ValueError(f"layer {layer.name!r} cannot be split tp={tp} ways (heads {layer.tp_split.num_heads}, "
                         f"kv heads {layer.tp_split.num_kv_heads}, vocab {layer.tp_split.vocab_size})")
    if strategy.recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {strategy.recompute!r}")
    recipe(strategy.precision)  # validates the name
    dtype = COMPUTE_DTYPE[strategy.precision]
    act_scale = DTYPE_BYTES[dtype] / DTYPE_BYTES.get(profile_dtype or dtype, 2)
    split = _is_split(layer, tp)
    shard = tp if split else 1
    vocab_scale = _vocab_scale(layer, tp, info)
    fwd_s, bwd_s, recompute_s = _compute_times_s(layer, strategy, cluster, info, act_scale, vocab_scale,
                                                 profile_dtype or dtype, attention)

    tp_fwd_s, tp_bwd_s = _tp_comm_s(layer, strategy, cluster, act_scale)
    if split:  # DTensor dispatch around the parallel Linears, every pass (see planner.costing.fixed_costs)
        # the (mbs, seq, hidden) residual stream: an embedding's output, any other layer's input
        stream_bytes = mbs * act_scale * (layer.output_bytes if layer.kind == "embedding" else layer.input_bytes)
        pass_s = fixed_costs.tp_pass_overhead_s(layer, stream_bytes, strategy.sp, cluster)
        tp_fwd_s, tp_bwd_s = tp_fwd_s + pass_s, tp_bwd_s + pass_s
    if fixed_costs.dp_wrapped(tp, dp, strategy.zero, strategy.pp):  # FSDP / replicate hooks per pass
        fwd_s += cluster.device.dp_unit_overhead_s
        bwd_s += cluster.device.dp_unit_overhead_s
    if strategy.recompute == "full":
        tp_bwd_s += tp_fwd_s  # the recomputed forward repeats its collectives

    num_params = layer.num_params + _extra_vocab_params(layer, tp, info)
    if holds_shared:
        num_params += layer.shared_params
    params_per_rank = num_params / shard
    memory = model_state_bytes(params_per_rank, dp, strategy.zero, strategy.precision, strategy.state_recipe,
                               tp, strategy.pp)
    grad_comm_s, gather_s, fwd_gather_s, bwd_gather_s = _dp_comm_s(params_per_rank, strategy, cluster)
    if holds_shared and layer.shared_params and strategy.pp > 1:
        shared_bytes = layer.shared_params / shard * grad_wire_bytes_per_param(strategy.precision,
                                                                                strategy.state_recipe)
        link = cluster.link_for_group(2, strategy.dp * strategy.tp * (strategy.pp - 1))
        grad_comm_s += all_reduce_time_s(shared_bytes, 2, link)
    owned_params = params_per_rank / (dp if strategy.zero >= 1 else 1)  # optimizer states are sharded
    # AdamW streams its states through memory, and pays a fixed cost per parameter tensor
    optimizer_s = owned_params * cluster.optimizer_bytes_per_param / (
        cluster.device.memory_bw_bytes_per_s * cluster.device.memory_efficiency) + fixed_costs.optimizer_fixed_s(
        fixed_costs.num_param_tensors(layer, info, holds_shared),
        fixed_costs.holds_dtensors(split, tp, dp, strategy.zero, strategy.pp), cluster)
    if split:
        optimizer_s += fixed_costs.tp_norm_grad_sync_s(layer, info, tp, cluster)

    activation_bytes, buffer_bytes = _activation_bytes(layer, strategy, act_scale * vocab_scale)
    if executed_zero(strategy.zero, dp, strategy.pp) == 3:  # gathered full parameters live during fwd/bwd
        buffer_bytes += params_per_rank * recipe(strategy.precision)["param"]
    out_shard = tp if strategy.sp and split else 1
    return LayerCost(
        fwd_compute_s=fwd_s, bwd_compute_s=bwd_s, recompute_s=recompute_s,
        tp_fwd_comm_s=tp_fwd_s, tp_bwd_comm_s=tp_bwd_s, fwd_gather_s=fwd_gather_s, bwd_gather_s=bwd_gather_s,
        dp_grad_comm_s=grad_comm_s, dp_param_gather_s=gather_s, optimizer_step_s=optimizer_s,
        param_bytes=memory["params"], grad_bytes=memory["grads"], optimizer_bytes=memory["optimizer"],
        activation_bytes=activation_bytes, buffer_bytes=buffer_bytes,
        output_bytes=layer.output_bytes * mbs * act_scale / out_shard,
    )


def causal_skipped_flops(layer: LayerProfile, attention: str) -> float:
    """Forward FLOPs per sample a causal flash kernel skips (the masked half of QK^T and x V);
    its backward skips twice as many. Math attention computes every product."""
    if attention != "flash" or not 0 < layer.causal_fwd_flops < layer.fwd_flops:
        return 0.0
    return float(layer.fwd_flops - layer.causal_fwd_flops)


def _compute_times_s(layer: LayerProfile, strategy: Strategy, cluster: ClusterProfile, info: ModelInfo,
                     act_scale: float, vocab_scale: float, profile_dtype: str,
                     attention: str = "flash") -> tuple[float, float, float]:
    """(forward, backward, recomputation) seconds of one micro-batch on one rank.

    GEMM time from the efficiency curve (the layer's FLOPs as `_num_gemms` equal GEMMs, backward
    twice as many); memory-bound time of the non-GEMM kernels from the bytes the layer saves
    (`elementwise_bytes_per_activation_byte`, backward twice). Full recomputation repeats the
    forward; selective repeats the attention core (QK^T, softmax, x V) when scores were saved.
    """
    dtype = COMPUTE_DTYPE[strategy.precision]
    shard = strategy.tp if _is_split(layer, strategy.tp) else 1
    mbs, gemms = strategy.microbatch_size, _num_gemms(layer)
    traffic_per_act_byte = cluster.device.elementwise_bytes_per_activation_byte
    saved_bytes, _ = _activation_bytes(layer, replace(strategy, recompute="none"), act_scale * vocab_scale)
    skipped = causal_skipped_flops(layer, attention)
    fwd_flops = (layer.fwd_flops - skipped) * mbs * vocab_scale / shard
    bwd_flops = (layer.bwd_flops - 2 * skipped) * mbs * vocab_scale / shard
    fwd_s = compute_time_s(fwd_flops, gemms, cluster, dtype) + memory_time_s(traffic_per_act_byte * saved_bytes, cluster)
    bwd_s = (compute_time_s(bwd_flops, 2 * gemms, cluster, dtype, num_launches=2)
             + memory_time_s(2 * traffic_per_act_byte * saved_bytes, cluster))
    if strategy.recompute == "full":
        return fwd_s, bwd_s, fwd_s
    if strategy.recompute == "selective":
        flops = selective_recompute_flops(layer, info, profile_dtype) * mbs / shard
        if flops:
            score_bytes = layer.act_attn_score_bytes * mbs * act_scale / shard
            return fwd_s, bwd_s, (compute_time_s(flops, ATTENTION_BMMS_PER_BLOCK, cluster, dtype)
                                  + memory_time_s(traffic_per_act_byte * score_bytes, cluster))
    return fwd_s, bwd_s, 0.0


def model_state_bytes(num_params: float, dp: int, zero: int, precision: str, recipe: str = "zero-paper",
                      tp: int = 1, pp: int = 1) -> dict[str, float]:
    """Resident params / grads / optimizer bytes per rank for `num_params` (already / tp).

    ZeRO (Rajbhandari et al. 2020) shards over the dp ranks: stage 1 the optimizer states,
    stage 2 also the gradients, stage 3 also the parameters. With bf16-mixed that gives
    (2+2+12)P, 4P + 12P/d, 2P + 14P/d and 16P/d bytes for stages 0-3. `recipe="executor"`
    gives what the executor's DDP / FSDP2 realisation allocates (planner.costing.state_memory).
    """
    return state_bytes(num_params, dp, zero, precision, recipe, tp, pp)


def _tp_comm_s(layer: LayerProfile, strategy: Strategy, cluster: ClusterProfile, act_scale: float) -> tuple[float, float]:
    """Blocking TP collectives of one micro-batch (forward, backward), Megatron pattern.

    Block: `num_allreduce_per_pass` all-reduces of the (b, s, h) output per pass; with SP each
    becomes an all-gather + reduce-scatter of the same tensor (same ring volume). Vocab-parallel
    embedding: one all-reduce (SP: reduce-scatter) of its output in forward. Vocab-parallel head:
    its column-parallel input gradient is all-reduced in backward (SP: all-gather of the input in
    forward, reduce-scatter of its gradient in backward); the loss's tiny per-token reductions
    are left out.
    """
    tp = strategy.tp
    if not _is_split(layer, tp):
        return 0.0, 0.0
    link = cluster.link_for_group(tp, 1)
    mbs = strategy.microbatch_size
    if layer.tp_split.kind == "block":
        size = layer.output_bytes * mbs * act_scale
        if strategy.sp:
            one = all_gather_time_s(size, tp, link) + reduce_scatter_time_s(size, tp, link)
        else:
            one = all_reduce_time_s(size, tp, link)
        count = layer.tp_split.num_allreduce_per_pass
        return count * one, count * one
    if layer.kind == "embedding":
        size = layer.output_bytes * mbs * act_scale
        return (reduce_scatter_time_s(size, tp, link) if strategy.sp else all_reduce_time_s(size, tp, link)), 0.0
    size = layer.input_bytes * mbs * act_scale
    if strategy.sp:
        return all_gather_time_s(size, tp, link), reduce_scatter_time_s(size, tp, link)
    return 0.0, all_reduce_time_s(size, tp, link)


def _dp_comm_s(params_per_rank: float, strategy: Strategy,
               cluster: ClusterProfile) -> tuple[float, float, float, float]:
    """(gradient reduction per step, parameter all-gather per step, all-gather before each
    micro-batch's forward, all-gather before each micro-batch's backward).

    ZeRO-0 all-reduces gradients once per step (DDP / FSDP2 replicate, sync deferred to the last
    micro-batch). ZeRO-1/2/3 reduce-scatter. Parameter gathers follow the recipe:
    - "zero-paper" (Megatron-LM's distributed optimizer): ZeRO-1/2 all-gather the updated
      parameters once after the optimizer; ZeRO-3 gathers before every forward and backward;
    - "executor" (FSDP2 as `meshplan train` runs it): without pipelining, FSDP2 reshards after
      every backward, so ZeRO-1/2 (`reshard_after_forward=False`) gather once per micro-batch,
      before its forward, and ZeRO-3 before its forward and again before its backward. Under
      torch pipelining resharding after backward is off until the last micro-batch, so the
      parameters are gathered once per step (and ZeRO-2/3 run as ZeRO-1: `executed_zero`).
    Gradient reductions are counted once per step here; the simulator repeats them per
    micro-batch where the executor does (`grad_sync_mode`). Gathers move the compute dtype.
    """
    dp = strategy.dp
    if dp == 1:
        return 0.0, 0.0, 0.0, 0.0
    zero = executed_zero(strategy.zero, strategy.dp, strategy.pp)
    link = cluster.link_for_group(dp, strategy.tp)
    per_param = recipe(strategy.precision)
    grad_bytes = params_per_rank * grad_wire_bytes_per_param(strategy.precision, strategy.state_recipe)
    param_bytes = params_per_rank * per_param["param"]  # gathered in the compute dtype
    if zero == 0:
        return all_reduce_time_s(grad_bytes, dp, link), 0.0, 0.0, 0.0
    gather_s = all_gather_time_s(param_bytes, dp, link)
    paper = strategy.state_recipe == "zero-paper"
    reduce = all_reduce_time_s if zero == 1 and paper else reduce_scatter_time_s
    grad_s = reduce(grad_bytes, dp, link)
    if zero == 3:
        return grad_s, 0.0, gather_s, gather_s
    if paper or strategy.pp > 1:
        return grad_s, gather_s, 0.0, 0.0
    return grad_s, 0.0, gather_s, 0.0


def _activation_bytes(layer: LayerProfile, strategy: Strategy, scale: float) -> tuple[float, float]:
    """(bytes saved for backward per micro-batch, transient recompute working set).

    Korthikanti et al. 2022: TP divides the sharded and score bytes by t, SP also the replicated
    bytes; selective recomputation drops the scores; full recomputation keeps only the input
    (/t with SP) and rebuilds the rest, one layer at a time, during backward.
    """
    mbs = strategy.microbatch_size
    split = _is_split(layer, strategy.tp)
    tp = strategy.tp if split else 1
    sp_tp = tp if strategy.sp else 1
    sharded = layer.act_tp_sharded_bytes / tp
    replicated = layer.act_tp_replicated_bytes / sp_tp
    scores = layer.act_attn_score_bytes / tp
    full = (sharded + replicated + scores) * mbs * scale
    if strategy.recompute == "full":
        return layer.input_bytes / sp_tp * mbs * scale, full
    if strategy.recompute == "selective":
        return (sharded + replicated) * mbs * scale, scores * mbs * scale
    return full, 0.0


def p2p_time_s(size_bytes: float, mesh, cluster) -> float:
    """One pipeline boundary transfer of `size_bytes` between neighbouring stages.

    `mesh` is anything with tp, dp, pp (a Strategy or a ParallelConfig); neighbours are dp*tp ranks
    apart, so they share a node only when dp*tp < gpus_per_node. (The arguments may also be
    given as (size_bytes, cluster, mesh).)
    """
    if isinstance(mesh, ClusterProfile):
        mesh, cluster = cluster, mesh
    if mesh.pp <= 1:
        return 0.0
    link = cluster.link_for_group(2, mesh.dp * mesh.tp)
    return send_recv_time_s(size_bytes, link)


# ---------------------------------------------------------------------------------------------
# A whole configuration: stages, the pipeline in closed form, memory per pipeline rank.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageTimes:
    """One pipeline rank. Per micro-batch (all its chunks) unless marked per step."""

    compute_s: float  # forward + backward compute
    recompute_s: float
    tp_comm_s: float  # blocking TP collectives, forward and backward
    zero3_exposed_s: float  # ZeRO-3 gathers not hidden behind the previous layer's compute
    p2p_s: float  # boundary sends of this rank: activations forward, their gradients backward
    dp_exposed_s: float = 0.0  # per step: gradient reduction not hidden behind the last backward
    param_gather_s: float = 0.0  # per step: ZeRO-1/2 parameter all-gather after the optimizer
    optimizer_s: float = 0.0  # per step

    @property
    def per_microbatch_s(self) -> float:
        """Busy time of the compute stream (p2p runs on its own stream: see pipeline_closed_form)."""
        return self.compute_s + self.recompute_s + self.tp_comm_s + self.zero3_exposed_s

    @property
    def tail_s(self) -> float:
        return self.dp_exposed_s + self.param_gather_s + self.optimizer_s


@dataclass(frozen=True)
class StepEstimate:
    """The closed-form step: pipeline (fill, steady state, drain) then the per-step tail."""

    step_time_s: float
    pipeline_time_s: float
    bubble_s: float  # idle time of the busiest rank in fill and drain
    bubble_fraction: float  # bubble_s / step_time_s
    busiest_rank: int
    breakdown: dict[str, float]  # compute, recompute, tp_comm, pp_comm, dp_comm, bubble, optimizer


def pipeline_closed_form(stages: tuple[StageTimes, ...] | list[StageTimes], num_microbatches: int,
                         schedule: str = "1f1b", virtual_stages: int = 1) -> StepEstimate:
    """Step time of m micro-batches through p stages with per-micro-batch times T_i.

    GPipe and 1F1B: (m - 1) max_i T_i + sum_i T_i: the first micro-batch crosses every stage, then
    the slowest stage sets the pace. With balanced stages this is (m + p - 1) T, so the bubble is
    (p - 1) / (m + p - 1) of the pipeline. Interleaved 1F1B with v chunks per rank fills with
    chunks 1/v the size: (m - 1/v) max_i T_i + sum_i T_i / v, i.e. (m + (p - 1)/v) T balanced
    (Narayanan et al. 2021). Sends and receives are asynchronous: in the steady state they hide
    behind compute, but the fill and drain wait for them once per boundary (sum_i p2p_i / v).
    Then the slowest rank's tail (exposed DP communication, ZeRO parameter gathers, optimizer).
    """
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    per_mb = [stage.per_microbatch_s for stage in stages]
    slowest = max(per_mb)
    chunks = virtual_stages if schedule == "interleaved" else 1
    p2p_path_s = sum(stage.p2p_s for stage in stages) / chunks
    pipeline_s = (num_microbatches - 1 / chunks) * slowest + sum(per_mb) / chunks + p2p_path_s
    busiest = per_mb.index(slowest)
    tail_rank = max(range(len(stages)), key=lambda i: stages[i].tail_s)
    tail = stages[tail_rank]
    step_s = pipeline_s + tail.tail_s
    bubble_s = max(0.0, pipeline_s - p2p_path_s - num_microbatches * slowest)
    busy = stages[busiest]
    m = num_microbatches
    breakdown = {
        "compute": m * busy.compute_s, "recompute": m * busy.recompute_s,
        "tp_comm": m * busy.tp_comm_s, "pp_comm": p2p_path_s,
        "dp_comm": m * busy.zero3_exposed_s + tail.dp_exposed_s + tail.param_gather_s,
        "bubble": bubble_s, "optimizer": tail.optimizer_s,
    }
    return StepEstimate(step_time_s=step_s, pipeline_time_s=pipeline_s, bubble_s=bubble_s,
                        bubble_fraction=bubble_s / step_s if step_s > 0 else 0.0,
                        busiest_rank=busiest, breakdown=breakdown)


def strategy_for(config, recompute: str | None = None) -> Strategy:
    """The Strategy every layer of a uniform ParallelConfig runs under."""
    return Strategy(tp=config.tp, dp=config.dp, zero=config.zero, recompute=recompute or config.recompute,
                    sp=config.sp, microbatch_size=config.microbatch_size, precision=config.precision, pp=config.pp)


def default_recompute(graph, config) -> tuple[str, ...]:
    """Recomputation applies to transformer blocks (and unknown layers), not embedding or head."""
    return tuple("none" if layer.kind in ("embedding", "head") else config.recompute for layer in graph.layers)


def balanced_layer_chunks(graph, cluster: ClusterProfile, config) -> tuple[int, ...]:
    """Chunk index per layer: pp * virtual_stages contiguous non-empty chunks, slowest minimal.

    A layer weighs its per-micro-batch time (compute, recomputation, TP collectives). The optimal
    bottleneck is found by bisection on a greedy feasibility test (a chunk closes when the next
    layer would exceed the bound); the result is exact to 1e-9 relative.
    """
    num_chunks = config.num_model_chunks
    if num_chunks > len(graph.layers):
        raise ValueError(f"{num_chunks} pipeline chunks (pp {config.pp} x virtual stages {config.virtual_stages}) "
                         f"need at least that many layers; the model has {len(graph.layers)}")
    recomputes = default_recompute(graph, config)
    weights = [_layer_time_s(layer_cost(layer, strategy_for(config, r), cluster, graph.info, profile_dtype=graph.dtype,
                                           attention=graph.attention))
               for layer, r in zip(graph.layers, recomputes)]
    low, high = max(weights), sum(weights)
    for _ in range(100):
        if high - low <= 1e-9 * high:
            break
        mid = (low + high) / 2
        if _greedy_chunks(weights, mid, num_chunks) is None:
            low = mid
        else:
            high = mid
    chunks = _greedy_chunks(weights, high, num_chunks)
    assert chunks is not None
    return chunks


def _layer_time_s(cost: LayerCost) -> float:
    return cost.fwd_compute_s + cost.bwd_compute_s + cost.recompute_s + cost.tp_fwd_comm_s + cost.tp_bwd_comm_s


def _greedy_chunks(weights: list[float], bound: float, num_chunks: int) -> tuple[int, ...] | None:
    """Pack layers left to right under `bound`; open a new chunk early when the layers left are
    just enough to give every later chunk one. None if some chunk must exceed `bound`."""
    chunks: list[int] = []
    chunk, load = 0, 0.0
    for index, weight in enumerate(weights):
        layers_left = len(weights) - index  # including this one
        later_chunks = num_chunks - 1 - chunk
        if index and later_chunks and (load + weight > bound or layers_left == later_chunks):
            chunk, load = chunk + 1, 0.0
        if load + weight > bound * (1 + 1e-12):
            return None
        chunks.append(chunk)
        load += weight
    return tuple(chunks) if chunk == num_chunks - 1 else None
