"""Dispatch between the engines: export a plan, read a config, predict it, pin a search to it."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from meshplan.planner.contracts.config import MTP_ENGINES, ParallelConfig
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.prediction import Prediction
from meshplan.planner.contracts.schedule import schedule_spec
from meshplan.planner.costing.state_memory import executed_zero
from meshplan.planner.engines import ENGINES
from meshplan.planner.engines.job import EngineJob, chunks_from_counts, dominant_recompute, resolve_recompute



@dataclass(frozen=True)
class Exported:
    """A plan in one engine's terms, and what had to be approximated (one line each)."""

    engine: str
    text: str
    notes: tuple[str, ...] = ()
    # What the config written is predicted to do under the engine when that is not what the plan
    # predicts: does not fit in the GPU's memory, or a step more than 1% off the plan's.
    warnings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise MeshplanError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")


@dataclass(frozen=True)
class JobEstimate:
    """An engine config priced by the simulator: what ran, and what was not mapped."""

    job: EngineJob
    spec: str
    seq: int
    config: ParallelConfig
    chunk_of_layer: tuple[int, ...]
    recompute_of_layer: tuple[str, ...]
    prediction: Prediction
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        if len(self.chunk_of_layer) != len(self.recompute_of_layer):
            raise ValueError("chunk_of_layer and recompute_of_layer must cover the same layers")


def export_plan(plan, engine: str, form: str | None = None) -> Exported:
    """`plan` written for `engine` (torchtitan TOML, or with `form` "python" its current Python
    config; Megatron-LM arguments; DeepSpeed JSON)."""
    if form not in (None, "toml") and engine != "torchtitan":
        raise MeshplanError(f"--format {form} is torchtitan's; {engine} has one config format")
    if engine == "torchtitan":
        from functools import partial

        from meshplan.planner.engines.torchtitan import export_torchtitan

        write = partial(export_torchtitan, form=form or "toml")
    elif engine == "megatron":
        from meshplan.planner.engines.megatron import export_megatron as write
    elif engine == "deepspeed":
        from meshplan.planner.engines.deepspeed import export_deepspeed as write
    else:
        raise MeshplanError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if _per_layer_degrees(plan):  # other refusals are meshplan's executor's, not the engines'
        raise MeshplanError(f"the plan is not executable ({plan.not_executable_reason}); engines run one mesh for "
                            "the whole model: re-plan without --layerwise")
    if plan.model.mtp_num_layers and engine not in MTP_ENGINES:
        raise MeshplanError(f"the plan trains {plan.model.mtp_num_layers} multi-token-prediction depth(s), which "
                            f"{engine} has no module for (Megatron-LM's --mtp-num-layers does): export it --to megatron, "
                            "or re-plan without --mtp-num-layers")
    text, notes = write(plan)
    warnings = _as_the_engine_runs_it(plan, engine, text)
    return Exported(engine=engine, text=text, notes=tuple(notes), warnings=tuple(warnings))


# A round trip (plan -> export -> estimate --from) further than this from the plan's step is named.
ROUND_TRIP_TOLERANCE = 0.01


def _as_the_engine_runs_it(plan, engine: str, text: str) -> list[str]:
    """The exported config priced back as the engine runs it (its memory recipe, its schedule):
    one line when it does not fit, one when its step is more than 1% from the plan's."""
    from meshplan.planner.simulation.simulator import plan_graph

    try:
        result = predict_job(read_engine_text(text, engine), plan.model.spec, plan.cluster, gpus=plan.config.gpus,
                             global_batch=plan.config.global_batch, seq=plan.model.seq,
                             attention=plan.model.attention, graph=plan_graph(plan))
        planned = _planned_step_s(plan, engine)
    except ValueError as exc:  # MeshplanError included: the plan is written anyway, unpriced
        return [f"not priced as {engine} runs it ({exc})"]
    out, prediction = [], result.prediction
    usable = plan.cluster.device.usable_memory_bytes
    if not prediction.fits:
        out.append(f"predicted not to fit under {engine}: {prediction.peak_memory_bytes / 2**30:.1f} GiB of "
                   f"{usable / 2**30:.1f} GiB per GPU as {engine} allocates it; re-plan with more ZeRO sharding or "
                   "recomputation")
    change = prediction.step_time_s / planned - 1
    if abs(change) > ROUND_TRIP_TOLERANCE:
        out.append(f"as {engine} runs it the step is predicted at {prediction.step_time_s * 1e3:.1f} ms, "
                   f"{change:+.1%} from the plan's {planned * 1e3:.1f} ms (see the approximations above)")
    return out


def _planned_step_s(plan, engine: str) -> float:
    """The plan's step as `engine` would run its exact configuration (the engine's overlap,
    `contracts.overlap`), so that only what the export approximates moves the round trip."""
    from dataclasses import replace

    from meshplan.planner.simulation.simulator import simulate

    if plan.config.engine == engine:
        return (plan.prediction or {}).get("step_time_s") or simulate(plan, timeline=False).step_time_s
    return simulate(replace(plan, config=replace(plan.config, engine=engine)), timeline=False).step_time_s


def _per_layer_degrees(plan) -> bool:
    """Whether the plan gives layers their own tp/dp (`--layerwise`), which no engine runs."""
    from meshplan.planner.costing.executable import LAYERWISE

    cfg = plan.config
    return (not plan.executable and plan.not_executable_reason == LAYERWISE
            or any((layer.tp, layer.dp) != (cfg.tp, cfg.dp) for layer in plan.layers))


def guess_engine(path: Path, text: str) -> str:
    """The engine a config file is for: by suffix, else by content."""
    suffix = path.suffix.lower()
    if suffix == ".py":
        return "torchtitan"
    if suffix == ".toml":
        return "torchtitan"
    if suffix == ".json":
        return "deepspeed"
    stripped = text.lstrip()
    if stripped.startswith("{"):
        return "deepspeed"
    if "[parallelism]" in text or "[training]" in text:
        return "torchtitan"
    if "--" in text:
        return "megatron"
    raise MeshplanError(f"cannot tell which engine {path} is for; pass --engine torchtitan|megatron|deepspeed")


def is_plan_text(text: str) -> bool:
    """Whether a file's text is a meshplan plan.json (its top-level keys), not an engine config."""
    import json

    if not text.lstrip().startswith("{"):
        return False
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and {"schema_version", "mesh", "layers", "schedule"} <= set(data)


def read_engine_text(text: str, engine: str) -> EngineJob:
    if engine == "torchtitan":
        from meshplan.planner.engines.torchtitan import read_torchtitan
        return read_torchtitan(text)
    if engine == "megatron":
        from meshplan.planner.engines.megatron import read_megatron
        return read_megatron(text)
    if engine == "deepspeed":
        from meshplan.planner.engines.deepspeed import read_deepspeed
        return read_deepspeed(text)
    raise MeshplanError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")


def read_engine_file(path, engine: str | None = None) -> EngineJob | None:
    """The EngineJob of a torchtitan TOML or Python config, Megatron-LM argument file or script, or
    DeepSpeed JSON; None for a meshplan plan.json (which is no engine's config)."""
    from meshplan.planner.contracts.jsonfile import read_input_text

    path = Path(path)
    text = read_input_text(path, "engine config", "give the path of a torchtitan .toml, a Megatron-LM argument "
                           "file or a DeepSpeed .json")
    if is_plan_text(text):
        return None
    return read_engine_text(text, engine or guess_engine(path, text))


def predict_job(job: EngineJob, model: str | None, cluster, *, gpus: int | None = None,
                global_batch: int | None = None, seq: int | None = None, attention: str | None = None,
                graph=None) -> JobEstimate:
    """Price an engine config with the simulator and the engine's own memory recipe.

    `graph`: the model's layer graph when the caller has it (an exported plan carries its own:
    pricing the export back never runs a file model's code); else the model is profiled.

    `attention`: the kernel (`contracts.attention`); None: the engine's default
    (`attention_kernels.ENGINE_DEFAULT_ATTENTION`: cuDNN fused attention for Megatron-Core).

    Command-line values (`model`, `gpus`, `global_batch`, `seq`) fill what the config leaves open
    and override what it says; a cluster must be given (no engine config names its GPUs)."""
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.costing.offload import check_offload
    from meshplan.planner.simulation.estimator import default_precision, make_config, predict

    spec = model or job.model
    if not spec:
        raise MeshplanError(f"the {job.engine} config does not name a model meshplan knows; pass --model SPEC")
    if cluster is None:
        raise MeshplanError(f"the {job.engine} config does not say which GPUs it runs on; pass --cluster PROFILE")
    cluster = load_cluster(cluster) if isinstance(cluster, str) else cluster
    notes = list(job.notes)
    if graph is not None:  # the kernel the graph was profiled for
        attention = graph.attention
    if attention is None:
        from meshplan.planner.costing.attention_kernels import engine_attention

        attention, note = engine_attention(job.engine, None, cluster)
        notes.extend([note] if note else [])
    gpus, global_batch = _job_size(job, gpus, global_batch, notes)
    seq = seq or job.seq
    if seq is None:  # DeepSpeed's config never says; a guess would price another job
        raise MeshplanError(f"the {job.engine} config does not give the sequence length; pass --seq N")
    precision = job.precision or default_precision(cluster)
    graph = _job_graph(job, spec, seq, precision, attention, graph)
    block_modes = resolve_recompute(job, [layer.name for layer in graph.layers], [0] * len(graph.layers))
    recompute = dominant_recompute([m for m in block_modes])
    config = make_config(graph, cluster, gpus=gpus, global_batch=global_batch, tp=job.tp, pp=job.pp, cp=job.cp,
                         ep=job.ep, mbs=job.microbatch_size, zero=job.zero, shard_group=job.shard_group,
                         recompute=recompute, sp=job.sp, schedule=job.schedule,
                         vpp=job.vpp, precision=precision, engine=job.engine, etp=job.etp,
                         fp8_recipe=job.fp8_recipe if precision == "fp8" else None,
                         fp8_filter=job.fp8_filter if precision == "fp8" else (),
                         recompute_modules=job.recompute_modules if recompute == "selective" else (),
                         offload=job.offload, cp_method=job.cp_method,
                         microbatch_group_size=job.microbatch_group_size if job.vpp > 1 else None,
                         grad_reduce_in_bf16=job.grad_reduce_in_bf16 and precision != "fp32",
                         tp_comm_overlap=job.tp_comm_overlap if job.tp > 1 and job.sp else None,
                         moe_a2a_overlap=job.moe_a2a_overlap, cross_entropy_fusion=job.cross_entropy_fusion,
                         recompute_early_stop=job.recompute_early_stop, torch_compile=job.torch_compile,
                         compile_loss=job.compile_loss)
    check_offload(config, cluster)
    chunks = _job_chunks(job, graph, cluster, config)
    recomputes = resolve_recompute(job, [layer.name for layer in graph.layers], chunks)
    prediction = predict(graph, cluster, config, chunks, recomputes)
    return JobEstimate(job=job, spec=spec, seq=seq, config=config, chunk_of_layer=chunks,
                       recompute_of_layer=recomputes, prediction=prediction, notes=tuple(notes))


def _job_graph(job: EngineJob, spec: str, seq: int, precision: str, attention: str, graph):
    """The layer graph the job runs: the caller's (with the job's multi-token-prediction depths
    added) or the model profiled; a MoE model takes the engine's token dispatcher."""
    from meshplan.planner.profiling.profiler import profile

    if graph is None:
        graph = profile(spec, seq, batch=1, dtype="fp32" if precision == "fp32" else "bf16", attention=attention,
                        mtp_num_layers=job.mtp_num_layers, engine=job.engine)
    elif graph.info.mtp_num_layers != job.mtp_num_layers:
        from meshplan.planner.profiling.mtp import with_mtp

        if graph.info.mtp_num_layers:
            raise MeshplanError(f"the model graph carries {graph.info.mtp_num_layers} multi-token-prediction layers "
                                f"and the {job.engine} config {job.mtp_num_layers}; profile the model without them")
        graph = with_mtp(graph, job.mtp_num_layers)
    if graph.info.is_moe and graph.info.moe_dispatcher != job.moe_dispatcher:  # the engine's token dispatcher
        graph = replace(graph, info=replace(graph.info, moe_dispatcher=job.moe_dispatcher))
    return graph


def _job_chunks(job: EngineJob, graph, cluster, config) -> tuple[int, ...]:
    """Each layer's model chunk: the engine's own split where the config gives one (its MTP depths
    join the last chunk, `profiling.mtp`), DeepSpeed's uniform split, else meshplan's balanced one."""
    from meshplan.planner.costing.uniform import balanced_layer_chunks
    from meshplan.planner.engines.deepspeed import uniform_split

    if job.layers_per_chunk is not None:
        counts = job.layers_per_chunk[:-1] + (job.layers_per_chunk[-1] + graph.info.mtp_num_layers,)
        return chunks_from_counts(counts, len(graph.layers))
    if job.uniform_split:
        return chunks_from_counts(uniform_split(len(graph.layers), config.num_model_chunks), len(graph.layers))
    return tuple(balanced_layer_chunks(graph, cluster, config))


def _job_size(job: EngineJob, gpus: int | None, global_batch: int | None, notes: list[str]) -> tuple[int, int]:
    """(GPUs, global batch): the command line's, else the config's."""
    fixed = job.world_size()
    if gpus is not None and fixed is not None and job.dp is not None and gpus != fixed:
        raise MeshplanError(f"the {job.engine} config fixes {fixed} GPUs (dp {job.dp} x tp {job.tp} x pp {job.pp} x "
                            f"cp {job.cp}) but --gpus is {gpus}; drop --gpus or change the config")
    gpus = gpus or fixed
    if gpus is None:
        raise MeshplanError(f"the {job.engine} config does not fix the number of GPUs; pass --gpus N")
    global_batch = global_batch or job.global_batch
    if global_batch is None:
        dp = gpus // (job.tp * job.pp * job.cp)
        global_batch = job.microbatch_size * dp
        notes.append(f"no global batch in the config: one micro-batch per data-parallel rank ({global_batch} samples)")
    return gpus, global_batch


def job_pins(job: EngineJob) -> dict:
    """What an engine config fixes, as `search_plan` pins (the rest is searched)."""
    # ZeRO-2/3 under a split-backward schedule run as ZeRO-1 (`costing.state_memory.executed_zero`),
    # the only stage the search offers there (an unstated dp is searched: taken as > 1)
    zero = executed_zero(job.zero, job.dp or 2, job.pp, job.schedule)
    pins = {"tp": job.tp, "pp": job.pp, "cp": job.cp, "ep": job.ep, "zero": zero, "shard_group": job.shard_group,
            "sp": job.sp if job.tp > 1 else None, "cp_method": job.cp_method if job.cp > 1 else None,
            "schedule": job.schedule if job.pp > 1 else None, "mbs": job.microbatch_size,
            "vpp": job.vpp if schedule_spec(job.schedule).multi_chunk and job.vpp > 1 else None,
            "offload": job.offload if job.offload != "none" else None}
    if job.dp is not None:
        pins["dp"] = job.dp
    if job.recompute_first_per_chunk is None and job.recompute_every == 1:
        pins["recompute"] = job.recompute
    return {key: value for key, value in pins.items() if value is not None}
