"""torchtitan: a plan as a job TOML (its `JobConfig` sections), and a job TOML back into an `EngineJob`.

torchtitan's data parallelism is FSDP2 (`data_parallel_shard_degree`) and/or replication
(`data_parallel_replicate_degree`); `fsdp_reshard_after_forward` "never" keeps the gathered
parameters through the step (ZeRO-2), "always" frees them after the forward (ZeRO-3). It has no
optimizer-only sharding with deferred gradient sync (ZeRO-1). Its tensor parallelism always shards
the sequence around the norms (SP). Without pipelining a step runs `global_batch_size /
(local_batch_size * dp)` accumulation steps of `local_batch_size` samples; with pipelining
`local_batch_size` is the replica's batch, cut into micro-batches of
`pipeline_parallel_microbatch_size`. `module_fqns_per_model_part` lists the modules of each
pipeline chunk exactly. Activation checkpointing: "none", "full", or "selective" with option
"op" (its per-op policy: meshplan's selective under `--engine torchtitan`, priced as the policy
reruns by `costing.torchtitan_sac`) or an integer N (full checkpointing of every N-th block).
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

from meshplan.planner.contracts.engine_rules import compiles_loss
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.fp8_choice import (FLOAT8_CONVERTER, FP8_AUTO_FILTER, FP8_LINEARS,
                                                   LEGACY_FLOAT8_CONVERTER, TORCHTITAN_LINEAR_FQNS)
from meshplan.planner.contracts.schedule import SCHEDULE_SPECS, schedule_spec
from meshplan.planner.costing.overlap import overlap_under
from meshplan.planner.engines import job as layout
from meshplan.planner.engines.job import EngineJob
from meshplan.planner.engines.shapes import TORCHTITAN_FLAVOURS, torchtitan_flavour

# torchtitan's [parallelism] key for each parallel axis but dp (`contracts.axes`; dp is its
# replicate x shard degrees), in the order the export writes them.
AXIS_KEYS = {"tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree", "cp": "context_parallel_degree",
             "ep": "expert_parallel_degree", "etp": "expert_tensor_parallel_degree"}
# torchtitan's [training] key for the job's global batch and sequence (the export writes them, the
# reader reads them, `meshplan.flag_hints` names meshplan's flag for each).
TRAINING_KEYS = {"gbs": "global_batch_size", "seq": "seq_len"}
DESCRIPTION_PREFIX = "meshplan: "  # job.description carries the meshplan SPEC for models with no flavour
# torchtitan's [parallelism] keys (JobConfig.Parallelism)
PARALLELISM_KEYS = (
    "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel", "pipeline_parallel_degree",
    "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size", "pipeline_parallel_expert_parallel_overlap",
    "context_parallel_degree", "context_parallel_load_balancer", "context_parallel_rotate_method",
    "expert_parallel_degree", "expert_tensor_parallel_degree", "expert_parallel_comm_backend")
# keys that change speed or memory in ways meshplan does not price
# The Float8 recipe_name choices meshplan prices (torchtitan 0.2's Float8Linear config).
TORCHTITAN_FP8_RECIPES = ("tensorwise", "rowwise")
UNPRICED_KEYS = {("parallelism", "pipeline_parallel_layers_per_stage"),
                 ("parallelism", "pipeline_parallel_schedule_csv"),
                 ("parallelism", "disable_loss_parallel")}  # meshplan prices the loss vocab-parallel under TP
# torch.compile of the model: torchtitan 0.2's `training.compile`, later `[compile] enable`
# (`EngineJob.torch_compile`: its Float8 casts priced fused, its Llama blocks' elementwise kernels by the fused rule)
COMPILE_KEYS = (("training", "compile"), ("compile", "enable"))


def export_torchtitan(plan, form: str = "toml") -> tuple[str, list[str]]:
    """(job config text, approximation notes) for `plan`: torchtitan 0.2's job TOML (`form`
    "toml") or the Python config function of torchtitan 0.3 ("python")."""
    notes: list[str] = []
    sections = job_sections(plan, notes)
    if form == "python":
        from meshplan.planner.engines.torchtitan_python import python_config

        return python_config(sections, plan.model.spec, f"{plan.config.label()} on {plan.config.gpus} GPUs",
                             notes), notes
    if form != "toml":
        raise MeshplanError(f"torchtitan config format must be toml or python, got {form!r}")
    lines = ["# torchtitan job config written by meshplan export",
             f"# {plan.config.label()} on {plan.config.gpus} GPUs"]
    for section, values in sections.items():
        lines += ["", f"[{section}]"] + [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n", notes


def job_sections(plan, notes: list[str]) -> dict[str, dict]:
    """The plan as torchtitan's config sections (TOML tables; the Python config's dataclasses)."""
    cfg = plan.config
    if cfg.cp > 1 and cfg.cp_method == "ulysses":
        raise MeshplanError(f"torchtitan (0.2.2 and 0.3.0) has no Ulysses context parallelism: its cp is torch's ring "
                            f"attention (context_parallel_rotate_method allgather or alltoall rotates K/V shards); "
                            f"re-plan with --cp-method all-gather to export cp={cfg.cp} to torchtitan")
    flavour = torchtitan_flavour(plan.model.spec)
    if flavour is None:
        notes.append(f"model {plan.model.spec}: not a torchtitan flavour; [model] names llama3 'custom' and the "
                     "SPEC is kept in job.description")
    name, flavor = flavour or ("llama3", "custom")
    model = {"name": name, "flavor": flavor}
    if cfg.precision == "fp8":  # torchao Float8Linear under the plan's recipe (`_float8_section`)
        model["converters"] = [FLOAT8_CONVERTER]
    sections = {
        "job": {"description": DESCRIPTION_PREFIX + plan.model.spec},
        "model": model,
        "training": _training(plan),
        "parallelism": _parallelism(plan, notes),
        "activation_checkpoint": _checkpointing(plan, notes),
    }
    if cfg.precision == "fp8":
        sections[FLOAT8_CONVERTER] = _float8_section(cfg, notes)
    async_tp = bool(sections["parallelism"].get("enable_async_tensor_parallel"))
    # torchtitan's maybe_enable_async_tp refuses async TP uncompiled; the loss compiled as the plan says
    components = (["model"] if cfg.torch_compile or async_tp else []) + (["loss"] if compiles_loss(cfg) else [])
    if components:
        sections["compile"] = {"enable": True, "components": components}
    if async_tp and not cfg.torch_compile:
        notes.append("async TP (the plan's TP overlap): torchtitan runs it through torch.compile of the model, so "
                     "[compile] is enabled; meshplan prices the overlap, not compile's other effects "
                     "(plan with --compile to price its Float8 casts fused)")
    if cfg.offload != "none":  # FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer states
        sections["training"]["enable_cpu_offload"] = True
        if cfg.offload == "optimizer":
            notes.append("offload optimizer: torchtitan offloads parameters, gradients and optimizer states together "
                         "(FSDP2 CPUOffloadPolicy); enable_cpu_offload moves more than the plan priced")
    if cfg.tp > 1 and not cfg.sp:
        notes.append("sequence parallelism off: torchtitan's tensor parallelism always shards the sequence "
                     "around the norms (SP on)")
    return sections


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # ints, strings and lists of strings read the same in TOML


def _training(plan) -> dict:
    cfg = plan.config
    local = cfg.global_batch // cfg.dp if cfg.pp > 1 else cfg.microbatch_size
    return {"local_batch_size": local, TRAINING_KEYS["gbs"]: cfg.global_batch, TRAINING_KEYS["seq"]: plan.model.seq,
            "mixed_precision_param": "float32" if cfg.precision == "fp32" else "bfloat16",
            "mixed_precision_reduce": "float32"}


def _parallelism(plan, notes: list[str]) -> dict:
    cfg = plan.config
    sharded = cfg.zero >= 1 and cfg.dp > 1
    if cfg.zero == 0 and cfg.cp > 1:
        notes.append(f"ZeRO-0 with context parallelism {cfg.cp}: torchtitan shards over dp_shard x cp whenever cp > 1; "
                     "exported as FSDP without resharding after forward (ZeRO-2)")
    group = getattr(cfg, "shard_group", None) or cfg.dp  # HSDP: shard within groups, replicate across them
    out = {"data_parallel_replicate_degree": cfg.dp // group if sharded else cfg.dp,
           "data_parallel_shard_degree": group if sharded else 1,
           "fsdp_reshard_after_forward": "always" if cfg.zero == 3 else "never",
           **{key: getattr(cfg, name) for name, key in AXIS_KEYS.items() if name != "etp"},
           AXIS_KEYS["etp"]: cfg.expert_tp}  # torchtitan's default expert TP is 1, meshplan's tp: always written
    if cfg.zero == 1 and cfg.dp * cfg.cp > 1:
        notes.append("ZeRO-1: torchtitan's FSDP has no optimizer-only sharding; exported as FSDP without "
                     "resharding after forward (ZeRO-2, gradients reduce-scattered every micro-batch)")
    if cfg.tp > 1 and cfg.sp and overlap_under(cfg, "torchtitan").tp_comm_overlap:  # the plan's: torchtitan's async TP
        out["enable_async_tensor_parallel"] = True
    if cfg.pp > 1:
        out["pipeline_parallel_schedule"] = cfg.schedule_spec.torchtitan_name
        out["pipeline_parallel_microbatch_size"] = cfg.microbatch_size
        out["module_fqns_per_model_part"] = [_fqns(plan, chunk) for chunk in plan.chunks()]
    return out


def _fqns(plan, chunk: list[int]) -> list[str]:
    """torchtitan's module names of one chunk's layers (embed, blocks.i, head)."""
    out: list[str] = []
    for index in chunk:
        name = plan.layers[index].name
        out += {"embed": ["tok_embeddings"], "head": ["norm", "output"]}.get(name, [name.replace("blocks.", "layers.")])
    return out


def _checkpointing(plan, notes: list[str]) -> dict:
    modes = layout.block_recompute(plan)
    if plan.config.recompute_early_stop is False and "full" in modes:
        notes.append("recompute early stop off: torchtitan's checkpoint wrapper runs torch's default, which stops "
                     "before each block's MLP down projection; the plan was priced rerunning the whole block")
    if all(mode == "none" for mode in modes):
        return {"mode": "none"}
    if all(mode == "full" for mode in modes):
        return {"mode": "full"}
    if all(mode == "selective" for mode in modes):
        return {"mode": "selective", "selective_ac_option": "op"}
    every = layout.every_nth_full(modes)
    if every is None:
        full = modes.count("full")
        every = max(1, round(len(modes) / full)) if full else None
        what = f"full checkpointing of every {every}-th block" if every else "per-op selective checkpointing"
        notes.append(f"per-layer recomputation (none {modes.count('none')}, selective {modes.count('selective')}, "
                     f"full {full}): torchtitan applies one rule to all blocks; exported as {what}")
    return {"mode": "selective", "selective_ac_option": str(every) if every else "op"}


# ------------------------------------------------------------------------------------------------
# reading


def read_torchtitan(text: str) -> EngineJob:
    """An EngineJob from a torchtitan job TOML or Python config (`torchtitan_python`)."""
    from meshplan.planner.engines.torchtitan_python import is_python_config, read_sections

    read_notes: list[str] = []
    if is_python_config(text):
        data, read_notes = read_sections(text)
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise MeshplanError(f"not a valid torchtitan TOML: {exc}") from None
        except RecursionError:
            raise MeshplanError("not a torchtitan TOML: nested hundreds of levels deep") from None
    notes = read_notes + _unpriced(data)
    par, train = data.get("parallelism", {}), data.get("training", {})
    degrees = {name: _int(par, key, 1) for name, key in AXIS_KEYS.items()}
    pp = degrees["pp"]
    replicate, shard = _int(par, "data_parallel_replicate_degree", 1), _int(par, "data_parallel_shard_degree", -1)
    fqns = par.get("module_fqns_per_model_part")
    vpp = len(fqns) // pp if fqns and pp > 1 else 1
    schedule = _schedule(par.get("pipeline_parallel_schedule", "1F1B"), pp, vpp, notes)
    dp = replicate * shard if shard > 0 else None
    local = _int(train, "local_batch_size", _int(train, "batch_size", 8))
    global_batch = _int(train, TRAINING_KEYS["gbs"], -1)
    mbs = _int(par, "pipeline_parallel_microbatch_size", 1) if pp > 1 else local
    recompute, every = _read_checkpointing(data.get("activation_checkpoint", {}), notes)
    precision = "bf16-mixed" if train.get("mixed_precision_param", "bfloat16") == "bfloat16" else "fp32"
    fp8_recipe = _float8(data, notes)
    fp8_filter = _float8_filter(data, notes) if fp8_recipe else ()
    if fp8_recipe:
        precision = "fp8"
    zero = _zero(replicate, shard, par.get("fsdp_reshard_after_forward", "default"), pp, degrees["cp"])
    offload = "none"
    if train.get("enable_cpu_offload"):  # FSDP2's CPUOffloadPolicy; meshplan prices it at ZeRO-3
        offload = "params" if zero == 3 else "optimizer"
        if zero != 3:
            notes.append(f"enable_cpu_offload at ZeRO-{zero} (parameters kept gathered after forward): priced as "
                         "the optimizer offloaded")
    return EngineJob(
        engine="torchtitan", model=_model(data, notes), seq=_int(train, TRAINING_KEYS["seq"], 2048), gpus=None,
        global_batch=global_batch if global_batch > 0 else (local * dp if dp else None), microbatch_size=mbs,
        **degrees, dp=dp, sp=degrees["tp"] > 1,
        tp_comm_overlap=bool(par.get("enable_async_tensor_parallel", False)) if degrees["tp"] > 1 else None,
        zero=zero, offload=offload, shard_group=shard if replicate > 1 and shard > 1 else None,
        recompute=recompute, recompute_every=every, schedule=schedule,
        vpp=max(vpp, schedule_spec(schedule).least_chunks) if schedule_spec(schedule).multi_chunk else 1,
        precision=precision, fp8_recipe=fp8_recipe, fp8_filter=fp8_filter, layers_per_chunk=_chunks(fqns, pp, notes),
        **_compiled(data, notes), notes=tuple(notes))


def _compiled(data: dict, notes: list[str]) -> dict:
    """`torch_compile` and `compile_loss` of the config: `[compile] enable` with "model" and "loss"
    among its `components` (torchtitan 0.2's default, both, where unset); `[training] compile`, the
    key's last versions (April to August 2025), both. With a note of what compiling the model prices."""
    for section, key in COMPILE_KEYS:
        table = data.get(section)
        if not (isinstance(table, dict) and table.get(key) not in (None, False, [], "", 0)):
            continue
        components = table.get("components", ["model", "loss"]) if section == "compile" else ["model", "loss"]
        if not isinstance(components, list) or not all(name in ("model", "loss") for name in components):
            raise MeshplanError(f"[compile] components must list \"model\", \"loss\" or both (torchtitan's "
                                f"compilable parts), got {components!r}")
        if section == "training":
            notes.append("[training] compile = true: the model and the loss priced compiled, as torchtitan ran them "
                         "from April 2025; before, it compiled the model alone (--compile-loss off)")
        if "model" in components:
            notes.append(f"[{section}] {key} = {table.get(key)!r}: torch.compile priced as its Float8 casts fused "
                         "with the ops before them and its Llama blocks' elementwise kernels fused (not counted op "
                         "by op as eager torchtitan runs them)")
        return {"torch_compile": "model" in components, "compile_loss": "loss" in components}
    return {"torch_compile": False, "compile_loss": None}


def _int(table: dict, key: str, default: int) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MeshplanError(f"torchtitan key {key} must be an integer, got {value!r}")
    return value


def _float8_section(cfg, notes: list[str]) -> dict:
    """The Float8 table of an fp8 plan. recipe_name unset is torchao's tensorwise, the one recipe
    whose weights FSDP2 gathers in fp8 (torchtitan refuses enable_fsdp_float8_all_gather beside a
    recipe_name); rowwise names itself and gathers bf16, as meshplan prices it. torchtitan has no
    delayed scaling, and MXFP8 is its separate `mx` converter: both are exported as tensorwise."""
    recipe = cfg.fp8_recipe
    if recipe not in TORCHTITAN_FP8_RECIPES:
        notes.append(f"fp8 recipe {recipe}: torchtitan's Float8 recipe_name has no such choice "
                     f"({', '.join(TORCHTITAN_FP8_RECIPES)}); exported as tensorwise")
        recipe = "tensorwise"
    gather = recipe == "tensorwise" and cfg.zero >= 1
    section = {"enable_fsdp_float8_all_gather": gather, "precompute_float8_dynamic_scale_for_fsdp": gather,
               "filter_fqns": [HEAD_FQN] + [TORCHTITAN_FILTERS.get(name, name) for name in cfg.fp8_filter]}
    return section if recipe == "tensorwise" else {**section, "recipe_name": recipe}


# torchtitan's Float8 filter_fqns entries: its output head (meshplan keeps the head in bf16, as
# torchtitan's own job files do; torchtitan 0.2's default list is empty) and its auto filter.
HEAD_FQN = "output"
TORCHTITAN_FILTERS = {**TORCHTITAN_LINEAR_FQNS, FP8_AUTO_FILTER: "auto_filter_small_kn"}


def _float8_filter(data: dict, notes: list[str]) -> tuple[str, ...]:
    """The block Linears a job's Float8 filter_fqns leave in bf16 (`ParallelConfig.fp8_filter`):
    each entry filters every Linear whose module name contains it, as torchtitan's
    `module_filter_fn` does; a note for what meshplan cannot price so."""
    entries = float8_table(data).get("filter_fqns", [])
    entries = [e.strip() for e in entries.split(",")] if isinstance(entries, str) else list(entries)
    if HEAD_FQN not in entries and "lm_head" not in entries:
        notes.append("float8 filter_fqns lacks 'output': torchtitan converts the output head to fp8 too; meshplan "
                     "prices the head in bf16")
    names: set[str] = set()
    for entry in entries:
        if entry in (HEAD_FQN, "lm_head") or not isinstance(entry, str) or not entry:
            continue
        if entry == TORCHTITAN_FILTERS[FP8_AUTO_FILTER]:
            names.add(FP8_AUTO_FILTER)
        elif entry.startswith("layers."):
            notes.append(f"float8 filter_fqns {entry!r} names blocks by index: meshplan gives every block one fp8 "
                         "filter; priced without it")
        elif matched := {role for role, fqn in TORCHTITAN_LINEAR_FQNS.items() if entry in fqn}:
            names |= matched
        else:
            notes.append(f"float8 filter_fqns {entry!r}: no block Linear meshplan prices is named so; priced without it")
    return tuple(name for name in (FP8_AUTO_FILTER, *FP8_LINEARS) if name in names)


def float8_table(data: dict) -> dict:
    """A job's Float8 table: [quantize.linear.float8], else the older [float8] ({} without either)."""
    table = data
    for key in FLOAT8_CONVERTER.split("."):
        table = table.get(key, {}) if isinstance(table, dict) else {}
    return table or data.get(LEGACY_FLOAT8_CONVERTER, {})


def _float8(data: dict, notes: list[str] | None = None) -> str | None:
    """The fp8 recipe of a job's Float8 converter (recipe_name unset: tensorwise), None without it."""
    converters = data.get("model", {}).get("converters", [])
    converters = [converters] if isinstance(converters, str) else converters
    if FLOAT8_CONVERTER not in converters and LEGACY_FLOAT8_CONVERTER not in converters:
        return None
    recipe = float8_table(data).get("recipe_name") or "tensorwise"
    if recipe == "rowwise_with_gw_hp":  # rowwise, its weight gradient in bf16
        if notes is not None:
            notes.append("float8 recipe_name 'rowwise_with_gw_hp': priced as rowwise (its bf16 weight-gradient "
                         "GEMM priced in fp8)")
        recipe = "rowwise"
    if recipe not in TORCHTITAN_FP8_RECIPES:
        if notes is not None:
            notes.append(f"float8 recipe_name {recipe!r}: not a torchtitan recipe; priced as tensorwise")
        recipe = "tensorwise"
    return recipe


def _unpriced(data: dict) -> list[str]:
    """One note per key that changes speed or memory unpriced, or that torchtitan does not know."""
    notes = []
    converters = data.get("model", {}).get("converters", [])
    for converter in [converters] if isinstance(converters, str) else converters:
        if converter not in (FLOAT8_CONVERTER, LEGACY_FLOAT8_CONVERTER):
            notes.append(f"[model] converters {converter!r}: not modelled by meshplan; priced without it")
    for section, key in sorted(UNPRICED_KEYS):
        table = data.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        if value not in (None, False, [], "", 0):
            notes.append(f"[{section}] {key} = {value!r}: not modelled by meshplan; priced without it")
    for key in data.get("parallelism", {}):
        if key not in PARALLELISM_KEYS:
            notes.append(f"[parallelism] {key}: not a torchtitan parallelism key; ignored")
    return notes


def _model(data: dict, notes: list[str]) -> str | None:
    model = data.get("model", {})
    key = (model.get("name", "llama3"), str(model.get("flavor", "")))
    if key in TORCHTITAN_FLAVOURS:
        return TORCHTITAN_FLAVOURS[key]
    description = str(data.get("job", {}).get("description", ""))
    if description.startswith(DESCRIPTION_PREFIX):
        return description[len(DESCRIPTION_PREFIX):].strip()
    unknown = f"model {key[0]} flavour {key[1] or '?'}: no meshplan preset of that shape"
    assets = model.get("hf_assets_path")
    if isinstance(assets, str) and assets:
        config = Path(assets) / "config.json"
        if config.is_file():
            notes.append(f"{unknown}; priced from {config}, the Hugging Face config in the job's hf_assets_path "
                         "(pass --model if the flavour is not that checkpoint's shape)")
            return f"hf:{config}"
        notes.append(f"{unknown}, and its hf_assets_path {assets} has no config.json here (torchtitan resolves it "
                     "from where it runs); pass --model")
        return None
    notes.append(f"{unknown}; pass --model")
    return None


def _schedule(name: str, pp: int, vpp: int, notes: list[str]) -> str:
    if pp == 1:
        return "1f1b"
    known = {spec.torchtitan_name.lower(): spec.name for spec in SCHEDULE_SPECS.values()}
    schedule = known.get(name.lower())
    if schedule is None:
        schedule = "interleaved" if vpp > 1 else "1f1b"
        notes.append(f"pipeline schedule {name}: not modelled; priced as {schedule_spec(schedule).torchtitan_name}")
    return schedule


def _zero(replicate: int, shard: int, reshard: str, pp: int, cp: int) -> int:
    """FSDP's reshard policy as a ZeRO stage (HSDP: within each shard group). torchtitan's FSDP
    mesh is dp_shard x cp: context parallelism alone turns it on."""
    if shard == 1 and cp == 1:
        return 0
    if reshard == "never" or (reshard == "default" and pp > 1):
        return 2
    return 3


def _read_checkpointing(table: dict, notes: list[str]) -> tuple[str, int]:
    mode = table.get("mode", "selective")
    if mode in ("none", "full"):
        return mode, 1
    if mode == "memory_budget":
        notes.append("activation_checkpoint mode memory_budget: priced as selective (per-op)")
        return "selective", 1
    if mode != "selective":
        raise MeshplanError(f"torchtitan activation_checkpoint.mode must be none, selective, full or memory_budget, "
                            f"got {mode!r}")
    option = str(table.get("selective_ac_option", "2"))
    if option == "op":
        return "selective", 1
    if not option.isdigit() or int(option) <= 0:
        raise MeshplanError(f"torchtitan selective_ac_option must be 'op' or a positive integer, got {option!r}")
    return "full", int(option)


def _chunks(fqns, pp: int, notes: list[str]) -> tuple[int, ...] | None:
    """meshplan layers per chunk: tok_embeddings -> embed, layers.i -> blocks.i, norm/output -> head."""
    if pp == 1:
        return None
    if not fqns:
        notes.append("no module_fqns_per_model_part: torchtitan's automatic split priced as meshplan's balanced split")
        return None
    counts = []
    for part in fqns:
        names = {"embed" if fqn == "tok_embeddings" else "head" if fqn in ("norm", "output") else fqn
                 for fqn in part}
        counts.append(len(names))
    return tuple(counts)
