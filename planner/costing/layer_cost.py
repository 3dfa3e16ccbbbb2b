"""The cost of one layer on one rank under one `ParallelConfig`: the `LayerCost` record the simulator,
the cost tables and the closed form read, and `layer_cost`, which prices the layer's dense part
and adds the routed experts (`planner.costing.expert_parallel`) and context parallelism's K/V
exchange (`planner.costing.context_parallel`).

(Owned by the cost model; `LayerCost` is the contract the simulator and the solver read. Add
fields freely; do not rename.)
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import NamedTuple

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import CONFIG_FIELDS, EXECUTOR_MEMORY_ENGINES, ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing import (context_parallel, expert_parallel, fixed_costs, fp8_amax, fp8_memory, fused_tp,
                                      module_recompute, offload, overlap, sp_layout, torchtitan_sac, tp_backward)
from meshplan.planner.costing.activation_memory import activation_bytes
from meshplan.planner.costing.collectives import all_reduce_time_s
from meshplan.planner.costing.communication import dp_comm_s, tp_comm_parts_s
from meshplan.planner.costing.compute_time import compute_time_key, compute_times_s, kernel_efficiency
from meshplan.planner.costing.engine_memory import engine_layer_memory, layer_transient_scale, without_recompute
from meshplan.planner.costing.executor_memory import executor_memory_extras
from meshplan.planner.costing.gathers import gather_exposure_s
from meshplan.planner.costing.memo import through
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.state_memory import grad_copy_bytes_per_param, grad_wire_bytes_per_param, state_bytes
from meshplan.planner.costing.precision import COMPUTE_DTYPE, activation_scale, recipe
from meshplan.planner.costing.tp_split import as_engine_splits, is_split, rank_params, vocab_scale


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
    dp_param_gather_s: float  # per step: all-gather of the updated parameters, once (see `communication.dp_comm_s`)
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
    owned_params: float = 0.0  # parameters whose optimizer states this rank updates (after ZeRO)
    host_state_bytes: float = 0.0  # model states offloaded to host memory (`costing.offload`)
    # reserved bytes per byte of activations and buffers: the engine's caching-allocator
    # fragmentation (`engine_memory.layer_transient_scale`; 1 for meshplan's executor)
    reserve_scale: float = 1.0

    def replaced(self, **changes: float) -> LayerCost:
        """`dataclasses.replace(self, **changes)` without running `__init__` again (a search
        makes ~1e5 of them; LayerCost validates nothing); unknown names are refused as there."""
        unknown = changes.keys() - _LAYER_COST_FIELDS
        if unknown:
            raise TypeError(f"LayerCost has no field(s) {', '.join(sorted(unknown))}")
        out = object.__new__(LayerCost)
        out.__dict__.update(self.__dict__, **changes)
        return out

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


_LAYER_COST_FIELDS = frozenset(f.name for f in fields(LayerCost))


def layer_cost(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile, info: ModelInfo,
               *, profile_dtype: str | None = None, holds_shared: bool = False,
               attention: str = "flash", state_recipe: str = "executor", memo: dict | None = None) -> LayerCost:
    """Time and memory of `layer` on one rank under `config` (see LayerCost for units).

    `config` is the configuration as the layer runs it (`uniform.layer_config`): its `recompute`
    the layer's mode, its `zero` the stage the executor runs, its tp and dp the layer's own under
    a layerwise plan (`uniform.layer_mesh`). `state_recipe`: where model states live,
    "executor" (what `meshplan train` allocates) or "zero-paper" (`state_memory`); under an
    `engine` other than meshplan, that engine's recipe prices all memory (`engine_memory`).

    `profile_dtype`: dtype the profile's byte counts were taken in (default: the precision's
    compute dtype); activations scale by the element-size ratio. `holds_shared`: this rank holds a
    copy of parameters another stage owns (a tied head on the last stage), with its gradient and
    optimizer state, and all-reduces that gradient with the owner once per step. `attention`:
    the graph's attention kernel; a flash kernel skips the masked half of causal attention, so
    step time uses the causal FLOPs (MFU keeps counting attention in full, as Megatron-LM does).

    Under context parallelism a rank runs the layer's per-token work as a CP-free data rank
    (`config.rank_microbatch` samples, gradients and ZeRO over `config.data_ranks`) plus the K/V
    exchange; a MoE block is its dense part priced as any layer plus its routed experts.

    `memo`: a dict the caller keeps for calls on one graph and cluster (the search's cost
    tables): a MoE block's dense part is priced once for all its expert layouts (`_dense_of`).
    """
    layer = as_engine_splits(layer, config.engine, config.tp, info)  # the engine's vocabulary split
    _check(layer, config, info)
    local = _data_rank_cost(layer, config, cluster, info, profile_dtype, holds_shared, attention, state_recipe, memo)
    if module_recompute.applies(layer, config, info):  # Megatron-Core's --recompute-modules rerun their forwards
        local = module_recompute.with_module_recompute(local, layer, config, cluster, info,
                                                       activation_scale(config.precision, profile_dtype),
                                                       profile_dtype or COMPUTE_DTYPE[config.precision], attention)
    local = torchtitan_sac.with_routed_experts(local, layer, config)  # torchtitan's policy reruns the experts
    if config.cp > 1:
        kernel = kernel_efficiency(layer, info, cluster, attention, profile_dtype or COMPUTE_DTYPE[config.precision],
                                   config.attention_query_split)
        local = context_parallel.with_context_parallel(local, layer, config, cluster, info, profile_dtype, attention,
                                                       kernel)
    if local.dp_param_gather_s > 0:  # the once-per-step gather, less what the engine hides (`overlap`)
        local = local.replaced(dp_param_gather_s=overlap.exposed_step_gather_s(local.dp_param_gather_s,
                                                                               local.fwd_busy_s, config))
    if config.engine not in EXECUTOR_MEMORY_ENGINES:
        # another engine's memory recipe replaces every memory field (`costing.engine_memory`)
        memory = _engine_memory(layer, config, info, profile_dtype, attention, holds_shared, memo)
        plain = memory
        if config.recompute != "none" or config.recompute_modules:  # what the layer keeps without it
            plain = _engine_memory(layer, without_recompute(config), info, profile_dtype, attention, holds_shared, memo)
        scale = layer_transient_scale(config, memory.activation_bytes, plain.activation_bytes)
        local = local.replaced(**memory._asdict(), reserve_scale=scale)
    return offload.with_offload(local, config, cluster)


def _engine_memory(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, profile_dtype: str | None,
                   attention: str, holds_shared: bool, memo: dict | None):
    """`engine_layer_memory` of the layer under `config`, once per memo (a layer's recomputation
    options share the one without recomputation, which prices their allocator reserve)."""
    key = ("engine_memory", id(layer), id(info), config, profile_dtype, attention, holds_shared)
    return through(memo, key, partial(engine_layer_memory, layer, config, info,
                                      act_scale=activation_scale(config.precision, profile_dtype),
                                      profile_dtype=profile_dtype or COMPUTE_DTYPE[config.precision],
                                      attention=attention, holds_shared=holds_shared))


def _check(layer: LayerProfile, config: ParallelConfig, info: ModelInfo) -> None:
    """ValueError unless `config` can run `layer`: a tensor-parallel layout, a known mode."""
    tp = config.tp
    if tp > 1 and info.family == "hf" and layer.kind == "block" and layer.tp_split.kind == "none":
        raise ValueError(f"layer {layer.name!r} cannot be split tp={tp} ways: "
                         f"{layer.tp_split.reason or 'no known tensor-parallel layout'}")
    if not layer.tp_split.max_degree_ok(tp):
        raise ValueError(f"layer {layer.name!r} cannot be split tp={tp} ways (heads {layer.tp_split.num_heads}, "
                         f"kv heads {layer.tp_split.num_kv_heads}, vocab {layer.tp_split.vocab_size})")
    if config.recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {config.recompute!r}")
    recipe(config.precision)  # validates the name


def _data_rank_cost(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile, info: ModelInfo,
                    profile_dtype: str | None, holds_shared: bool, attention: str, state_recipe: str,
                    memo: dict | None = None) -> LayerCost:
    """The layer's per-token work on a data rank: its dense part, plus a MoE block's routed experts."""
    if not layer.expert_params:
        return dense_layer_cost(layer, config, cluster, info, profile_dtype, holds_shared, attention, state_recipe,
                                memo)
    dense = _dense_of(layer, config, cluster, info, profile_dtype, holds_shared, attention, state_recipe, memo)
    # the engine's EP overlap hides its share of the dispatch and combine all-to-alls only
    return expert_parallel.with_routed_experts(dense, layer, config, cluster, info, profile_dtype, state_recipe,
                                               a2a_overlap=overlap.ep_a2a_hidden_share(config), memo=memo)


# Fields of a `ParallelConfig` that only the routed experts read (`expert_parallel`).
EXPERT_LAYOUT_FIELDS = frozenset({"ep", "etp"})


def _dense_of(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile, info: ModelInfo,
              profile_dtype: str | None, holds_shared: bool, attention: str, state_recipe: str,
              memo: dict | None) -> LayerCost:
    """A MoE block's dense part (`expert_parallel.dense_part`) priced by `dense_layer_cost`, which
    reads no expert layout field: with a `memo`, once per config equal but for them (a search
    prices every block at several expert layouts)."""
    key = ("dense_part", id(layer), id(cluster), id(info), profile_dtype, holds_shared, attention, state_recipe,
           *(getattr(config, name) for name in CONFIG_FIELDS if name not in EXPERT_LAYOUT_FIELDS))
    part = through(memo, ("dense_layer", id(layer), id(info)), expert_parallel.dense_part, layer, info)
    return through(memo, key, dense_layer_cost, part, config, cluster, info, profile_dtype, holds_shared, attention,
                   state_recipe, memo)


def dense_layer_cost(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile, info: ModelInfo,
                     profile_dtype: str | None, holds_shared: bool, attention: str,
                     state_recipe: str = "executor", memo: dict | None = None) -> LayerCost:
    """`layer_cost` of a layer without routed experts, without context parallelism's K/V exchange:
    a rank's `rank_microbatch` samples, data parallelism over all `data_ranks`. `memo`:
    `layer_cost`'s (the compute times once per `compute_time.compute_time_key`)."""
    mbs = config.rank_microbatch
    dtype = COMPUTE_DTYPE[config.precision]
    act_scale = activation_scale(config.precision, profile_dtype)
    split = is_split(layer, config.tp)
    vocab = vocab_scale(layer, config.tp, info)
    fwd_s, bwd_s, recompute_s, tp_fwd_s, tp_bwd_s = _pass_times_s(layer, config, cluster, info, act_scale, vocab,
                                                                  profile_dtype or dtype, attention, memo)
    states = _model_states(layer, config, cluster, info, holds_shared, state_recipe, profile_dtype or dtype)
    fwd_s, bwd_s = fwd_s + states.host_fwd_s, bwd_s + states.host_bwd_s
    # FSDP2's fp32 gradient copies of this micro-batch (`state_memory.grad_copy_bytes_per_param`)
    bwd_s += memory_time_s(grad_copy_bytes_per_param(config) * states.params_per_rank, cluster)
    saved_bytes, buffer_bytes, extra_params, extra_grads = _memory_bytes(
        layer, config, info, states, act_scale, vocab, profile_dtype or dtype, state_recipe)
    out_shard = config.tp if config.sp and split else 1
    return LayerCost(
        fwd_compute_s=fwd_s, bwd_compute_s=bwd_s, recompute_s=recompute_s,
        tp_fwd_comm_s=tp_fwd_s, tp_bwd_comm_s=tp_bwd_s, fwd_gather_s=states.fwd_gather_s,
        bwd_gather_s=states.bwd_gather_s, dp_grad_comm_s=states.grad_comm_s, dp_param_gather_s=states.gather_s,
        optimizer_step_s=states.optimizer_s, param_bytes=states.memory["params"] + extra_params,
        grad_bytes=states.memory["grads"] + extra_grads, optimizer_bytes=states.memory["optimizer"],
        activation_bytes=saved_bytes, buffer_bytes=buffer_bytes,
        output_bytes=layer.output_bytes * mbs * act_scale / out_shard, owned_params=states.owned_params,
    )


def _pass_times_s(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile, info: ModelInfo,
                  act_scale: float, vocab: float, profile_dtype: str,
                  attention: str, memo: dict | None = None) -> tuple[float, float, float, float, float]:
    """(forward, backward, recomputation, blocking TP forward, blocking TP backward) seconds of one
    micro-batch: compute, TP collectives and the per-pass fixed costs of DTensor and FSDP hooks."""
    tp, mbs = config.tp, config.rank_microbatch
    # the same at every data, pipeline and ZeRO degree: memoised once per compute_time_key
    key = ("compute_times", id(layer), id(cluster), id(info), act_scale, vocab, profile_dtype, attention,
           *compute_time_key(config))
    fwd_s, bwd_s, recompute_s = through(memo, key, compute_times_s, layer, config, cluster, info, act_scale, vocab,
                                        profile_dtype, attention)
    # DTensor's copies around batch-first sequence-parallel collectives, on the compute stream (`sp_layout`)
    copy_fwd_s, copy_bwd_s, copy_rerun_s = sp_layout.copy_times_s(layer, config, cluster, act_scale)
    fwd_s, bwd_s, recompute_s = fwd_s + copy_fwd_s, bwd_s + copy_bwd_s, recompute_s + copy_rerun_s
    # torchao's fp8 casts on DTensor shards wait on their amax all-reduces (`fp8_amax`)
    amax_fwd_s, amax_bwd_s, amax_rerun_s = fp8_amax.reduce_times_s(layer, info, config, cluster, profile_dtype)
    fwd_s, bwd_s, recompute_s = fwd_s + amax_fwd_s, bwd_s + amax_bwd_s, recompute_s + amax_rerun_s
    parts = tp_comm_parts_s(layer, config, cluster, act_scale)
    # what the engine's TP overlap leaves exposed beside each pass's compute (`overlap.exposed_tp_comm_s`)
    unpipelined_fwd_s, unpipelined_bwd_s = overlap.unpipelined_tp_comm_s(layer, config, parts)
    fused = fused_tp.exposed_fused_s(layer, config, cluster, info, parts, profile_dtype)
    if fused is None:
        tp_fwd_s = overlap.exposed_tp_comm_s(sum(parts[0]), fwd_s, layer.kind, config, unpipelined_fwd_s)
        # Megatron-Core without a TP overlap: the column Linears' backward collectives beside their GEMMs
        beside = tp_backward.exposed_backward_s(layer, config, cluster, info, parts, profile_dtype)
        tp_bwd_s = (overlap.exposed_tp_comm_s(sum(parts[1]), bwd_s, layer.kind, config, unpipelined_bwd_s)
                    if beside is None else beside)
    else:  # torch's fused collective-matmuls, each beside its own matmuls (`fused_tp`)
        tp_fwd_s, tp_bwd_s = unpipelined_fwd_s + fused[0], unpipelined_bwd_s + fused[1]
    if is_split(layer, tp):  # DTensor dispatch around the parallel Linears, every pass (planner.costing.fixed_costs)
        # the (mbs, seq, hidden) residual stream: an embedding's output, any other layer's input
        stream_bytes = mbs * act_scale * (layer.output_bytes if layer.kind == "embedding" else layer.input_bytes)
        pass_s = fixed_costs.tp_pass_overhead_s(layer, stream_bytes, config.sp, cluster)
        tp_fwd_s, tp_bwd_s = tp_fwd_s + pass_s, tp_bwd_s + pass_s
    if fixed_costs.dp_wrapped(tp, config.data_ranks, config.zero, config.pp, config.precision):  # FSDP / replicate hooks
        fwd_s += cluster.device.dp_unit_overhead_s
        bwd_s += cluster.device.dp_unit_overhead_s
    if config.recompute == "full":
        tp_bwd_s += tp_fwd_s  # the recomputed forward repeats its collectives
    tp_bwd_s += torchtitan_sac.tp_rerun_s(tp_fwd_s, config, layer)  # its per-op policy: the all-gathers
    return fwd_s, bwd_s, recompute_s, tp_fwd_s, tp_bwd_s


class _ModelStates(NamedTuple):
    """A layer's model states on one rank and what data parallelism costs for them."""

    params_per_rank: float  # the layer's parameters on this rank (/ tp when split)
    memory: dict[str, float]  # resident params / grads / optimizer bytes
    gather_bytes: float  # bytes per parameter a gather moves and an unsharded copy holds
    compute_bytes: float  # bytes per parameter of the compute copy
    grad_comm_s: float
    gather_s: float
    fwd_gather_s: float
    bwd_gather_s: float
    optimizer_s: float
    owned_params: float  # parameters whose optimizer states the rank holds (ZeRO-sharded)
    host_fwd_s: float  # FSDP's copies around its collectives, on the compute path
    host_bwd_s: float


def grad_copy_params(layer: LayerProfile, info: ModelInfo, tp: int, ep: int, expert_tp: int,
                     holds_shared: bool = False) -> float:
    """The parameters whose gradients FSDP2's copies touch on one rank, per micro-batch
    (`state_memory.grad_copy_bytes_per_param`): the layer's dense part and its routed experts'
    (`tp_split.rank_params`), what `layer_cost` charges them on."""
    return sum(rank_params(layer, info, tp, ep, expert_tp, holds_shared))


def _model_states(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile, info: ModelInfo,
                  holds_shared: bool, state_recipe: str, profile_dtype: str) -> _ModelStates:
    """The layer's resident states, gradient reduction, parameter gathers and optimizer step."""
    # gradients and ZeRO span every data rank; zero: the stage the executor runs (`executed_zero`)
    tp, dp, zero, precision, pp = config.tp, config.data_ranks, config.zero, config.precision, config.pp
    shard = config.shard_degree if config.shard_group else None
    split = is_split(layer, tp)
    params_per_rank = rank_params(layer, info, tp, 1, 1, holds_shared)[0]  # a dense layer or a MoE block's dense part
    memory = state_bytes(params_per_rank, dp, zero, precision, state_recipe, tp, pp, shard)
    compute_bytes = recipe(precision)["param"]
    # bytes per parameter a gather moves and an unsharded copy holds (fp8: float8 all-gather)
    gather_bytes = fp8_memory.gather_bytes_per_param(layer, info, config, zero, dp, compute_bytes, profile_dtype)
    if state_recipe == "executor" and zero in (1, 2) and gather_bytes < compute_bytes:
        memory = {**memory, "params": memory["params"] - params_per_rank * (compute_bytes - gather_bytes)}
    grad_comm_s, gather_s, fwd_gather_s, bwd_gather_s = dp_comm_s(params_per_rank, config, cluster, gather_bytes,
                                                                  state_recipe=state_recipe)
    grad_wire_bytes = grad_wire_bytes_per_param(precision, state_recipe, config.grad_reduce_in_bf16)
    if holds_shared and layer.shared_params and pp > 1:
        shared_bytes = layer.shared_params / (tp if split else 1) * grad_wire_bytes
        link = cluster.link_for_group(2, dp * tp * (pp - 1))  # the first and the last stage, pipeline-strided
        grad_comm_s += all_reduce_time_s(shared_bytes, 2, link)
    owned_params = params_per_rank / ((shard or dp) if zero >= 1 else 1)  # sharded states
    # AdamW streams its states through memory, and pays a fixed cost per parameter tensor
    optimizer_s = owned_params * cluster.optimizer_bytes_per_param / (
        cluster.device.memory_bw_bytes_per_s * cluster.device.memory_efficiency) + fixed_costs.optimizer_fixed_s(
        fixed_costs.num_param_tensors(layer, info, holds_shared),
        fixed_costs.holds_dtensors(split, tp, dp, zero, pp, precision), cluster)
    if split:
        optimizer_s += fixed_costs.tp_norm_grad_sync_s(layer, info, tp, cluster)
    host_fwd_s = host_bwd_s = 0.0
    if fixed_costs.dp_wrapped(tp, dp, zero, pp, precision):  # FSDP's copies around its collectives, on the compute path
        host_fwd_s, host_bwd_s, host_step_s = fixed_costs.dp_host_overhead_s(
            zero, pp, params_per_rank * gather_bytes,
            params_per_rank * grad_wire_bytes, cluster)
        optimizer_s = optimizer_s + host_step_s
    return _ModelStates(params_per_rank, memory, gather_bytes, compute_bytes, grad_comm_s, gather_s, fwd_gather_s,
                        bwd_gather_s, optimizer_s, owned_params, host_fwd_s, host_bwd_s)


def _memory_bytes(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, states: _ModelStates,
                  act_scale: float, vocab: float, profile_dtype: str,
                  state_recipe: str) -> tuple[float, float, float, float]:
    """(saved activation bytes, transient buffer bytes, extra param bytes, extra grad bytes) of one
    micro-batch: activations (fp8's adjusted), ZeRO-3's gathered copy, the executor's extras."""
    zero, dp = config.zero, config.data_ranks
    split = is_split(layer, config.tp)
    executor = state_recipe == "executor"
    saved_bytes, buffer_bytes = activation_bytes(layer, config, act_scale * vocab, executor=executor)
    saved_bytes, buffer_bytes = fp8_memory.adjust_memory(layer, info, config, split, executor, zero, act_scale,
                                                         saved_bytes, buffer_bytes, profile_dtype)
    gathered_bytes = states.params_per_rank * states.gather_bytes  # one unsharded copy (fp8 Linears: fp8)
    # The zoo's embedding and head belong to the stage's root FSDP unit; a file or HF model's are
    # units of their own (`executor.filemodel._fsdp_units`) unless a tied weight keeps them in the root.
    fsdp_root = executor and layer.kind in ("embedding", "head") and (
        info.family not in ("file", "hf") or info.tied_embeddings)
    if zero == 3 and not (fsdp_root and dp > 1):  # gathered full parameters live during fwd/bwd
        buffer_bytes += gathered_bytes
    if not executor:
        return saved_bytes, buffer_bytes, 0.0, 0.0
    extra_params, extra_grads, extra_buffer = executor_memory_extras(
        layer, config, info, zero, gathered_bytes, fsdp_root, split, vocab, profile_dtype,
        unit_params=states.params_per_rank, compute_bytes=states.compute_bytes)
    return saved_bytes, buffer_bytes + extra_buffer, extra_params, extra_grads
