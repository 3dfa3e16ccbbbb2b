"""The amax all-reduces of torchao's Float8 casts on tensor-parallel DTensors (torchtitan).

A dynamic fp8 cast scales by the absolute maximum of what it casts: of the whole tensor
(tensorwise) or of each row (rowwise) (torchao/float8/float8_scaling_utils.py,
`hp_tensor_to_float8_dynamic` -> float8_utils.py `tensor_to_amax`: `torch.max(torch.abs(x))`, or
`torch.amax(torch.abs(x), dim)`). Under torch's tensor parallelism, as torchtitan runs it, the casts
act on DTensors. A maximum over a sharded dimension is a partial (max) DTensor, which DTensor
all-reduces over the TP group before the scale's pointwise ops can read it. Each such reduction is
a small collective the cast waits on, on the critical path (the cast and its GEMM need its result).
The micro-pipeline fuses none of them (no matmul beside them). Latency-bound: priced by the
profile's all-reduce (`collectives.all_reduce_time_s`) of the reduced maxima, 4 bytes a value.

Which casts reduce over a sharded dimension, per fp8 Linear of a block (column: q, k, v, up, gate,
sharded by output; row: o, down, sharded by input):

- tensorwise, torchtitan's Float8 TP plan (torchao/float8/float8_tensor_parallel.py): every cast is
  of a sharded tensor. Forward: each region's input on its sequence shard
  (`PrepareFloat8ModuleInput`) and each row Linear's input (`Float8RowwiseParallel`). Backward:
  each Linear's output gradient (`NoopFwToFloat8BwDynamic` in both styles' `_prepare_output_fn`).
  One scalar each. The weights: FSDP2's float8 all-gather casts them at the scales
  `precompute_float8_dynamic_scale_for_fsdp` computes once a step for the whole model (one
  reduction a step, not priced); without it (`fp8.fp8_all_gather`) each Linear casts its TP-sharded
  weight in the forward, one scalar more each.
- rowwise (plain `ColwiseParallel` / `RowwiseParallel`, bf16 all-gathers). Forward: a row Linear's
  input (a token's maximum over the sharded features: one value a token) and its weight (an output
  row's maximum over the sharded input features). Backward: a column Linear's output gradient (a
  token's maximum over the sharded outputs) and its weight for the input gradient (an input
  feature's maximum over the sharded outputs). Every other rowwise maximum stays within a shard.

Recomputation reruns the forward's reductions: full recomputation reruns the forward, and
torchtitan's per-op policy saves `aten.max` (tensorwise's maximum) but not the all-reduce after it,
nor `aten.amax` (rowwise's), so it reruns them too (`torchtitan_sac`).

Only under torchtitan: Megatron's Transformer Engine reduces its amaxes otherwise (delayed
scaling: one reduction of the whole amax history a step), and meshplan's executor runs no fp8.
Blocks whose Linears' shapes are unknown (MoE blocks, traced models) are not priced. The count
follows `gemm.block_linear_shapes`, which lists q, k and v apart: where one fused projection runs
them (GPT-2's c_attn) it is high by two reductions a pass.
"""
from __future__ import annotations

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing import fp8, torchtitan_sac
from meshplan.planner.costing.collectives import all_reduce_time_s
from meshplan.planner.costing.device_time import infer_seq
from meshplan.planner.costing.fp8_filter import fp8_linears, input_regions
from meshplan.planner.costing.tp_split import is_split

ENGINE = "torchtitan"
RECIPES = ("tensorwise", "rowwise")
# One fp32 maximum a reduced value.
AMAX_VALUE_BYTES = 4.0


def applies(layer: LayerProfile, config: ParallelConfig) -> bool:
    """Whether `layer`'s fp8 casts reduce their maxima over the TP group (module docstring)."""
    return (config.engine == ENGINE and fp8.is_fp8(config.precision) and config.fp8_recipe in RECIPES
            and is_split(layer, config.tp) and fp8.converts(layer))


def reduction_bytes(layer: LayerProfile, info: ModelInfo, config: ParallelConfig,
                    profile_dtype: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(forward, backward) bytes of each amax all-reduce one micro-batch makes on a rank, the
    caller having checked `applies`: one entry a reduction."""
    linears = fp8_linears(layer, info, config, profile_dtype)
    chosen = linears.fp8_shapes
    if not chosen:
        return (), ()
    if config.fp8_recipe == "tensorwise":
        rows = sum(1 for _, _, column in chosen if not column)
        weights = 0 if fp8.fp8_all_gather(config, config.zero, config.data_ranks) else len(chosen)
        return (AMAX_VALUE_BYTES,) * (input_regions(layer) + rows + weights), (AMAX_VALUE_BYTES,) * len(chosen)
    tokens = config.rank_microbatch * infer_seq(layer, info, profile_dtype)
    forward = tuple(AMAX_VALUE_BYTES * values for _, out_dim, column in chosen if not column
                    for values in (tokens, out_dim))
    backward = tuple(AMAX_VALUE_BYTES * values for in_dim, _, column in chosen if column
                     for values in (tokens, in_dim))
    return forward, backward


def reduce_times_s(layer: LayerProfile, info: ModelInfo, config: ParallelConfig, cluster: ClusterProfile,
                   profile_dtype: str) -> tuple[float, float, float]:
    """(forward, backward, rerun) seconds of one micro-batch's amax all-reduces on the compute
    path; the rerun is the forward's, where recomputation repeats it. Zeros where none applies."""
    if not applies(layer, config):
        return 0.0, 0.0, 0.0
    link = cluster.link_for_group(config.tp, 1)
    forward, backward = (sum(all_reduce_time_s(size, config.tp, link) for size in sizes)
                         for sizes in reduction_bytes(layer, info, config, profile_dtype))
    reruns = config.recompute == "full" or torchtitan_sac.applies(config)  # as `sp_layout` reruns its copies
    return forward, backward, forward if reruns else 0.0
