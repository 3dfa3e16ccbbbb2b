"""Activation memory of one layer's micro-batch on one rank: the bytes saved for backward and
the transient working set, by recomputation mode, tensor and sequence parallelism. One rule for
the engines and for `meshplan train`, which keeps what they keep (see `activation_bytes`)."""
from __future__ import annotations

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile
from meshplan.planner.costing.tp_split import is_split


def rebuilt_bytes(layer: LayerProfile, config: ParallelConfig, scale: float) -> float:
    """A micro-batch's norm outputs rebuilt in backward on one rank (outside the TP region: /t
    only with SP)."""
    sp_tp = config.tp if config.sp and is_split(layer, config.tp) else 1
    return layer.act_rebuilt_bytes / sp_tp * config.rank_microbatch * scale


def sharded_bytes(layer: LayerProfile, config: ParallelConfig, scale: float) -> float:
    """A micro-batch's bytes saved inside the tensor-parallel region on one rank (/t where the layer
    is split)."""
    tp = config.tp if is_split(layer, config.tp) else 1
    return layer.act_tp_sharded_bytes / tp * config.rank_microbatch * scale


def keeps_gathered_input(layer: LayerProfile, config: ParallelConfig, executor: bool) -> bool:
    """Whether `meshplan train` keeps a layer's Linear input all-gathered whole under SP: only the
    vocab-parallel head's output Linear (a block's regions keep the sequence shard and gather it
    again in backward, `models.tensor_parallel.GatherKeepShard`, with or without selective
    recomputation)."""
    return executor and config.sp and layer.kind == "head" and is_split(layer, config.tp)


def _replicated_bytes(layer: LayerProfile, config: ParallelConfig, executor: bool) -> float:
    """A layer's replicated bytes per sample on one rank: /t under SP, except the head's Linear
    input, which `meshplan train` keeps gathered (`keeps_gathered_input`)."""
    sp_tp = config.tp if config.sp and is_split(layer, config.tp) else 1
    if not keeps_gathered_input(layer, config, executor):
        return layer.act_tp_replicated_bytes / sp_tp
    linear_input = min(layer.input_bytes, layer.act_tp_replicated_bytes + layer.act_rebuilt_bytes)
    # the norm's output is in the replicated bytes unless the profile has it rebuilt in backward
    profiled_input = linear_input if not layer.act_rebuilt_bytes else 0.0
    return (layer.act_tp_replicated_bytes - profiled_input) / sp_tp + linear_input


def activation_bytes(layer: LayerProfile, config: ParallelConfig, scale: float,
                     executor: bool = False, recompute: str | None = None) -> tuple[float, float]:
    """(bytes saved for backward per micro-batch, transient working set: what recomputation
    rebuilds of one layer, or one rebuilt norm output).

    Korthikanti et al. 2022: TP divides the sharded and score bytes by t, SP also the replicated
    bytes; selective recomputation drops the scores (the attention core's output and softmax
    statistics are rebuilt in backward, one layer at a time, beside a rebuilt norm output: the
    larger of the two is the transient); full recomputation keeps only the input (/t with SP)
    and rebuilds the rest, one layer at a time, during backward. Selective therefore never keeps
    more than none.

    `executor=True`: what `meshplan train` keeps (state recipe "executor"), measured on CPU with
    `executor.memory.StepMemTracker` (tests/executor/test_memory_prediction.py). Its bf16-mixed
    runs under FSDP2's mixed-precision policy (`state_memory.dp_method`): activations and the
    residual stream in bf16 and no per-micro-batch weight casts, as the profile counts them;
    selective recomputation checkpoints only the attention core (`executor.parallel.recompute`);
    under SP a block keeps the shard of each region's input. The one difference from the engines:
    the head's Linear keeps its SP-gathered input whole on every TP rank (`keeps_gathered_input`).

    The time model's memory traffic (`compute_time.compute_times_s`) reads this rule too.
    `recompute` None: the config's mode.
    """
    mbs = config.rank_microbatch
    recompute = recompute or config.recompute
    tp = config.tp if is_split(layer, config.tp) else 1
    sp_tp = tp if config.sp else 1
    sharded = layer.act_tp_sharded_bytes / tp
    replicated = _replicated_bytes(layer, config, executor)
    scores = layer.act_attn_score_bytes / tp
    full = (sharded + replicated + scores) * mbs * scale
    # a norm output rebuilt in backward lives while the Linears after it run theirs: one at a time
    rebuilt = rebuilt_bytes(layer, config, scale) / (2 if layer.kind == "block" else 1)
    if recompute == "full":
        return layer.input_bytes / sp_tp * mbs * scale, full
    if recompute == "selective":
        return (sharded + replicated) * mbs * scale, max(scores * mbs * scale, rebuilt)
    return full, rebuilt
