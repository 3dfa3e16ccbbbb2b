"""Fixed per-call costs of a training step, beyond FLOPs, bytes and link bandwidth.

Small models (and small layers on any device) spend much of a step in costs that do not scale
with the work: dispatching the optimizer's kernels one parameter tensor at a time, DTensor's
redistribution around tensor-parallel Linears, FSDP's hooks per wrapped layer, torch
pipelining's bookkeeping per schedule action, and the latency of the per-step collectives
(the global gradient norm). Each is a named, calibrated field of the device profile
(`planner.contracts.cluster.DeviceProfile`, measured by `meshplan calibrate`; 0 means ignore) and is
charged here the way meshplan's executor incurs it:

- optimizer: AdamW plus the gradient-norm computation touch every parameter tensor the rank
  owns: `optimizer_per_tensor_s` each, or `dtensor_optimizer_per_tensor_s` when the executor
  holds DTensors (tensor-parallel layers, FSDP / replicate wrapping), which it steps without
  foreach kernels;
- `tp_layer_overhead_s` once per pass of every tensor-parallel layer, plus
  `tp_overhead_s_per_stream_byte` per byte of the (micro-batch, seq, hidden) tensor it takes in
  (DTensor's work that grows with the activations), plus `sp_layer_overhead_s` per block pass
  under sequence parallelism, plus `tp_loss_overhead_s` per micro-batch for the head's
  vocab-parallel loss;
- `dp_unit_overhead_s` once per pass of every layer FSDP / replicate wraps, plus FSDP's host work
  `dp_overhead_s_per_byte` per byte of each all-gather and reduction the executor runs
  (`dp_host_overhead_s`);
- `pipeline_action_overhead_s` once per forward and once per backward action of a pipeline chunk;
- under TP, one DTensor redistribution (`dtensor_redistribute_s`) and all-reduce per norm
  tensor per step (their gradients are partial sums);
- one all-reduce of the squared gradient norm over the whole world per step.
"""
from __future__ import annotations

from meshplan.planner.costing.collectives import all_reduce_time_s
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.costing.state_memory import dp_method

# Bytes of the gradient-norm all-reduce (one float64 scalar).
GRAD_NORM_BYTES = 8


def num_param_tensors(layer: LayerProfile, info: ModelInfo, holds_shared: bool = False) -> int:
    """Parameter tensors a layer owns, from its structure (the zoo's GPT and Llama layouts).

    GPT Linears and LayerNorms carry a bias, Llama's do not; a GPT embedding adds learned
    positions; a head whose weight is tied to the embedding owns only its norm, unless this rank
    holds a copy of the shared weight. Other layers: a weight and a bias.
    """
    biased = info.family == "gpt"
    per_linear = 2 if biased else 1
    per_norm = 2 if biased else 1
    if layer.num_params == 0 and not (holds_shared and layer.shared_params):
        return 0
    if layer.kind == "block" and layer.tp_split.kind == "block":
        linears = len(layer.tp_split.column_linears) + len(layer.tp_split.row_linears)
        return linears * per_linear + 2 * per_norm
    if layer.kind == "embedding":
        return 2 if biased else 1
    if layer.kind == "head":
        owns_weight = not layer.shared_params or holds_shared
        return per_norm + (1 if owns_weight else 0)
    return 2


def num_norm_tensors(layer: LayerProfile, info: ModelInfo) -> int:
    """Norm weights (and GPT biases) of a block (two norms) or a head (the final norm)."""
    per_norm = 2 if info.family == "gpt" else 1
    if layer.kind == "block" and layer.tp_split.kind == "block":
        return 2 * per_norm
    return per_norm if layer.kind == "head" else 0


def tp_norm_grad_sync_s(layer: LayerProfile, info: ModelInfo, tp: int, cluster: ClusterProfile) -> float:
    """Per step under TP: the norms are replicated, but their gradients come back as partial sums
    (their outputs feed column-parallel Linears), and the executor all-reduces each of them
    before the update (`executor.runtime._align_grad_placements`): one small all-reduce per
    norm tensor, latency-bound."""
    if tp <= 1 or not info.hidden:
        return 0.0
    link = cluster.link_for_group(tp, 1)
    one_s = all_reduce_time_s(info.hidden * 4, tp, link) + cluster.device.dtensor_redistribute_s
    return num_norm_tensors(layer, info) * one_s


def tp_pass_overhead_s(layer: LayerProfile, stream_bytes: float, sp: bool, cluster: ClusterProfile) -> float:
    """One pass of a tensor-parallel layer beyond its collectives and local compute: a fixed
    DTensor dispatch cost plus a cost per byte of its residual-stream input `stream_bytes`
    (micro-batch x seq x hidden x element size); a block under sequence parallelism adds
    `sp_layer_overhead_s`; a head adds half the vocab-parallel loss's overhead (its forward
    and its backward)."""
    device = cluster.device
    time_s = device.tp_layer_overhead_s + device.tp_overhead_s_per_stream_byte * stream_bytes
    if sp and layer.tp_split.kind == "block":
        time_s += device.sp_layer_overhead_s
    if layer.kind == "head":
        time_s += device.tp_loss_overhead_s / 2
    return time_s


def pipeline_action_s(pp: int, cluster: ClusterProfile) -> float:
    """torch pipelining's fixed work per forward or backward action of a chunk (0 without PP)."""
    return cluster.device.pipeline_action_overhead_s if pp > 1 else 0.0


def holds_dtensors(tp_split: bool, tp: int, dp: int, zero: int, pp: int, precision: str = "fp32") -> bool:
    """Whether the executor holds this layer's parameters as DTensors: split by TP, or wrapped
    by FSDP / replicate (`planner.costing.state_memory.dp_method`)."""
    return (tp > 1 and tp_split) or dp_wrapped(tp, dp, zero, pp, precision)


def dp_wrapped(tp: int, dp: int, zero: int, pp: int, precision: str = "fp32") -> bool:
    """FSDP or replicate wraps each layer (not DDP, not a single fp32 replica; every bf16-mixed
    layout, one replica included: `planner.costing.state_memory.dp_method`)."""
    return dp_method(zero, dp, tp, pp, precision) in ("fsdp", "replicate")


def dp_host_overhead_s(zero: int, pp: int, param_bytes: float, grad_bytes: float,
                       cluster: ClusterProfile) -> tuple[float, float, float]:
    """(per micro-batch forward, per micro-batch backward, per step) host seconds of FSDP's copies
    around its collectives for a layer whose gathered parameters are `param_bytes` and whose
    gradients are `grad_bytes`, where meshplan's executor runs them (`costing.communication.dp_comm_s`,
    `costing.state_memory.grad_sync_mode`; `zero` is the stage executed): ZeRO-3 gathers before
    every forward and backward, ZeRO-1/2 before every forward, or once per step under pipelining;
    ZeRO-2/3 reduce after every micro-batch's backward, ZeRO-0/1 once per step. The caller
    charges it only where FSDP / replicate wraps the layer (`dp_wrapped`)."""
    gather_s = cluster.device.dp_overhead_s_per_byte * param_bytes
    reduce_s = cluster.device.dp_overhead_s_per_byte * grad_bytes
    fwd_s = gather_s if zero == 3 or (zero in (1, 2) and pp == 1) else 0.0
    bwd_s = (gather_s if zero == 3 else 0.0) + (reduce_s if zero >= 2 else 0.0)
    step_s = (gather_s if zero in (1, 2) and pp > 1 else 0.0) + (reduce_s if zero <= 1 else 0.0)
    return fwd_s, bwd_s, step_s


def optimizer_fixed_s(num_tensors: int, dtensors: bool, cluster: ClusterProfile) -> float:
    """Per-step fixed cost of updating `num_tensors` parameter tensors (AdamW + gradient norm)."""
    device = cluster.device
    per_tensor = device.dtensor_optimizer_per_tensor_s if dtensors else device.optimizer_per_tensor_s
    return num_tensors * per_tensor


def grad_norm_all_reduce_s(world_size: int, cluster: ClusterProfile) -> float:
    """The global gradient norm's all-reduce of one scalar over every rank, once per step."""
    link = cluster.link_for_group(world_size, 1)
    return all_reduce_time_s(GRAD_NORM_BYTES, world_size, link)
