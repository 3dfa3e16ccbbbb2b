"""The Plan: the JSON document the planner writes and the executor, simulator and reports read.

Layer placement. Layers are cut into `pp * virtual_stages` contiguous chunks in execution order.
Chunk j runs on pipeline rank `j % pp` as its virtual stage `j // pp` (Megatron-LM's
interleaving); without interleaving chunk j is simply stage j. Each layer records its `stage`
(pipeline rank) and `virtual_stage`, so `chunk_index = virtual_stage * pp + stage` must be
non-decreasing along the layers, and every chunk non-empty.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from planner.config import RECOMPUTE, ParallelConfig
from planner.errors import MeshplanError
from planner.hardware import ClusterProfile, cluster_from_dict

PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ModelRef:
    """What model the plan is for: enough to rebuild and re-profile it."""

    spec: str
    seq: int
    dtype: str = "bf16"
    attention: str = "flash"

    def __post_init__(self):
        if self.seq <= 0:
            raise ValueError(f"model.seq must be positive, got {self.seq}")


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

    def __post_init__(self):
        cfg = self.config
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

    def chunk_of(self, layer: LayerAssignment) -> int:
        return layer.virtual_stage * self.config.pp + layer.stage

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
                if k in ("schema_version", "seed", "precision", "model", "mesh", "zero", "sp",
                         "schedule", "global_batch")}
        core["layers"] = [{k: layer[k] for k in ("name", "stage", "virtual_stage", "tp", "dp", "recompute")}
                          for layer in self.to_json()["layers"]]
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "schema_version": self.schema_version,
            "seed": self.seed,
            "precision": cfg.precision,
            "model": asdict(self.model),
            "cluster": {"profile": self.cluster.name, "gpus": cfg.gpus, "embedded": self.cluster.to_dict()},
            "global_batch": cfg.global_batch,
            "mesh": {"pp": cfg.pp, "dp": cfg.dp, "tp": cfg.tp},
            "zero": cfg.zero,
            "sp": cfg.sp,
            "recompute": cfg.recompute,
            "schedule": {"name": cfg.schedule, "microbatches": cfg.num_microbatches,
                         "microbatch_size": cfg.microbatch_size, "virtual_stages": cfg.virtual_stages},
            "executable": self.executable,
            "not_executable_reason": self.not_executable_reason,
            "layers": [asdict(layer) for layer in self.layers],
            "prediction": self.prediction,
            "alternatives": list(self.alternatives),
            "solver": self.solver,
        }

    def with_prediction(self, prediction: dict[str, Any]) -> "Plan":
        return replace(self, prediction=prediction)


def plan_from_json(data: dict[str, Any]) -> Plan:
    """Build and validate a Plan from its JSON document."""
    if not isinstance(data, dict):
        raise ValueError("a plan must be a JSON object")
    version = data.get("schema_version")
    if version != PLAN_SCHEMA_VERSION:
        raise ValueError(f"plan schema_version is {version!r}; this meshplan reads version {PLAN_SCHEMA_VERSION}. "
                         "Re-create the plan with `meshplan plan`")
    try:
        schedule = data["schedule"]
        mesh = data["mesh"]
        cluster = cluster_from_dict(data["cluster"]["embedded"])
        gpus = int(data["cluster"]["gpus"])
        config = ParallelConfig(
            gpus=gpus, global_batch=int(data["global_batch"]), tp=int(mesh["tp"]), pp=int(mesh["pp"]),
            dp=int(mesh["dp"]), microbatch_size=int(schedule["microbatch_size"]), zero=int(data["zero"]),
            recompute=data.get("recompute", "none"), sp=bool(data["sp"]), schedule=schedule["name"],
            virtual_stages=int(schedule["virtual_stages"]), precision=data["precision"])
        if int(schedule["microbatches"]) != config.num_microbatches:
            raise ValueError(f"schedule.microbatches is {schedule['microbatches']} but global_batch / (dp * "
                             f"microbatch_size) = {config.num_microbatches}")
        layers = tuple(LayerAssignment(**layer) for layer in data["layers"])
        return Plan(model=ModelRef(**data["model"]), cluster=cluster, config=config, layers=layers,
                    prediction=data.get("prediction"), alternatives=tuple(data.get("alternatives") or ()),
                    seed=int(data.get("seed", 0)), executable=bool(data.get("executable", True)),
                    not_executable_reason=data.get("not_executable_reason", ""),
                    solver=data.get("solver") or {}, schema_version=version)
    except KeyError as exc:
        raise ValueError(f"plan is missing the field {exc.args[0]!r}") from None
    except TypeError as exc:
        raise ValueError(f"plan has a malformed entry: {exc}") from None


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.exists():
        raise MeshplanError(f"plan file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MeshplanError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                            "create a plan with `meshplan plan --out plan.json`") from None
    try:
        return plan_from_json(data)
    except ValueError as exc:
        raise MeshplanError(f"{path}: {exc}") from None


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(plan.to_json(), indent=2, sort_keys=False) + "\n")


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
