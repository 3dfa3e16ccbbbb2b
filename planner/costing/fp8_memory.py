"""fp8's memory rules (`planner.costing.fp8` holds its time): the fp8 Linears' saved inputs, their
fp8 weight copies and scales, and what a float8 parameter all-gather moves and holds. Each counts
the Linears a filter leaves in fp8 (`fp8_filter.Fp8Linears`); the rest keep bf16's bytes.

- saved for backward: the block's fp8 Linears' inputs in fp8, 1 byte per value instead of 2 (the
  eager `Float8Linear` keeps its bf16 input and relies on torch.compile to save the fp8 cast,
  pytorch/ao#1850); everything else stays bf16 (`saved_bytes_saving`);
- the fp8 weight copy: each fp8 Linear's weight lives while its GEMMs run and is recast in
  backward, a transient of 1 byte per parameter (`transient_bytes`); with float8 all-gather the
  gathered copy already is that weight. Scale state: one fp32 scale per cast tensor (input,
  weight, gradient) per fp8 Linear, `fp8.FP8_SCALE_BYTES_PER_LINEAR`, with the buffers;
- ZeRO 1-3 where the engine gathers parameters in fp8 (`fp8.fp8_all_gather`): the fp8 Linears'
  parameters move 1 byte instead of 2 and their unsharded copy is fp8 (`gather_bytes_per_param`).
"""
from __future__ import annotations

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing.activation_memory import keeps_gathered_input
from meshplan.planner.costing.fp8 import (BF16_BYTES, FP8_BYTES, FP8_SCALE_BYTES_PER_LINEAR, converts, fp8_all_gather,
                                          is_fp8, linear_input_bytes, linear_params)
from meshplan.planner.costing.fp8_filter import Fp8Linears, fp8_linears


def filtered_linears(layer: LayerProfile, info: ModelInfo, config: ParallelConfig,
                     profile_dtype: str) -> Fp8Linears | None:
    """The block's `Fp8Linears` where a filter leaves some in bf16, else None (every one in fp8)."""
    if not is_fp8(config.precision) or not converts(layer):
        return None
    linears = fp8_linears(layer, info, config, profile_dtype)
    return None if linears.everything else linears


def saved_bytes_saving(layer: LayerProfile, info: ModelInfo, tp: int, sp: bool, gathered: bool,
                       mbs: int, scale: float, linears: Fp8Linears | None = None) -> float:
    """Bytes per micro-batch the fp8 Linears' saved inputs take less than bf16 ones: half of
    them (sharded ones /tp, replicated ones /tp under SP unless kept gathered), less the fp8
    casts of norm outputs the bf16 profile rebuilds rather than keeps."""
    replicated, sharded = linear_input_bytes(layer, info, linears)
    share = 1.0 if linears is None else linears.replicated_share
    rebuilt = min(replicated, share * float(layer.act_rebuilt_bytes))
    shard = 1 if gathered or not sp else tp
    saving = (1 - FP8_BYTES / BF16_BYTES) * (replicated / shard + sharded / tp) - rebuilt / shard
    return saving * mbs * scale


def gather_bytes_per_param(layer: LayerProfile, info: ModelInfo, config: ParallelConfig, zero: int, dp: int,
                           compute_bytes: float, profile_dtype: str = "bf16") -> float:
    """Bytes per parameter a parameter all-gather moves (and the unsharded copy holds)."""
    if not fp8_all_gather(config, zero, dp) or not layer.num_params:
        return compute_bytes
    share = linear_params(layer, info, filtered_linears(layer, info, config, profile_dtype)) / layer.num_params
    return compute_bytes - share * (compute_bytes - FP8_BYTES)


def transient_bytes(layer: LayerProfile, info: ModelInfo, tp: int, config: ParallelConfig, zero: int,
                    dp: int, linears: Fp8Linears | None = None) -> float:
    """The fp8 weight copy each fp8 Linear casts for its GEMMs (unless float8 all-gather's gathered
    copy is it) and the scale state, per rank."""
    if not is_fp8(config.precision) or not converts(layer):
        return 0.0
    num_linears = (len(layer.tp_split.column_linears) + len(layer.tp_split.row_linears) if linears is None
                   else linears.num_fp8)
    copy = 0.0 if fp8_all_gather(config, zero, dp) else FP8_BYTES * linear_params(layer, info, linears) / tp
    return copy + FP8_SCALE_BYTES_PER_LINEAR * num_linears


def adjust_memory(layer: LayerProfile, info: ModelInfo, config: ParallelConfig, split: bool, executor: bool,
                  zero: int, scale: float, activation_bytes: float, buffer_bytes: float,
                  profile_dtype: str = "bf16") -> tuple[float, float]:
    """(saved, transient) bytes per micro-batch under fp8 from bf16-mixed's: the Linears' saved
    inputs in fp8 (in the recompute working set under full recomputation, which keeps only the
    block's input) and the fp8 weight copies and scales. `scale`: compute over profile element size."""
    if not is_fp8(config.precision) or not converts(layer):
        return activation_bytes, buffer_bytes
    tp = config.tp if split else 1
    linears = filtered_linears(layer, info, config, profile_dtype)
    gathered = keeps_gathered_input(layer, config, executor)
    saving = saved_bytes_saving(layer, info, tp, config.sp, gathered, config.rank_microbatch, scale, linears)
    if config.recompute == "full":
        buffer_bytes -= saving
    else:
        activation_bytes -= saving
    return activation_bytes, buffer_bytes + transient_bytes(layer, info, tp, config, zero, config.data_ranks, linears)
