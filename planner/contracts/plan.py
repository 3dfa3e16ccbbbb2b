"""The Plan: the JSON document the planner writes and the executor, simulator and reports read.

Layer placement. Layers are cut into `pp * virtual_stages` contiguous chunks in execution order.
Chunk j runs on pipeline rank `j % pp` as its virtual stage `j // pp` (Megatron-LM's
interleaving; the V-shaped schedules mirror the second half back, chunk j >= pp on rank
2 pp - 1 - j: `ParallelConfig.chunk_at`); without interleaving chunk j is simply stage j. Each layer records its `stage`
(pipeline rank) and `virtual_stage`, so their chunk index (`chunk_at(stage, virtual_stage)`) must be
non-decreasing along the layers, and every chunk non-empty.

Plans are data. A plan of a model defined by user code (a file model `path.py:fn`, an `hf:` config)
carries that model's layer graph under `model_graph` (and the file's sha256 in `model.digest`), so
`simulate`, `report` and `compare` cost it without importing the file; `model_file` says which
specs those are.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from meshplan.planner.contracts.axes import AXES
from meshplan.planner.contracts.config import (CP_METHODS, DEFAULT_CP_METHOD, DEFAULT_MOE_DISPATCHER, MOE_DISPATCHERS,
                                                RECOMPUTE, ParallelConfig)
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.cluster import ClusterProfile, cluster_from_dict
from meshplan.planner.contracts.graph import ModelGraph, graph_from_json, graph_to_json

# 2: context parallelism (`mesh.cp`); version-1 plans (no cp) still load, as cp = 1.
# `mesh.ep` (expert parallelism) is optional within version 2: written only when ep > 1, read as 1 when absent;
# `mesh.etp` (expert tensor parallelism) likewise, written only when set apart from tp, absent: tp.
# `cp_method` likewise, written only when cp > 1, absent: all-gather (the first CP method).
# `schedule.microbatch_group_size` likewise, written only when set, absent: the schedule's own group.
# `grad_reduce_in_bf16` likewise, written only when true (Megatron-LM's bf16 gradient buffer), absent: false.
# `tp_comm_overlap` likewise, written only when set (--tp-comm-overlap), absent: the engine's record.
# `cross_entropy_fusion` likewise, written only when not "none" (Megatron-Core's loss kernels), absent: "none".
# `recompute_early_stop` likewise, written only when set apart from the engine's rule, absent: the engine's.
# `torch_compile` likewise, written only when true (torchtitan's training.compile), absent: false.
# `compile_loss` likewise, written only when set apart from the model's compilation, absent: with the model.
# `model_graph` is optional within version 2: written for file and hf: models only.
PLAN_SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)


@dataclass(frozen=True)
class ModelRef:
    """What model the plan is for: enough to rebuild and re-profile it."""

    spec: str
    seq: int
    dtype: str = "bf16"
    attention: str = "flash"
    # sha256 of what defines the model when the plan was made (the spec string for built-in and
    # parametric specs, the file's bytes for hf: and file specs); "" in plans written before it
    # existed, which are not checked. `planner.models.plan_check.model_digest` computes it.
    digest: str = ""
    # Mixture of experts: the capacity factor the plan was costed under (0.0: none, as in plans
    # written before it existed) and whether expert inputs were padded to that capacity.
    moe_capacity_factor: float = 0.0
    moe_pad_to_capacity: bool = False
    # The token dispatcher it was costed under (`contracts.config.MOE_DISPATCHERS`); written only
    # when not the default, so plans without it read as alltoall, as they were costed.
    moe_dispatcher: str = DEFAULT_MOE_DISPATCHER
    # Multi-token-prediction depths it was costed with (`profiling.mtp`); written only when > 0.
    mtp_num_layers: int = 0

    def __post_init__(self):
        if isinstance(self.mtp_num_layers, bool) or not isinstance(self.mtp_num_layers, int) \
                or self.mtp_num_layers < 0:
            raise ValueError(f"model.mtp_num_layers must be a whole number >= 0, got {self.mtp_num_layers!r}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ValueError(f"model.moe_dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, "
                             f"got {self.moe_dispatcher!r}")
        if isinstance(self.moe_capacity_factor, bool) or not isinstance(self.moe_capacity_factor, (int, float)) \
                or not 0.0 <= self.moe_capacity_factor < float("inf"):
            raise ValueError(f"model.moe_capacity_factor must be a finite number > 0 (0: none), "
                             f"got {self.moe_capacity_factor!r}")
        if self.moe_pad_to_capacity and not self.moe_capacity_factor:
            raise ValueError("model.moe_pad_to_capacity needs a model.moe_capacity_factor")
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError(f"model.spec must be a model SPEC string, got {self.spec!r}")
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq <= 0:
            raise ValueError(f"model.seq must be a positive integer, got {self.seq!r}")
        if not isinstance(self.digest, str):
            raise ValueError(f"model.digest must be the hex string `meshplan plan` wrote (or absent), "
                             f"got {self.digest!r}")


@dataclass(frozen=True)
class LayerAssignment:
    """Where one layer runs and how, with the prediction that chose it (per micro-batch)."""

    name: str
    stage: int
    virtual_stage: int = 0
    tp: int = 1
    dp: int = 1
    recompute: str = "none"
    fwd_time_s: float = 0.0
    bwd_time_s: float = 0.0
    comm_time_s: float = 0.0
    mem_bytes: float = 0.0

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise ValueError(f"layer name must be a string, got {self.name!r}")
        for name in ("stage", "virtual_stage", "tp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"layer {self.name!r}: {name} must be an integer, got {value!r}")
        for name in ("fwd_time_s", "bwd_time_s", "comm_time_s", "mem_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"layer {self.name!r}: {name} must be a number, got {value!r}")
        if self.tp <= 0 or self.dp <= 0:
            raise ValueError(f"layer {self.name!r}: tp and dp must be positive, got tp={self.tp}, dp={self.dp}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"layer {self.name!r}: recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.stage < 0 or self.virtual_stage < 0:
            raise ValueError(f"layer {self.name!r}: stage and virtual_stage must be >= 0")


@dataclass(frozen=True)
class Plan:
    model: ModelRef
    cluster: ClusterProfile
    config: ParallelConfig
    layers: tuple[LayerAssignment, ...]
    prediction: dict[str, Any] | None = None
    alternatives: tuple[dict[str, Any], ...] = ()
    seed: int = 0
    executable: bool = True
    not_executable_reason: str = ""
    solver: dict[str, Any] = field(default_factory=dict)
    schema_version: int = PLAN_SCHEMA_VERSION
    # The layer graph of a model defined by user code (`model_file`): what reading the plan needs of
    # that model, so no command but `train` has to run it. None for zoo specs and older plans.
    graph: ModelGraph | None = None

    def __post_init__(self):
        cfg = self.config
        if self.graph is not None:
            self._check_graph()
        if not self.layers:
            raise ValueError("plan has no layers")
        previous_chunk = 0
        chunks_seen = set()
        for layer in self.layers:
            if layer.stage >= cfg.pp:
                raise ValueError(f"layer {layer.name!r} is on stage {layer.stage} but the plan has pp={cfg.pp}")
            if layer.virtual_stage >= cfg.virtual_stages:
                raise ValueError(f"layer {layer.name!r} has virtual_stage {layer.virtual_stage} but the plan has "
                                 f"{cfg.virtual_stages} virtual stages")
            chunk = self.chunk_of(layer)
            if chunk < previous_chunk:
                raise ValueError(f"layer {layer.name!r} (chunk {chunk}) comes after chunk {previous_chunk}: "
                                 "stages must hold contiguous layers in order")
            previous_chunk = chunk
            chunks_seen.add(chunk)
            if self.executable and (layer.tp != cfg.tp or layer.dp != cfg.dp):
                raise ValueError(f"layer {layer.name!r} has tp={layer.tp}, dp={layer.dp} but the mesh is "
                                 f"tp={cfg.tp}, dp={cfg.dp}; per-layer degrees are only allowed in "
                                 "non-executable (--layerwise) plans")
        if len(chunks_seen) != cfg.num_model_chunks:
            missing = sorted(set(range(cfg.num_model_chunks)) - chunks_seen)
            raise ValueError(f"pipeline chunks {missing} hold no layers; every stage needs at least one layer")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"layer {dup!r} is assigned more than once")

    def _check_graph(self) -> None:
        graph = self.graph
        if not isinstance(graph, ModelGraph):
            raise ValueError(f"plan graph must be a ModelGraph, got {type(graph).__name__}")
        if (graph.spec, graph.seq) != (self.model.spec, self.model.seq):
            raise ValueError(f"model_graph is of {graph.spec!r} at seq {graph.seq}, but the plan's model is "
                             f"{self.model.spec!r} at seq {self.model.seq}")
        if [layer.name for layer in graph.layers] != [layer.name for layer in self.layers]:
            raise ValueError(f"model_graph's {len(graph.layers)} layers are not the plan's {len(self.layers)} "
                             "layers in order")

    def chunk_of(self, layer: LayerAssignment) -> int:
        return self.config.chunk_at(layer.stage, layer.virtual_stage)

    def chunks(self) -> list[list[int]]:
        """Layer indices of each pipeline chunk, in chunk order."""
        out: list[list[int]] = [[] for _ in range(self.config.num_model_chunks)]
        for index, layer in enumerate(self.layers):
            out[self.chunk_of(layer)].append(index)
        return out

    @property
    def digest(self) -> str:
        """Hash of everything that decides what runs (not predictions or solve times)."""
        core = {k: v for k, v in self.to_json().items()
                if k in ("schema_version", "seed", "precision", "model", "mesh", "zero", "shard_group", "sp",
                         "schedule", "global_batch", "offload", "grad_reduce_in_bf16", "tp_comm_overlap",
                         "moe_a2a_overlap", "cross_entropy_fusion", "recompute_early_stop", "torch_compile",
                         "compile_loss")
                or (k == "cp_method" and v != DEFAULT_CP_METHOD)}  # all-gather plans keep their digest
        core["layers"] = [{k: layer[k] for k in ("name", "stage", "virtual_stage", "tp", "dp", "recompute")}
                          for layer in self.to_json()["layers"]]
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "schema_version": self.schema_version,
            "seed": self.seed,
            "precision": cfg.precision,
            # fp8 plans only: the scaling recipe (older readers ignore the key; plans without it
            # take the engine's default, `contracts.config.DEFAULT_FP8_RECIPE`)
            **({"fp8_recipe": cfg.fp8_recipe} if cfg.fp8_recipe else {}),
            **({"fp8_filter": list(cfg.fp8_filter)} if cfg.fp8_filter else {}),  # the Linears left in bf16
            "engine": cfg.engine,
            # digest and the MoE routing fields only when set: none in old plans
            "model": {k: v for k, v in asdict(self.model).items()
                      if k not in ("digest", "moe_capacity_factor", "moe_pad_to_capacity", "moe_dispatcher",
                                   "mtp_num_layers")
                      or (v and v != DEFAULT_MOE_DISPATCHER)},
            "cluster": {"profile": self.cluster.name, "gpus": cfg.gpus, "embedded": self.cluster.to_dict()},
            "global_batch": cfg.global_batch,
            "mesh": mesh_json(cfg),
            **cp_method_json(cfg),
            "zero": cfg.zero,
            "sp": cfg.sp,
            "recompute": cfg.recompute,
            "schedule": {"name": cfg.schedule, "microbatches": cfg.num_microbatches,
                         "microbatch_size": cfg.microbatch_size, "virtual_stages": cfg.virtual_stages,
                         # interleaved 1F1B's group size, when set apart from the schedule's own
                         **({"microbatch_group_size": cfg.microbatch_group_size}
                            if cfg.microbatch_group_size else {})},
            "executable": self.executable,
            "not_executable_reason": self.not_executable_reason,
            "layers": [asdict(layer) for layer in self.layers],
            "prediction": self.prediction,
            "alternatives": list(self.alternatives),
            "solver": self.solver,
            # HSDP only: older readers ignore the key, plans without it shard over all of dp
            **({"shard_group": cfg.shard_group} if cfg.shard_group else {}),
            # Megatron-LM's bf16 gradient buffer only: plans without the key accumulate in fp32
            **({"grad_reduce_in_bf16": True} if cfg.grad_reduce_in_bf16 else {}),
            # TP overlap only when the job sets it: plans without the key take the engine's record
            **({"tp_comm_overlap": cfg.tp_comm_overlap} if cfg.tp_comm_overlap is not None else {}),
            # Megatron-Core's combined 1F1B only: plans without the key block on their all-to-alls
            **({"moe_a2a_overlap": True} if cfg.moe_a2a_overlap else {}),
            # Megatron-Core's fused loss kernels only: plans without the key run its unfused loss
            **({"cross_entropy_fusion": cfg.cross_entropy_fusion} if cfg.cross_entropy_fusion != "none" else {}),
            # torch's checkpoint early stop set apart from the engine's rule only: plans without the key
            # take the engine's (`engine_rules.early_stop_default`)
            **({"recompute_early_stop": cfg.recompute_early_stop} if cfg.recompute_early_stop is not None else {}),
            # torch.compile only (torchtitan's training.compile): plans without the key run eager
            **({"torch_compile": True} if cfg.torch_compile else {}),
            # the loss compiled apart from the model only (torchtitan's [compile] components)
            **({"compile_loss": cfg.compile_loss} if cfg.compile_loss is not None else {}),
            # offloading only: plans without the key keep every state on the device
            **({"offload": cfg.offload} if cfg.offload != "none" else {}),
            # user-code models only: their layer graph, so reading the plan never runs the file
            **({"model_graph": graph_to_json(self.graph)} if self.graph is not None else {}),
        }

    def with_prediction(self, prediction: dict[str, Any]) -> "Plan":
        return replace(self, prediction=prediction)


def mesh_json(cfg: ParallelConfig) -> dict[str, int]:
    """The plan's `mesh` table (`contracts.axes`): pp, dp, tp, then each optional axis that is on
    (cp, ep; etp when set apart from tp)."""
    return {**{axis.name: getattr(cfg, axis.name) for axis in AXES if not axis.optional},
            **{axis.name: getattr(cfg, axis.name) for axis in AXES if axis.optional and axis.shown(cfg)}}


def cp_method_json(cfg: ParallelConfig) -> dict[str, str]:
    """{"cp_method": ...} under context parallelism, else {}: older readers ignore the key, and a
    plan without it runs the first method (`contracts.config.DEFAULT_CP_METHOD`)."""
    return {"cp_method": cfg.cp_method} if cfg.cp > 1 else {}


def _mesh_degree(mesh: dict, axis) -> int | None:
    """An axis's degree in a plan's `mesh`: an optional axis absent reads as 1, or unset (None)
    for one that follows another (etp: tp); a first-schema axis must be there."""
    if axis.follows is not None and mesh.get(axis.name) is None:
        return None
    return _integer(mesh, axis.name, "mesh.", default=1 if axis.optional else None)


def plan_from_json(data: dict[str, Any]) -> Plan:
    """Build and validate a Plan from its JSON document."""
    if not isinstance(data, dict):
        raise ValueError("a plan must be a JSON object")
    version = data.get("schema_version")
    if version not in READABLE_SCHEMA_VERSIONS:
        raise ValueError(f"plan schema_version is {version!r}; this meshplan reads versions "
                         f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}. "
                         "Re-create the plan with `meshplan plan`")
    try:
        schedule, mesh = _table(data, "schedule"), _table(data, "mesh")
        cluster = cluster_from_dict(_table(_table(data, "cluster"), "embedded", "cluster."))
        gpus = _integer(data["cluster"], "gpus", "cluster.")
        config = ParallelConfig(
            gpus=gpus, global_batch=_integer(data, "global_batch"),
            **{axis.name: _mesh_degree(mesh, axis) for axis in AXES},
            microbatch_size=_integer(schedule, "microbatch_size", "schedule."), zero=_integer(data, "zero"),
            recompute=data.get("recompute", "none"), sp=_boolean(data, "sp"), schedule=schedule["name"],
            virtual_stages=_integer(schedule, "virtual_stages", "schedule."), precision=data["precision"],
            engine=data.get("engine", "meshplan"),  # plans written before the key: meshplan's executor
            fp8_recipe=data.get("fp8_recipe"), fp8_filter=tuple(_names(data, "fp8_filter")),
            offload=data.get("offload", "none"),
            cp_method=_cp_method(data), grad_reduce_in_bf16=_boolean(data, "grad_reduce_in_bf16", default=False),
            tp_comm_overlap=None if data.get("tp_comm_overlap") is None else _boolean(data, "tp_comm_overlap"),
            moe_a2a_overlap=_boolean(data, "moe_a2a_overlap", default=False),
            cross_entropy_fusion=data.get("cross_entropy_fusion", "none"),
            recompute_early_stop=(None if data.get("recompute_early_stop") is None
                                  else _boolean(data, "recompute_early_stop")),
            torch_compile=_boolean(data, "torch_compile", default=False),
            compile_loss=None if data.get("compile_loss") is None else _boolean(data, "compile_loss"),
            microbatch_group_size=(None if schedule.get("microbatch_group_size") is None
                                   else _integer(schedule, "microbatch_group_size", "schedule.")),
            shard_group=None if data.get("shard_group") is None else _integer(data, "shard_group"))
        if _integer(schedule, "microbatches", "schedule.") != config.num_microbatches:
            raise ValueError(f"schedule.microbatches is {schedule['microbatches']} but global_batch / (dp * "
                             f"microbatch_size) = {config.num_microbatches}")
        layers = _layers(data["layers"])
        prediction, alternatives = _prediction(data), data.get("alternatives") or []
        if not isinstance(alternatives, list) or not all(isinstance(a, dict) for a in alternatives):
            raise ValueError("plan field 'alternatives' must be a list of objects (runnable configurations)")
        return Plan(model=_build(ModelRef, _table(data, "model"), "model"), cluster=cluster, config=config,
                    layers=layers, prediction=prediction, alternatives=tuple(alternatives),
                    seed=_integer(data, "seed", default=0), executable=_boolean(data, "executable", default=True),
                    not_executable_reason=data.get("not_executable_reason", ""),
                    solver=data.get("solver") or {}, schema_version=version,
                    graph=_carried_graph(data.get("model_graph")))
    except KeyError as exc:
        raise ValueError(f"plan is missing the field {exc.args[0]!r}") from None
    except TypeError as exc:
        raise ValueError(f"plan has a malformed entry: {exc}") from None


def _carried_graph(item: Any) -> ModelGraph | None:
    if item is None:
        return None
    if not isinstance(item, dict):
        raise ValueError(f"plan field 'model_graph' must be an object, got {_kind(item)}")
    try:
        return graph_from_json(item)
    except ValueError as exc:
        raise ValueError(f"plan field 'model_graph': {exc}") from None


def model_file(spec: str) -> str | None:
    """What a model spec names when user code or a user config defines the model (`path.py:fn`:
    the Python file; `hf:...`: the config's path, directory or hub repository id, as written);
    None for built-in and parametric specs."""
    if spec.startswith("hf:"):
        return spec[3:]
    if spec.partition(":")[0].endswith(".py"):
        return spec.rpartition(":")[0]
    return None


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(type(value), repr(value))


# The prediction's scalars that `train`, `report` and `compare` read back (`Prediction.to_json`).
PREDICTION_NUMBERS = ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hw_tflops_per_gpu", "mfu",
                      "peak_memory_bytes", "bubble_fraction")


def _prediction(data: dict) -> dict | None:
    """The plan's prediction: null, or an object whose scalars, where present, are finite
    non-negative numbers (a hand-edited null or string there would surface far from its cause)."""
    prediction = data.get("prediction")
    if prediction is None:
        return None
    if not isinstance(prediction, dict):
        raise ValueError(f"plan field 'prediction' must be an object or null, got {_kind(prediction)}")
    for key in PREDICTION_NUMBERS:
        value = prediction.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"plan field prediction.{key} must be a non-negative number, got {value!r}; "
                             "re-plan, or delete the prediction to run the plan as it is")
    return prediction


def _table(data: dict, key: str, where: str = "") -> dict:
    value = data[key]
    if not isinstance(value, dict):
        raise ValueError(f"plan field {where}{key!r} must be an object, got {_kind(value)}")
    return value


def _integer(data: dict, key: str, where: str = "", default: int | None = None) -> int:
    """An integer field; a float, string or boolean is refused instead of being truncated."""
    value = data[key] if default is None else data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"plan field {where}{key} must be an integer, got {value!r}")
    return value


def _cp_method(data: dict) -> str:
    """plan.json's `cp_method` (absent: the first method, as plans written before it ran)."""
    value = data.get("cp_method", DEFAULT_CP_METHOD)
    if value not in CP_METHODS:
        raise ValueError(f"plan field cp_method must be one of {', '.join(CP_METHODS)}, got {value!r}")
    return value


def _names(data: dict, key: str) -> list[str]:
    """A list of names (absent: none); ParallelConfig checks the names themselves."""
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise ValueError(f"plan field {key} must be a list of names, got {value!r}")
    return value


def _boolean(data: dict, key: str, default: bool | None = None) -> bool:
    value = data[key] if default is None else data.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"plan field {key} must be true or false, got {value!r}")
    return value


def _build(cls, item: Any, where: str):
    """A dataclass from a JSON object, naming unknown fields instead of a bare TypeError."""
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object, got {_kind(item)}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(item) - set(known))
    if unknown:
        raise ValueError(f"{where} has unknown field {unknown[0]!r}; known: {', '.join(known)}")
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in item]
    if missing:
        raise ValueError(f"{where} is missing the field {missing[0]!r}")
    return cls(**item)


def _layers(items: Any) -> tuple[LayerAssignment, ...]:
    if not isinstance(items, list):
        raise ValueError(f"plan field 'layers' must be a list of layer objects, got {_kind(items)}")
    return tuple(_build(LayerAssignment, item, f"layers[{index}]") for index, item in enumerate(items))


def load_plan(path: str | Path) -> Plan:
    from meshplan.planner.contracts.jsonfile import read_json_file

    path = Path(path)
    data = read_json_file(path, "plan", "create a plan with `meshplan plan --out plan.json`")
    try:
        return plan_from_json(data)
    except ValueError as exc:
        raise MeshplanError(f"{path}: {exc}") from None


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write the plan JSON atomically (a reader never sees half a plan; a failed write keeps the old one)."""
    from meshplan.planner.contracts.atomicfile import write_text_atomic

    write_text_atomic(path, json.dumps(plan.to_json(), indent=2, sort_keys=False) + "\n", "plan")


def check_plan_matches_model(plan: Plan, layer_names: list[str]) -> None:
    """Refuse a plan whose layers are not exactly the model's layers, in order."""
    planned = [layer.name for layer in plan.layers]
    if planned == layer_names:
        return
    missing = [n for n in layer_names if n not in planned]
    extra = [n for n in planned if n not in layer_names]
    if missing:
        raise MeshplanError(f"plan does not place layer(s) {missing[:5]} of model {plan.model.spec!r}")
    if extra:
        raise MeshplanError(f"plan places layer(s) {extra[:5]} that model {plan.model.spec!r} does not have")
    raise MeshplanError(f"plan lists the layers of {plan.model.spec!r} out of execution order")
