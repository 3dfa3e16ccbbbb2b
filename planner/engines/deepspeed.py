"""DeepSpeed: a plan as a `ds_config.json`, and a `ds_config.json` back into an `EngineJob`.

`train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp`, so the
config fixes the data-parallel degree; `pipeline.stages` (Megatron-DeepSpeed's PipelineModule) and
`tensor_parallel.autotp_size` give the pipeline and tensor degrees, and the world size follows.
The pipeline engine splits layers uniformly by count or by parameters and checkpoints every
`pipeline.activation_checkpoint_interval` layers whole (full recomputation); its schedule is
1F1B-like, without interleaving, and it supports ZeRO-1 only. `sequence_parallel_size`
(DeepSpeed-Ulysses) splits every sequence over that many ranks and takes them out of the batch's
data-parallel ranks: meshplan's context parallelism with `cp_method` "ulysses" (a plan with
the all-gather method is exported with a note, and read back as Ulysses). `mics_shard_size` (MiCS, ZeRO-3) shards
within groups of that many ranks and replicates across them: HSDP. The model is the user's code,
so the model SPEC and the sequence length come from the command line.
"""
from __future__ import annotations

import json

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.engines import job as layout
from meshplan.planner.engines.job import EngineJob

# ds_config keys that change speed or memory in ways meshplan does not price
UNPRICED = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")
# ZeRO-Offload / ZeRO-Infinity: the ds_config keys of meshplan's offload modes (`costing.offload`)
OFFLOAD_KEYS = {"optimizer": ("offload_optimizer",), "params": ("offload_optimizer", "offload_param")}


def export_deepspeed(plan) -> tuple[str, list[str]]:
    """(ds_config.json text, approximation notes) for `plan`."""
    cfg, notes = plan.config, []
    if cfg.pp > 1 and not cfg.schedule_spec.deepspeed:
        raise MeshplanError(f"DeepSpeed's pipeline engine runs 1f1b only, not {cfg.schedule}; re-plan with "
                            "--schedule 1f1b")
    if cfg.precision == "fp8":
        notes.append("fp8: ds_config has no FP8 GEMM recipe (Transformer Engine is set in the model code); "
                     "exported as bf16")
    config: dict = {
        "train_batch_size": cfg.global_batch,
        "train_micro_batch_size_per_gpu": cfg.microbatch_size,
        "gradient_accumulation_steps": cfg.num_microbatches,
        "bf16": {"enabled": cfg.precision in ("bf16-mixed", "fp8")},
        "zero_optimization": {"stage": min(cfg.zero, 1) if cfg.pp > 1 else cfg.zero},
        "gradient_clipping": 1.0,
    }
    if cfg.cp > 1:  # DeepSpeed divides the world by it before checking the batch keys
        config["sequence_parallel_size"] = cfg.cp
        if cfg.cp_method != "ulysses":
            notes.append(f"context parallelism {cfg.cp}: DeepSpeed-Ulysses (all-to-all over heads, set up by the "
                         f"model code) splits the sequence; this plan's {cfg.cp_method} method is priced as "
                         "planned (re-plan with --cp-method ulysses to match DeepSpeed)")
    for key in OFFLOAD_KEYS.get(cfg.offload, ()):  # pinned host memory, as ZeRO-Offload's tutorial sets it
        config["zero_optimization"][key] = {"device": "cpu", "pin_memory": True}
    if cfg.shard_group and cfg.zero == 3:
        config["zero_optimization"]["mics_shard_size"] = cfg.shard_group
    elif cfg.shard_group:
        notes.append(f"HSDP (shard groups of {cfg.shard_group}) at ZeRO-{cfg.zero}: DeepSpeed shards within groups "
                     f"(MiCS) at ZeRO-3 only; exported as ZeRO-{cfg.zero} over all {cfg.dp} data-parallel ranks")
    if cfg.tp > 1:
        config["tensor_parallel"] = {"autotp_size": cfg.tp}
        if cfg.sp:
            notes.append("sequence parallelism: not a ds_config key; pass --sequence-parallel to Megatron-DeepSpeed")
    interval = _checkpoint_interval(plan, notes)
    config["pipeline"] = {"stages": cfg.pp, "partition": "uniform", "activation_checkpoint_interval": interval}
    if cfg.pp > 1:
        _note_pipeline(plan, notes)
    elif interval:
        notes.append("without pipelining DeepSpeed leaves checkpointing to the model code (deepspeed.checkpointing "
                     "around each block); the interval is recorded under pipeline")
    if cfg.ep > 1:
        notes.append(f"expert parallelism {cfg.ep}: ds_config has no key (ep_size of deepspeed.moe.layer.MoE in the "
                     "model code); estimate --from prices the config without it unless given --ep")
    return json.dumps(config, indent=2) + "\n", notes


def _checkpoint_interval(plan, notes: list[str]) -> int:
    modes = layout.block_recompute(plan)
    if all(mode == "full" for mode in modes):
        return 1
    if all(mode == "none" for mode in modes):
        return 0
    full = modes.count("full") + modes.count("selective")
    interval = 1 if 2 * full >= len(modes) else 0
    notes.append(f"per-layer recomputation (none {modes.count('none')}, selective {modes.count('selective')}, full "
                 f"{modes.count('full')}): DeepSpeed checkpoints whole layers at one interval; exported as "
                 f"{'full recomputation of every layer' if interval else 'no recomputation'}")
    return interval


def _note_pipeline(plan, notes: list[str]) -> None:
    cfg = plan.config
    if cfg.zero >= 2:
        notes.append(f"ZeRO-{cfg.zero} with pipelining: DeepSpeed's pipeline engine supports ZeRO-1 only; "
                     "exported as ZeRO-1")
    counts = layout.layers_per_chunk(plan)
    if len(counts) == cfg.pp and counts != uniform_split(sum(counts), cfg.pp):
        notes.append(f"pipeline split {list(counts)} (layers per stage, embedding and head included): exported as "
                     f"DeepSpeed's uniform split {list(uniform_split(sum(counts), cfg.pp))}")


def uniform_split(num_layers: int, parts: int) -> tuple[int, ...]:
    """DeepSpeed's `partition_uniform`: equal counts, the remainder on the last parts."""
    base, extra = divmod(num_layers, parts)
    return tuple(base + (1 if part >= parts - extra else 0) for part in range(parts))


def read_deepspeed(text: str) -> EngineJob:
    """An EngineJob from a ds_config.json."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MeshplanError(f"not a valid DeepSpeed JSON config: {exc}") from None
    except RecursionError:
        raise MeshplanError("not a DeepSpeed JSON config: nested hundreds of levels deep") from None
    if not isinstance(data, dict):
        raise MeshplanError("a DeepSpeed config must be a JSON object")
    notes = [f"{key}: not modelled by meshplan; priced without it" for key in UNPRICED
             if data.get("zero_optimization", {}).get(key)]
    pipe = data.get("pipeline", {})
    pp = _int(pipe, "stages", 1) if pipe.get("stages", "auto") != "auto" else 1
    tp = _int(data.get("tensor_parallel", {}), "autotp_size", 0) or 1
    mbs, accumulation, dp = _batch(data)
    interval = _int(pipe, "activation_checkpoint_interval", 0)
    if interval > 1:
        notes.append(f"activation_checkpoint_interval {interval}: checkpoints groups of {interval} layers; priced "
                     "as full recomputation of every layer")
    bf16, fp16 = _enabled(data, "bf16"), _enabled(data, "fp16")
    if fp16:
        notes.append("fp16: priced as bf16-mixed (same bytes and peak FLOP/s; no loss scaling)")
    uniform = pp > 1 and pipe.get("partition", "best") == "uniform"
    if pp > 1 and not uniform:
        notes.append(f"pipeline partition {pipe.get('partition', 'best')!r}: priced as meshplan's balanced split")
    zero = _int(data.get("zero_optimization", {}), "stage", 0)
    shard_group = _int(data.get("zero_optimization", {}), "mics_shard_size", 0) or None
    offload = _read_offload(data.get("zero_optimization", {}), zero, notes)
    if shard_group and zero != 3:
        notes.append(f"mics_shard_size {shard_group} at ZeRO-{zero}: MiCS needs ZeRO-3; ignored")
        shard_group = None
    cp = _int(data, "sequence_parallel_size", 1) or 1  # DeepSpeed-Ulysses
    return EngineJob(engine="deepspeed", global_batch=mbs * accumulation * dp if dp else None, microbatch_size=mbs,
                     tp=tp, pp=pp, dp=dp, cp=cp, cp_method="ulysses" if cp > 1 else "all-gather", zero=zero,
                     shard_group=None if shard_group == dp else shard_group,
                     recompute="full" if interval else "none", precision="bf16-mixed" if bf16 or fp16 else "fp32",
                     uniform_split=uniform, offload=offload, notes=tuple(notes))


def _read_offload(zero_config: dict, zero: int, notes: list[str]) -> str:
    """meshplan's offload mode of ds_config's `offload_param` / `offload_optimizer` (device cpu or
    nvme; nvme is priced as host memory)."""
    def device(key: str) -> str:
        table = zero_config.get(key)
        return table.get("device", "none") if isinstance(table, dict) else "none"

    for key in ("offload_param", "offload_optimizer"):
        if device(key) == "nvme":
            notes.append(f"{key} to nvme: priced as host memory (the NVMe's own bandwidth is not modelled)")
    if device("offload_param") != "none" and zero == 3:
        return "params"
    if device("offload_param") != "none":
        notes.append(f"offload_param at ZeRO-{zero}: DeepSpeed offloads parameters at ZeRO-3 only; ignored")
    return "optimizer" if device("offload_optimizer") != "none" else "none"


def _batch(data: dict) -> tuple[int, int, int | None]:
    """(micro-batch, accumulation steps, dp) from the three batch keys, any two of which fix the third."""
    total = data.get("train_batch_size")
    mbs = _int(data, "train_micro_batch_size_per_gpu", 0) or None
    accumulation = _int(data, "gradient_accumulation_steps", 0) or None
    if total is not None:
        total = _int(data, "train_batch_size", 0)
    if mbs is None:
        raise MeshplanError("the DeepSpeed config has no train_micro_batch_size_per_gpu; set it (meshplan needs the "
                            "micro-batch size)")
    accumulation = accumulation or 1
    if total is None:
        return mbs, accumulation, None
    if total % (mbs * accumulation):
        raise MeshplanError(f"DeepSpeed train_batch_size {total} is not micro-batch {mbs} x accumulation "
                            f"{accumulation} x data-parallel ranks; fix one of the three")
    return mbs, accumulation, total // (mbs * accumulation)


def _int(table, key: str, default: int) -> int:
    value = table.get(key, default) if isinstance(table, dict) else default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MeshplanError(f"DeepSpeed key {key} must be a non-negative integer, got {value!r}")
    return value


def _enabled(data: dict, key: str) -> bool:
    section = data.get(key, {})
    return bool(section.get("enabled", False)) if isinstance(section, dict) else False
