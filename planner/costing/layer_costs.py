"""Cost model: time and memory of one layer under one strategy, and of a whole configuration.

(Owned by the cost model; the dataclasses below are the contract the simulator and the solver
read. Add fields freely; do not rename.)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.planner.costing import fixed_costs, fp8
from meshplan.planner.costing.device_time import (ATTENTION_BMMS_PER_BLOCK, DTYPE_BYTES,  # noqa: F401
                                                  attention_time_s, causal_skipped_flops, compute_time_s, flash_attention_flops,
                                                  gemm_and_attention_times_s, infer_seq, memory_time_s)
from meshplan.planner.costing.collectives import (all_gather_time_s, all_reduce_time_s, collective_time_s,
                                                  reduce_scatter_time_s, send_recv_time_s)
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.costing.state_memory import grad_wire_bytes_per_param, state_bytes


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
    precision: str = "bf16-mixed"  # bf16-mixed | fp32 | fp8
    pp: int = 1  # only for which link pipeline transfers cross
    # Where model states live: "executor" (what `meshplan train` allocates) or "zero-paper"
    # (Rajbhandari et al.'s 2 + 2 + 12 bytes per parameter); see planner.costing.state_memory.
    state_recipe: str = "executor"
    # HSDP: ZeRO shards over groups of this many consecutive dp ranks (stride tp) and replicates
    # across dp / shard_group of them; None shards over all dp ranks.
    shard_group: int | None = None
    # Context parallelism: each of `cp` ranks (tp apart) holds 1/cp of every sequence.
    cp: int = 1
    # Expert parallelism: MoE blocks' routed experts split over `ep` data ranks (tp apart), carved
    # out of dp * cp (planner.costing.expert_parallel).
    ep: int = 1


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
    cp_fwd_comm_s: float = 0.0  # blocking context-parallel K/V all-gather in forward
    cp_bwd_comm_s: float = 0.0  # blocking reduce-scatter of the K/V gradients in backward (+ re-gather)
    ep_fwd_comm_s: float = 0.0  # blocking expert-parallel all-to-alls in forward (dispatch, combine)
    ep_bwd_comm_s: float = 0.0  # their mirrors in backward (+ the recomputed forward's)
    expert_fwd_s: float = 0.0  # the routed experts' part of fwd_compute_s (busiest rank)
    expert_bwd_s: float = 0.0  # the routed experts' part of bwd_compute_s
    expert_state_bytes: float = 0.0  # the routed experts' part of param + grad + optimizer bytes

    @property
    def fwd_blocking_comm_s(self) -> float:
        """The forward's collectives that block compute: TP's, context parallelism's K/V exchange,
        expert parallelism's all-to-alls."""
        return self.tp_fwd_comm_s + self.cp_fwd_comm_s + self.ep_fwd_comm_s

    @property
    def bwd_blocking_comm_s(self) -> float:
        """The backward's collectives that block compute (the recomputed forward's included)."""
        return self.tp_bwd_comm_s + self.cp_bwd_comm_s + self.ep_bwd_comm_s

    @property
    def fwd_busy_s(self) -> float:
        """The forward's compute-stream time, which a prefetched gather hides behind."""
        return self.fwd_compute_s + self.fwd_blocking_comm_s

    @property
    def bwd_busy_s(self) -> float:
        """The backward's compute-stream time, the recomputed forward included."""
        return self.bwd_compute_s + self.recompute_s + self.bwd_blocking_comm_s

    @property
    def fwd_gather_exposure_s(self) -> tuple[float, float]:
        """(steady, head) exposure of the forward's parameter gather (`gather_exposure_s`)."""
        return gather_exposure_s(self.fwd_gather_s, self.fwd_busy_s)

    @property
    def bwd_gather_exposure_s(self) -> tuple[float, float]:
        """(steady, head) exposure of the backward's parameter gather (`gather_exposure_s`)."""
        return gather_exposure_s(self.bwd_gather_s, self.bwd_busy_s)


def gather_exposure_s(gather_s: float, busy_s: float) -> tuple[float, float]:
    """(steady, head): what a layer's parameter all-gather (ZeRO-3; FSDP2's ZeRO-1/2 forward) adds to
    a pass over a model chunk, as FSDP2 prefetches it one layer ahead.

    Gather i runs while layer i-1 computes, so in a run of identical layers each layer exposes
    steady = max(0, g - busy). The pass's first layer has no layer before it in its chunk: its
    gather starts with the pass, and for n identical layers the pass ends at n max(g, busy) +
    min(g, busy) (n g + busy when gathers are the longer, g + n busy when compute is), so the
    first layer of every chunk's forward and the last of its backward add head = min(g, busy).
    The event engine plays the exact recurrence (`simulation.engine._pass_end_times`); the ILP and
    the closed form charge steady per layer and head per chunk pass, equal to it for identical layers.
    """
    return max(0.0, gather_s - busy_s), min(gather_s, busy_s)


def pass_gather_exposure_s(gather_s, busy_s) -> float:
    """The gather time one pass over a chunk's layers (in pass order: the backward's is reversed)
    exposes by these rules: every layer's steady share, the first layer's head, and where a layer
    follows another kind, what hiding behind that layer changes. Equal to the engine's recurrence
    for a run of identical layers, alone or between two others."""
    exposed = 0.0
    for i, (gather, busy) in enumerate(zip(gather_s, busy_s)):
        steady, head = gather_exposure_s(gather, busy)
        exposed += steady + (head if i == 0 else after_other_gather_s(gather, busy, busy_s[i - 1]))
    return exposed


def after_other_gather_s(gather_s: float, busy_s: float, prev_busy_s: float) -> float:
    """What a layer's gather adds beyond its steady exposure (negative: saves) when the layer
    before it in the pass is another kind (the embedding before the first block, the head's
    backward before the last block's): prefetch hides it behind that layer's busy time, not its
    own. With it, steady and head per chunk pass equal the engine's recurrence for a run of
    identical layers between two others."""
    return max(0.0, gather_s - prev_busy_s) - max(0.0, gather_s - busy_s)


# ---------------------------------------------------------------------------------------------
# The model. Everything below is a pure function of (layer, strategy, cluster, info).
# ---------------------------------------------------------------------------------------------


# Bytes per parameter of each precision recipe (the ZeRO paper's mixed-precision
# Adam; plain fp32 Adam needs no master copy: 4 param + 4 grad + 2 x 4 moments).
PRECISION_RECIPES: dict[str, dict[str, float]] = {
    "bf16-mixed": {"param": 2.0, "grad": 2.0, "optimizer": 12.0},
    "fp32": {"param": 4.0, "grad": 4.0, "optimizer": 8.0},
    "fp8": {"param": 2.0, "grad": 2.0, "optimizer": 12.0},  # bf16-mixed's states; see planner.costing.fp8
}
# The dtype of everything but the fp8 Linears' GEMMs (fp8: attention, norms, activations in bf16).
COMPUTE_DTYPE = {"bf16-mixed": "bf16", "fp32": "fp32", "fp8": "bf16"}
# PyTorch DDP's default gradient bucket (bucket_cap_mb=25): a software default, not hardware.
DDP_BUCKET_BYTES = 25 * 2**20


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


def selective_recompute_flops(layer: LayerProfile, info: ModelInfo, dtype: str) -> float:
    """Forward FLOPs of the attention core (QK^T, softmax x V) per sample: 4 s^2 h (Korthikanti).

    Only math attention stores the scores that selective recomputation drops. A flash kernel
    keeps none, but the executor's policy (`executor.parallel.recompute`) still reruns its
    forward in backward: `_compute_times_s` charges that at the kernels' attention efficiency.
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
    if strategy.tp > 1 and info.family == "hf" and layer.kind == "block" and layer.tp_split.kind == "none":
        raise ValueError(f"layer {layer.name!r} cannot be split tp={strategy.tp} ways: "
                         f"{layer.tp_split.reason or 'no known tensor-parallel layout'}")
    if layer.expert_params and strategy.cp == 1:
        return _moe_block_cost(layer, strategy, cluster, info, profile_dtype=profile_dtype,
                               holds_shared=holds_shared, attention=attention)
    if strategy.cp > 1:
        return _context_parallel_cost(layer, strategy, cluster, info, profile_dtype=profile_dtype,
                                      holds_shared=holds_shared, attention=attention)
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
    wrapped = fixed_costs.dp_wrapped(tp, dp, strategy.zero, strategy.pp)
    if wrapped:  # FSDP / replicate hooks per pass
        fwd_s += cluster.device.dp_unit_overhead_s
        bwd_s += cluster.device.dp_unit_overhead_s
    if strategy.recompute == "full":
        tp_bwd_s += tp_fwd_s  # the recomputed forward repeats its collectives

    num_params = layer.num_params + _extra_vocab_params(layer, tp, info)
    if holds_shared:
        num_params += layer.shared_params
    params_per_rank = num_params / shard
    memory = model_state_bytes(params_per_rank, dp, strategy.zero, strategy.precision, strategy.state_recipe,
                               tp, strategy.pp, strategy.shard_group)
    zero = strategy.zero  # the stage the executor runs (`pipeline.strategy_for`: `executed_zero`)
    compute_bytes = recipe(strategy.precision)["param"]
    # bytes per parameter a gather moves and an unsharded copy holds (fp8: float8 all-gather)
    gather_bytes = fp8.gather_bytes_per_param(layer, info, strategy.precision, zero, dp, compute_bytes)
    if strategy.state_recipe == "executor" and zero in (1, 2) and gather_bytes < compute_bytes:
        memory = {**memory, "params": memory["params"] - params_per_rank * (compute_bytes - gather_bytes)}
    grad_comm_s, gather_s, fwd_gather_s, bwd_gather_s = _dp_comm_s(params_per_rank, strategy, cluster, gather_bytes)
    if holds_shared and layer.shared_params and strategy.pp > 1:
        shared_bytes = layer.shared_params / shard * grad_wire_bytes_per_param(strategy.precision,
                                                                                strategy.state_recipe)
        link = cluster.link_for_group(2, strategy.dp * strategy.tp * (strategy.pp - 1))
        grad_comm_s += all_reduce_time_s(shared_bytes, 2, link)
    owned_params = params_per_rank / ((strategy.shard_group or dp) if strategy.zero >= 1 else 1)  # sharded states
    # AdamW streams its states through memory, and pays a fixed cost per parameter tensor
    optimizer_s = owned_params * cluster.optimizer_bytes_per_param / (
        cluster.device.memory_bw_bytes_per_s * cluster.device.memory_efficiency) + fixed_costs.optimizer_fixed_s(
        fixed_costs.num_param_tensors(layer, info, holds_shared),
        fixed_costs.holds_dtensors(split, tp, dp, strategy.zero, strategy.pp), cluster)
    if split:
        optimizer_s += fixed_costs.tp_norm_grad_sync_s(layer, info, tp, cluster)
    if wrapped:  # FSDP's copies around its collectives, on the compute path
        host_fwd_s, host_bwd_s, host_step_s = fixed_costs.dp_host_overhead_s(
            zero, strategy.pp, params_per_rank * gather_bytes,
            params_per_rank * grad_wire_bytes_per_param(strategy.precision, strategy.state_recipe), cluster)
        fwd_s, bwd_s, optimizer_s = fwd_s + host_fwd_s, bwd_s + host_bwd_s, optimizer_s + host_step_s

    executor = strategy.state_recipe == "executor"
    activation_bytes, buffer_bytes = _activation_bytes(layer, strategy, act_scale * vocab_scale, executor=executor)
    activation_bytes, buffer_bytes = fp8.adjust_memory(layer, info, strategy, split, executor, zero, act_scale,
                                                       activation_bytes, buffer_bytes)
    gathered_bytes = params_per_rank * gather_bytes  # one unsharded copy, compute dtype (fp8 Linears: fp8)
    # The zoo's embedding and head belong to the stage's root FSDP unit; a file or HF model's are
    # units of their own (`executor.filemodel._fsdp_units`) unless a tied weight keeps them in the root.
    fsdp_root = executor and layer.kind in ("embedding", "head") and (
        info.family not in ("file", "hf") or info.tied_embeddings)
    if zero == 3 and not (fsdp_root and dp > 1):  # gathered full parameters live during fwd/bwd
        buffer_bytes += gathered_bytes
    if executor:
        extra_params, extra_grads, extra_buffer = _executor_memory_extras(
            layer, strategy, info, zero, gathered_bytes, fsdp_root, split, vocab_scale, profile_dtype or dtype,
            unit_params=params_per_rank, compute_bytes=compute_bytes)
        memory = {**memory, "params": memory["params"] + extra_params, "grads": memory["grads"] + extra_grads}
        buffer_bytes += extra_buffer
    out_shard = tp if strategy.sp and split else 1
    return LayerCost(
        fwd_compute_s=fwd_s, bwd_compute_s=bwd_s, recompute_s=recompute_s,
        tp_fwd_comm_s=tp_fwd_s, tp_bwd_comm_s=tp_bwd_s, fwd_gather_s=fwd_gather_s, bwd_gather_s=bwd_gather_s,
        dp_grad_comm_s=grad_comm_s, dp_param_gather_s=gather_s, optimizer_step_s=optimizer_s,
        param_bytes=memory["params"], grad_bytes=memory["grads"], optimizer_bytes=memory["optimizer"],
        activation_bytes=activation_bytes, buffer_bytes=buffer_bytes,
        output_bytes=layer.output_bytes * mbs * act_scale / out_shard,
    )


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
    attention_fwd = flash_attention_flops(layer, attention, cluster) * mbs / shard
    if fp8.is_fp8(strategy.precision) and fp8.converts(layer):  # the Linears' GEMMs in fp8, plus casts
        fwd_gemm_s, bwd_gemm_s = fp8.gemm_times_s(layer, info, cluster, fwd_flops, bwd_flops, shard, mbs, profile_dtype,
                                                  attention_fwd)
    else:
        fwd_gemm_s, bwd_gemm_s = _matmul_times_s(layer, fwd_flops, bwd_flops, mbs / shard, gemms, cluster, dtype,
                                                 attention_fwd)
    # Norm outputs rebuilt in backward rather than kept are still written by the forward and read
    # by the backward, as when they were kept (the traffic proxy counts them alike), and the
    # backward writes them once more (`transformer.normed_call`; not under recomputation, which
    # keeps them: `_activation_bytes`).
    rebuilt_bytes = _rebuilt_bytes(layer, strategy, act_scale)
    saved_bytes += rebuilt_bytes
    bwd_extra = rebuilt_bytes if strategy.recompute == "none" else 0.0
    fwd_s = fwd_gemm_s + memory_time_s(traffic_per_act_byte * saved_bytes, cluster)
    bwd_s = bwd_gemm_s + memory_time_s(traffic_per_act_byte * (2 * saved_bytes + bwd_extra), cluster)
    if strategy.recompute == "full":
        return fwd_s, bwd_s, fwd_s
    if strategy.recompute == "selective":
        flops = selective_recompute_flops(layer, info, profile_dtype) * mbs / shard
        if flops:
            score_bytes = layer.act_attn_score_bytes * mbs * act_scale / shard
            return fwd_s, bwd_s, (compute_time_s(flops, ATTENTION_BMMS_PER_BLOCK, cluster, dtype)
                                  + memory_time_s(traffic_per_act_byte * score_bytes, cluster))
        if attention == "flash" and layer.attn_fwd_flops:  # the policy reruns the flash kernel's forward
            if attention_fwd:
                return fwd_s, bwd_s, attention_time_s(attention_fwd, cluster, dtype)
            core = (layer.attn_fwd_flops - skipped) * mbs / shard
            return fwd_s, bwd_s, compute_time_s(core, ATTENTION_BMMS_PER_BLOCK, cluster, dtype)
    return fwd_s, bwd_s, 0.0


def _matmul_times_s(layer: LayerProfile, fwd_flops: float, bwd_flops: float, scale: float, gemms: int,
                    cluster: ClusterProfile, dtype: str, attention_fwd_flops: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of a layer's matmul work: GEMMs on the efficiency curve, a
    traced layer's convolutions (`conv_fwd_flops`, `conv_bwd_flops`) at `conv_efficiency` of it,
    and `attention_fwd_flops` of flash attention (twice as many backward) at `attention_time_s`."""
    conv_fwd, conv_bwd = layer.conv_fwd_flops * scale, layer.conv_bwd_flops * scale
    fwd_s, bwd_s = gemm_and_attention_times_s(fwd_flops - conv_fwd, bwd_flops - conv_bwd, attention_fwd_flops,
                                              gemms, cluster, dtype)
    if conv_fwd or conv_bwd:
        efficiency = cluster.device.conv_efficiency
        fwd_s += compute_time_s(conv_fwd, gemms, cluster, dtype, num_launches=0) / efficiency
        bwd_s += compute_time_s(conv_bwd, 2 * gemms, cluster, dtype, num_launches=0) / efficiency
    return fwd_s, bwd_s


def model_state_bytes(num_params: float, dp: int, zero: int, precision: str, recipe: str = "zero-paper",
                      tp: int = 1, pp: int = 1, shard: int | None = None) -> dict[str, float]:
    """Resident params / grads / optimizer bytes per rank for `num_params` (already / tp).

    ZeRO (Rajbhandari et al. 2020) shards over the dp ranks: stage 1 the optimizer states,
    stage 2 also the gradients, stage 3 also the parameters. With bf16-mixed that gives
    (2+2+12)P, 4P + 12P/d, 2P + 14P/d and 16P/d bytes for stages 0-3. `recipe="executor"`
    gives what the executor's DDP / FSDP2 realisation allocates (planner.costing.state_memory).
    """
    return state_bytes(num_params, dp, zero, precision, recipe, tp, pp, shard)


def _tp_comm_s(layer: LayerProfile, strategy: Strategy, cluster: ClusterProfile, act_scale: float) -> tuple[float, float]:
    """Blocking TP collectives of one micro-batch (forward, backward), Megatron pattern.

    Block: `num_allreduce_per_pass` all-reduces of the (b, s, h) output per pass; with SP each
    becomes an all-gather + reduce-scatter of the same tensor (same ring volume), and a block
    without recomputation all-gathers each region's input once more in backward (it kept the
    shard). Vocab-parallel
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
        regather = 0.0
        if strategy.sp:
            one = all_gather_time_s(size, tp, link) + reduce_scatter_time_s(size, tp, link)
            if strategy.recompute == "none":  # the kept shard is gathered again for the weight gradients
                regather = all_gather_time_s(size, tp, link)
        else:
            one = all_reduce_time_s(size, tp, link)
        count = layer.tp_split.num_allreduce_per_pass
        return count * one, count * (one + regather)
    if layer.kind == "embedding":
        size = layer.output_bytes * mbs * act_scale
        return (reduce_scatter_time_s(size, tp, link) if strategy.sp else all_reduce_time_s(size, tp, link)), 0.0
    size = layer.input_bytes * mbs * act_scale
    if strategy.sp:
        return all_gather_time_s(size, tp, link), reduce_scatter_time_s(size, tp, link)
    return 0.0, all_reduce_time_s(size, tp, link)


def _dp_comm_s(params_per_rank: float, strategy: Strategy, cluster: ClusterProfile,
               gather_bytes_per_param: float | None = None) -> tuple[float, float, float, float]:
    """(gradient reduction per step, parameter all-gather per step, all-gather before each
    micro-batch's forward, all-gather before each micro-batch's backward).

    ZeRO-0 all-reduces gradients once per step (DDP / FSDP2 replicate, sync deferred to the last
    micro-batch). ZeRO-1/2/3 reduce-scatter. Parameter gathers follow the recipe:
    - "zero-paper" (Megatron-LM's distributed optimizer): ZeRO-1/2 all-gather the updated
      parameters once after the optimizer; ZeRO-3 gathers before every forward and backward;
    - "executor" (FSDP2 as `meshplan train` runs it): without pipelining, FSDP2 reshards after
      every backward, so ZeRO-1/2 (`reshard_after_forward=False`) gather once per micro-batch,
      before its forward, and ZeRO-3 before its forward and again before its backward. Under
      torch pipelining ZeRO-1/2 do not reshard after backward until the last micro-batch, so
      their parameters are gathered once per step; ZeRO-3 still gathers twice per micro-batch
      (`executor.parallel.pipeline`; split-backward schedules run ZeRO-2/3 as ZeRO-1:
      `executed_zero`).
    Gradient reductions are counted once per step here; the simulator repeats them per
    micro-batch where the executor does (`grad_sync_mode`). Gathers move the compute dtype, or
    `gather_bytes_per_param` (fp8's float8 all-gather, `fp8.gather_bytes_per_param`).
    """
    dp = strategy.dp
    if dp == 1:
        return 0.0, 0.0, 0.0, 0.0
    zero = strategy.zero
    per_param = recipe(strategy.precision)
    grad_bytes = params_per_rank * grad_wire_bytes_per_param(strategy.precision, strategy.state_recipe)
    param_bytes = params_per_rank * (per_param["param"] if gather_bytes_per_param is None else gather_bytes_per_param)
    if zero == 0:
        return collective_time_s("all_reduce", grad_bytes, dp, cluster, strategy.tp), 0.0, 0.0, 0.0
    # ZeRO shards over `shard` ranks spaced tp apart (all of dp, or HSDP's shard group); HSDP then
    # all-reduces each rank's 1/shard of the reduced gradient across the dp/shard replicas, whose
    # ranks are shard*tp apart (FSDP2's HSDP: reduce-scatter, then all-reduce of the shard).
    shard = strategy.shard_group or dp
    gather_s = collective_time_s("all_gather", param_bytes, shard, cluster, strategy.tp)
    paper = strategy.state_recipe == "zero-paper"
    reduce = "all_reduce" if zero == 1 and paper else "reduce_scatter"
    grad_s = collective_time_s(reduce, grad_bytes, shard, cluster, strategy.tp)
    if shard < dp:
        grad_s += collective_time_s("all_reduce", grad_bytes / shard, dp // shard, cluster, strategy.tp * shard)
    if zero == 3:
        return grad_s, 0.0, gather_s, gather_s
    if paper or strategy.pp > 1:
        return grad_s, gather_s, 0.0, 0.0
    return grad_s, 0.0, gather_s, 0.0


def _rebuilt_bytes(layer: LayerProfile, strategy: Strategy, scale: float) -> float:
    """A micro-batch's norm outputs rebuilt in backward on one rank (outside the TP region: /t
    only with SP)."""
    sp_tp = strategy.tp if strategy.sp and _is_split(layer, strategy.tp) else 1
    return layer.act_rebuilt_bytes / sp_tp * strategy.microbatch_size * scale


def _activation_bytes(layer: LayerProfile, strategy: Strategy, scale: float,
                      executor: bool = False) -> tuple[float, float]:
    """(bytes saved for backward per micro-batch, transient working set: what recomputation
    rebuilds of one layer, or without it one rebuilt norm output).

    Korthikanti et al. 2022: TP divides the sharded and score bytes by t, SP also the replicated
    bytes; selective recomputation drops the scores; full recomputation keeps only the input
    (/t with SP) and rebuilds the rest, one layer at a time, during backward.

    `executor=True`: what `meshplan train` keeps (state recipe "executor"), measured on CPU with
    `executor.memory.StepMemTracker` (tests/executor/test_memory_prediction.py):

    - SP: each column-parallel region (a block's attention and MLP, the head's output Linear)
      all-gathers its sequence-sharded input. A block without recomputation keeps only the
      shard and gathers again in backward, as Megatron-LM does (`models.tensor_parallel.
      GatherKeepShard`), so its bytes are /t like the rest. The head's Linear, and the blocks
      under selective recomputation (whose checkpoint caches the gather's output), save the
      gathered (mbs, s, h) tensor whole on every TP rank: one per region
      (`num_allreduce_per_pass` for a block, one for the head), not divided by t. Measured
      (llama, tp 2, before the shard was kept): +2 mbs*s*h*4 bytes per block, as this rule says.
    - bf16-mixed by autocast (the executor's choice when no FSDP wrapper casts the parameters:
      `state_memory.dp_method` "none" or "ddp"): the norms and the residual stream stay fp32,
      so a block's or head's replicated bytes other than its Linears' inputs (the norm inputs)
      take 4 bytes per value; autocast caches only casts of parameters, so every column Linear
      (q, k, v, up, gate) saves its own bf16 copy of the norm's output instead of one shared
      tensor; and each Linear saves the bf16 copy of its weight that autocast made for that
      forward: 2 bytes per parameter of the layer per micro-batch in flight (the head's tied
      weight included; the embedding is no autocast op). Measured: 1.004 MiB per GPT block
      (h 128, s 64, mbs 2), where the bf16 profile says 0.535 and this rule 1.040 (the
      profile's copy of the attention output, a view on CPU, is the difference).

    The time model's memory traffic (`_compute_times_s`) keeps the default accounting.
    """
    from meshplan.planner.costing.state_memory import dp_method

    mbs = strategy.microbatch_size
    split = _is_split(layer, strategy.tp)
    tp = strategy.tp if split else 1
    sp_tp = tp if strategy.sp else 1
    sharded = layer.act_tp_sharded_bytes / tp
    # norm outputs rebuilt in backward are kept after all under recomputation (whose checkpoint
    # the executor does not mix with references: `executor.parallel.recompute`)
    kept_rebuilt = layer.act_rebuilt_bytes if strategy.recompute == "selective" else 0
    replicated = (layer.act_tp_replicated_bytes + kept_rebuilt) / sp_tp
    weight_copies = 0.0
    autocast = executor and strategy.precision == "bf16-mixed" and dp_method(
        strategy.zero, strategy.dp, strategy.tp, strategy.pp) in ("none", "ddp")
    if executor and layer.kind in ("block", "head"):
        regions = layer.tp_split.num_allreduce_per_pass if layer.kind == "block" else 1
        linear_inputs = min(layer.input_bytes * regions, layer.act_tp_replicated_bytes + layer.act_rebuilt_bytes)
        # the norm outputs, unless the profile has them rebuilt (then not in the replicated bytes)
        profiled_inputs = linear_inputs if not layer.act_rebuilt_bytes else 0.0
        norm_inputs = layer.act_tp_replicated_bytes - profiled_inputs
        # SP: the Linears' inputs are kept gathered, whole (see above)
        gathered = split and strategy.sp and (layer.kind == "head" or strategy.recompute == "selective")
        copies = 1.0
        if autocast:  # each Linear keeps its own bf16 cast: no shared output to rebuild
            column_linears = len(layer.tp_split.column_linears) if layer.kind == "block" else 1
            copies = max(1.0, column_linears / max(1, regions))
        kept_inputs = linear_inputs if (gathered or autocast or kept_rebuilt) else profiled_inputs
        replicated = (norm_inputs * (2.0 if autocast else 1.0) / sp_tp
                      + kept_inputs * copies / (1 if gathered else sp_tp))
    if autocast and layer.kind != "embedding":
        weights = layer.num_params + (layer.shared_params if layer.kind == "head" else 0)
        weight_copies = 2.0 * weights / tp
    scores = layer.act_attn_score_bytes / tp
    full = (sharded + replicated + scores) * mbs * scale + weight_copies
    if strategy.recompute == "full":
        return layer.input_bytes / sp_tp * mbs * scale, full
    if strategy.recompute == "selective":
        return (sharded + replicated) * mbs * scale + weight_copies, scores * mbs * scale
    # a norm output rebuilt in backward lives while the Linears after it run theirs: one at a time
    norms = 2 if layer.kind == "block" else 1
    return full, _rebuilt_bytes(layer, strategy, scale) / norms


LOSS_FP32_COPIES = 2  # nll_loss's dense gradient and log_softmax's backward output
LOSS_PARALLEL_FP32_COPIES = 3  # loss_parallel's backward: one-hot mask, exp(log-probs), their sum
REDUCE_SCATTER_INPUT_BYTES = 4.0  # FSDP2's reduce-scatter input per parameter (fp32 reduce dtype)


def _executor_memory_extras(layer: LayerProfile, strategy: Strategy, info: ModelInfo, zero: int,
                            gathered_bytes: float, fsdp_root: bool, split: bool, vocab_scale: float,
                            profile_dtype: str, unit_params: float = 0.0,
                            compute_bytes: float = 2.0) -> tuple[float, float, float]:
    """(params, grads, transient buffer) bytes that `meshplan train` allocates beyond the model
    states of `state_memory` and the saved activations, per rank. Each was measured on CPU with
    `executor.memory.StepMemTracker` (tests/executor/test_memory_prediction.py):

    - the loss (head): its backward materialises fp32 tensors of the micro-batch's (local)
      logits at once: nll_loss's dense gradient and log_softmax's backward output
      (`LOSS_FP32_COPIES`); under TP, `loss_parallel`'s backward builds the one-hot mask,
      exp(log-probs) and their sum (`LOSS_PARALLEL_FP32_COPIES`). A transient of the backward's
      first step, while every activation of the micro-batch is still live;
    - a vocab-parallel embedding under TP whose weight is not tied to a head on the same rank:
      its gradient comes back as a Replicate DTensor of the whole (vocab, hidden) table and is
      sharded only after the last micro-batch (`executor.runtime._align_grad_placements`), so
      the step holds the whole table's fp32 gradient, not 1/t of it. (Tied to the head on the
      rank, the sum with the head's sharded gradient stays sharded: measured);
    - FSDP2 (ZeRO 1-3, dp > 1) without pipelining: each unit's all-gather output stays alive
      until the next unit's all-gather (`comm_ctx.all_gather_state`, kept so the copy-in buffer
      is not reused early): one more unsharded copy of a unit's parameters, transient, during
      every micro-batch's forward (and ZeRO-3's backward). Under torch pipelining ZeRO-1/2
      units are gathered once per step, in the first micro-batch's forward, when few
      activations are live: measured, it never reaches the peak, so it is not added (ZeRO-3
      gathers in every micro-batch's forward: added);
    - ZeRO-3: the stage's root FSDP unit (embedding, head: everything outside the blocks) is
      not resharded after forward (FSDP2 keeps the root gathered for the backward that
      follows), so its unsharded copy is live through forward and backward, like parameters;
    - ZeRO-2/3 (a reduce-scatter after every micro-batch's backward): while a unit's backward
      runs, its unsharded gradient (compute dtype) is live next to the previous unit's fp32
      reduce-scatter input, which FSDP2 keeps until the next reduce-scatter is issued
      (`set_reduce_scatter_max_input_buffers`, one by default): `REDUCE_TRANSIENT` per
      parameter of the unit, during backward, when the forward's gathered copy is gone (the
      larger of the two is the layer's transient). Measured under pipelining, where a backward
      runs while other micro-batches' activations are live: +1.45 MiB per 2-block fp32 stage,
      as this rule says. Without pipelining a micro-batch's backward frees its activations as
      the transient comes, and the forward's end stays the peak: measured, charging it there
      over-predicts (dp2 ZeRO-2 +6.6%, an HF model under ZeRO-3 +20%), so it is not.
    """
    extra_params = extra_grads = extra_buffer = 0.0
    tp, dp, mbs = strategy.tp, strategy.dp, strategy.microbatch_size
    if layer.kind == "head" and layer.tp_split.kind == "vocab":
        logits = layer.output_bytes / DTYPE_BYTES.get(profile_dtype, 2) * mbs * vocab_scale / (tp if split else 1)
        extra_buffer += 4.0 * logits * (LOSS_PARALLEL_FP32_COPIES if split else LOSS_FP32_COPIES)
    if layer.kind == "embedding" and split and info.hidden and info.padded_vocab \
            and not (info.tied_embeddings and strategy.pp == 1):
        table = info.padded_vocab * vocab_scale * info.hidden
        extra_grads += 4.0 * table * (1 - 1 / tp)
    if dp > 1 and zero >= 1:
        # under pipelining a ZeRO-1/2 unit is gathered once per step, in the first micro-batch's
        # forward, far from the peak: not added; ZeRO-3 gathers in every micro-batch's forward
        if strategy.pp == 1 or zero == 3:
            extra_buffer += gathered_bytes
        if zero >= 2 and strategy.pp > 1:  # a backward beside other micro-batches' activations
            extra_buffer = max(extra_buffer, unit_params * (compute_bytes + REDUCE_SCATTER_INPUT_BYTES))
        if zero == 3 and fsdp_root:
            extra_params += gathered_bytes
    return extra_params, extra_grads, extra_buffer


def p2p_time_s(size_bytes: float, mesh, cluster) -> float:
    """One pipeline boundary transfer of `size_bytes` between neighbouring stages.

    `mesh` is anything with tp, dp, pp (a Strategy or a ParallelConfig); neighbours are dp*cp*tp ranks
    apart, so they share a node only when dp*cp*tp < gpus_per_node. (The arguments may also be
    given as (size_bytes, cluster, mesh).)
    """
    if isinstance(mesh, ClusterProfile):
        mesh, cluster = cluster, mesh
    if mesh.pp <= 1:
        return 0.0
    link = cluster.link_for_group(2, mesh.dp * getattr(mesh, "cp", 1) * mesh.tp)
    return send_recv_time_s(size_bytes, link)


def _context_parallel_cost(layer: LayerProfile, strategy: Strategy, cluster: ClusterProfile, info: ModelInfo,
                           *, profile_dtype: str | None, holds_shared: bool, attention: str) -> LayerCost:
    """`layer_cost` under context parallelism (planner.costing.context_parallel): the layer's
    per-token work at mbs/cp, data parallelism over dp*cp, plus the K/V exchange and the
    gathered K/V that attention's backward keeps."""
    from meshplan.planner.costing import context_parallel as cpm

    local = layer_cost(layer, cpm.data_view(strategy), cluster, info, profile_dtype=profile_dtype,
                       holds_shared=holds_shared, attention=attention)
    dtype = COMPUTE_DTYPE[strategy.precision]
    gathered = cpm.kv_gather_bytes(layer, strategy, info, profile_dtype or dtype, dtype)
    fwd_s, bwd_s = cpm.cp_comm_s(gathered, strategy, cluster)
    kept = gathered * (1 - 1 / strategy.cp) if strategy.recompute != "full" else 0.0
    return replace(local, cp_fwd_comm_s=fwd_s, cp_bwd_comm_s=bwd_s, activation_bytes=local.activation_bytes + kept)



def _moe_block_cost(layer: LayerProfile, strategy: Strategy, cluster: ClusterProfile, info: ModelInfo,
                    *, profile_dtype: str | None, holds_shared: bool, attention: str) -> LayerCost:
    """`layer_cost` of a MoE block (planner.costing.expert_parallel): the block without its
    routed experts as any layer, plus the experts on the busiest rank: GEMMs at the per-expert
    size, their states over the expert-data group, and the dispatch / combine all-to-alls."""
    from meshplan.planner.costing import expert_parallel as epm

    dense = layer_cost(epm.dense_part(layer), strategy, cluster, info, profile_dtype=profile_dtype,
                       holds_shared=holds_shared, attention=attention)
    dtype = COMPUTE_DTYPE[strategy.precision]
    act_scale = DTYPE_BYTES[dtype] / DTYPE_BYTES.get(profile_dtype or dtype, 2)
    split = _is_split(layer, strategy.tp)
    shard = strategy.tp if split else 1
    fwd_flops, bwd_flops, gemms = epm.expert_gemm_flops(layer, strategy, info, shard)
    saved = layer.expert_act_bytes * strategy.microbatch_size * act_scale / shard * epm.load_factor(info)
    traffic = cluster.device.elementwise_bytes_per_activation_byte * saved
    fwd_s = compute_time_s(fwd_flops, gemms, cluster, dtype) + memory_time_s(traffic, cluster)
    bwd_s = compute_time_s(bwd_flops, 2 * gemms, cluster, dtype, num_launches=2) + memory_time_s(2 * traffic, cluster)
    ep_fwd_s, ep_bwd_s = epm.ep_comm_s(epm.dispatch_send_bytes(layer, strategy, act_scale, split), strategy,
                                       cluster, info)
    # the experts' states: P_e = expert_params / (ep tp) per rank, ZeRO over the expert-data group
    params = layer.expert_params / strategy.ep / shard
    group = epm.expert_data_view(strategy)
    states = model_state_bytes(params, group.dp, strategy.zero, strategy.precision, strategy.state_recipe,
                               strategy.tp, strategy.pp)
    grad_s, gather_s, fwd_gather_s, bwd_gather_s = _dp_comm_s(params, group, cluster)
    zero = strategy.zero
    owned = params / (group.dp if zero >= 1 else 1)
    optimizer_s = owned * cluster.optimizer_bytes_per_param / (
        cluster.device.memory_bw_bytes_per_s * cluster.device.memory_efficiency)
    gathered = params * recipe(strategy.precision)["param"]
    copies = (zero == 3) + (strategy.state_recipe == "executor" and group.dp > 1 and zero >= 1
                            and (strategy.pp == 1 or zero == 3))
    full = strategy.recompute == "full"
    expert_states = states["params"] + states["grads"] + states["optimizer"]
    return replace(
        dense, fwd_compute_s=dense.fwd_compute_s + fwd_s, bwd_compute_s=dense.bwd_compute_s + bwd_s,
        recompute_s=dense.recompute_s + (fwd_s if full else 0.0),
        fwd_gather_s=dense.fwd_gather_s + fwd_gather_s, bwd_gather_s=dense.bwd_gather_s + bwd_gather_s,
        dp_grad_comm_s=dense.dp_grad_comm_s + grad_s, dp_param_gather_s=dense.dp_param_gather_s + gather_s,
        optimizer_step_s=dense.optimizer_step_s + optimizer_s,
        param_bytes=dense.param_bytes + states["params"], grad_bytes=dense.grad_bytes + states["grads"],
        optimizer_bytes=dense.optimizer_bytes + states["optimizer"],
        activation_bytes=dense.activation_bytes + (0.0 if full else saved),
        buffer_bytes=dense.buffer_bytes + (saved if full else 0.0) + copies * gathered,
        ep_fwd_comm_s=ep_fwd_s, ep_bwd_comm_s=ep_bwd_s, expert_fwd_s=fwd_s, expert_bwd_s=bwd_s,
        expert_state_bytes=expert_states)
