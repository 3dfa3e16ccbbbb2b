"""Activation memory of one layer's micro-batch on one rank: the bytes saved for backward and
the transient working set, by recomputation mode, tensor and sequence parallelism, and what
`meshplan train` keeps (autocast's copies, gathered SP inputs)."""
from __future__ import annotations

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile
from meshplan.planner.costing.state_memory import dp_method
from meshplan.planner.costing.tp_split import is_split


def rebuilt_bytes(layer: LayerProfile, config: ParallelConfig, scale: float) -> float:
    """A micro-batch's norm outputs rebuilt in backward on one rank (outside the TP region: /t
    only with SP)."""
    sp_tp = config.tp if config.sp and is_split(layer, config.tp) else 1
    return layer.act_rebuilt_bytes / sp_tp * config.rank_microbatch * scale


def _executor_replicated_bytes(layer: LayerProfile, sp: bool, recompute: str, split: bool, sp_tp: int,
                               autocast: bool, kept_rebuilt: float) -> float:
    """A block's or head's replicated bytes as `meshplan train` keeps them (`activation_bytes`):
    the Linears' inputs gathered whole under SP, autocast's fp32 norms and per-Linear casts."""
    regions = layer.tp_split.num_allreduce_per_pass if layer.kind == "block" else 1
    linear_inputs = min(layer.input_bytes * regions, layer.act_tp_replicated_bytes + layer.act_rebuilt_bytes)
    # the norm outputs, unless the profile has them rebuilt (then not in the replicated bytes)
    profiled_inputs = linear_inputs if not layer.act_rebuilt_bytes else 0.0
    norm_inputs = layer.act_tp_replicated_bytes - profiled_inputs
    # SP: the Linears' inputs are kept gathered, whole
    gathered = split and sp and (layer.kind == "head" or recompute == "selective")
    copies = 1.0
    if autocast:  # each Linear keeps its own bf16 cast: no shared output to rebuild
        column_linears = len(layer.tp_split.column_linears) if layer.kind == "block" else 1
        copies = max(1.0, column_linears / max(1, regions))
    kept_inputs = linear_inputs if (gathered or autocast or kept_rebuilt) else profiled_inputs
    return (norm_inputs * (2.0 if autocast else 1.0) / sp_tp
            + kept_inputs * copies / (1 if gathered else sp_tp))


def activation_bytes(layer: LayerProfile, config: ParallelConfig, scale: float,
                     executor: bool = False, recompute: str | None = None) -> tuple[float, float]:
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

    The time model's memory traffic (`compute_time.compute_times_s`) keeps the default accounting.
    `recompute` None: the config's mode.
    """
    mbs = config.rank_microbatch
    recompute = recompute or config.recompute
    split = is_split(layer, config.tp)
    tp = config.tp if split else 1
    sp_tp = tp if config.sp else 1
    sharded = layer.act_tp_sharded_bytes / tp
    # norm outputs rebuilt in backward are kept after all under recomputation (whose checkpoint
    # the executor does not mix with references: `executor.parallel.recompute`)
    kept_rebuilt = layer.act_rebuilt_bytes if recompute == "selective" else 0
    replicated = (layer.act_tp_replicated_bytes + kept_rebuilt) / sp_tp
    weight_copies = 0.0
    autocast = executor and config.precision == "bf16-mixed" and dp_method(
        config.zero, config.data_ranks, config.tp, config.pp) in ("none", "ddp")
    if executor and layer.kind in ("block", "head"):
        replicated = _executor_replicated_bytes(layer, config.sp, recompute, split, sp_tp, autocast, kept_rebuilt)
    if autocast and layer.kind != "embedding":
        weights = layer.num_params + (layer.shared_params if layer.kind == "head" else 0)
        weight_copies = 2.0 * weights / tp
    scores = layer.act_attn_score_bytes / tp
    full = (sharded + replicated + scores) * mbs * scale + weight_copies
    if recompute == "full":
        return layer.input_bytes / sp_tp * mbs * scale, full
    if recompute == "selective":
        return (sharded + replicated) * mbs * scale + weight_copies, scores * mbs * scale
    # a norm output rebuilt in backward lives while the Linears after it run theirs: one at a time
    norms = 2 if layer.kind == "block" else 1
    return full, rebuilt_bytes(layer, config, scale) / norms
