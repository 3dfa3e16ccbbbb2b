"""Predicted vs measured: load `measured.json` files and compare them with a plan's prediction.

A measured file (written by `meshplan train`) holds `world_size`, `plan_digest`, `step_times_s`
(every step, warm-up included; the slowest rank's wall time), `warmup_steps` (how many
leading steps to ignore),
`peak_memory_bytes_per_rank` (indexed by global rank), `losses`, `tokens_per_s`, plus host and
versions. Global ranks follow the mesh order (pp, dp, tp) with tp innermost, so global rank r sits
on pipeline rank r // (dp * tp).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from meshplan.planner.contracts.errors import MeshplanError

# Above this relative error of the median step time (or of a rank's peak memory) the report
# flags the prediction as off (the acceptance threshold).
DEFAULT_FLAG_FRACTION = 0.15


@dataclass(frozen=True)
class Measurement:
    """One `meshplan train` run of a plan."""

    source: str  # file name the run was read from (shown escaped)
    world_size: int
    plan_digest: str
    step_times_s: tuple[float, ...]
    warmup_steps: int
    peak_memory_bytes_per_rank: tuple[float, ...]
    losses: tuple[float, ...] = ()
    tokens_per_s: float = 0.0
    host: Any = ""
    versions: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.world_size <= 0:
            raise ValueError(f"{self.source}: world_size must be positive, got {self.world_size}")
        if self.warmup_steps < 0:
            raise ValueError(f"{self.source}: warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.step_times_s:
            raise ValueError(f"{self.source}: no step times; train at least one step (meshplan train --steps N)")
        if len(self.step_times_s) < self.warmup_steps:
            raise ValueError(f"{self.source}: {len(self.step_times_s)} step time(s) but {self.warmup_steps} "
                             "warm-up step(s); train more steps (meshplan train --steps N)")
        if any(t <= 0 for t in self.step_times_s):
            raise ValueError(f"{self.source}: step_times_s must all be positive")
        if self.peak_memory_bytes_per_rank and len(self.peak_memory_bytes_per_rank) != self.world_size:
            raise ValueError(f"{self.source}: {len(self.peak_memory_bytes_per_rank)} peak memory value(s) for "
                             f"world_size {self.world_size}")

    @property
    def timed_steps_s(self) -> tuple[float, ...]:
        """Step times after warm-up (all of them if every step was warm-up, as `meshplan train` does)."""
        return self.step_times_s[self.warmup_steps:] or self.step_times_s

    @property
    def median_step_time_s(self) -> float:
        return statistics.median(self.timed_steps_s)


def _check_field_types(data: dict[str, Any], source: str) -> None:
    """JSON types as `meshplan train` writes them: a text world size or a null loss list is a
    broken file, not something to coerce."""
    if "world_size" in data and (not isinstance(data["world_size"], int) or isinstance(data["world_size"], bool)):
        raise ValueError(f"{source}: world_size must be a whole number, got {data['world_size']!r}")
    for key in ("step_times_s", "losses", "peak_memory_bytes_per_rank"):
        if key in data and not isinstance(data[key], list):
            raise ValueError(f"{source}: {key} must be a list of numbers, got {data[key]!r}")
    for key in ("step_times_s", "losses", "peak_memory_bytes_per_rank"):
        for value in data.get(key) or ():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{source}: {key} must hold finite numbers, found {value!r}")
    tokens = data.get("tokens_per_s", 0.0)
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not 0 <= tokens < math.inf:
        raise ValueError(f"{source}: tokens_per_s must be a finite number >= 0, got {tokens!r}")


def measurement_from_json(data: dict[str, Any], source: str) -> Measurement:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a measured file must be a JSON object")
    _check_field_types(data, source)
    try:
        return Measurement(
            source=source, world_size=int(data["world_size"]), plan_digest=str(data.get("plan_digest", "")),
            step_times_s=tuple(float(t) for t in data["step_times_s"]),
            warmup_steps=int(data.get("warmup_steps", 0)),
            peak_memory_bytes_per_rank=tuple(float(b) for b in data.get("peak_memory_bytes_per_rank") or ()),
            losses=tuple(float(x) for x in data.get("losses") or ()),
            tokens_per_s=float(data.get("tokens_per_s") or 0.0), host=data.get("host", ""),
            versions=dict(data.get("versions") or {}))
    except KeyError as exc:
        raise ValueError(f"{source}: measured file is missing the field {exc.args[0]!r}; "
                         "write it with `meshplan train --out measured.json`") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ValueError) and str(exc).startswith(source):
            raise
        raise ValueError(f"{source}: malformed measured file ({exc})") from None


def load_measurement(path: str | Path) -> Measurement:
    from meshplan.planner.contracts.jsonfile import read_json_file

    path = Path(path)
    data = read_json_file(path, "measured", f"write one with `meshplan train --out {path}`")
    try:
        return measurement_from_json(data, path.name)
    except ValueError as exc:
        raise MeshplanError(str(exc)) from None


@dataclass(frozen=True)
class RankMemory:
    """Predicted vs measured peak memory of one global rank."""

    rank: int
    pipeline_rank: int
    predicted_bytes: float
    measured_bytes: float

    @property
    def error_fraction(self) -> float:
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


@dataclass(frozen=True)
class Comparison:
    """Predicted vs measured over one or more runs of the same plan."""

    predicted_step_time_s: float
    measured_median_s: float  # median over all runs' timed steps
    measured_min_s: float
    measured_max_s: float
    measured_stdev_s: float
    per_run_median_s: tuple[float, ...]
    memory: tuple[RankMemory, ...]
    flag_fraction: float = DEFAULT_FLAG_FRACTION

    @property
    def error_fraction(self) -> float:
        """(predicted - measured) / measured: positive means the prediction is pessimistic."""
        return (self.predicted_step_time_s - self.measured_median_s) / self.measured_median_s

    @property
    def flagged(self) -> bool:
        return abs(self.error_fraction) > self.flag_fraction

    def memory_flagged(self, rank_memory: RankMemory) -> bool:
        return abs(rank_memory.error_fraction) > self.flag_fraction


def check_measurements(plan, measurements: Sequence[Measurement]) -> None:
    """Refuse runs of another plan or another world size: their comparison would mean nothing."""
    for run in measurements:
        if run.world_size != plan.config.gpus:
            raise MeshplanError(f"{run.source} was measured on {run.world_size} process(es) but the plan is for "
                                f"{plan.config.gpus}; pass the measured file of this plan")
        if run.plan_digest and run.plan_digest != plan.digest:
            raise MeshplanError(f"{run.source} was measured for plan {run.plan_digest} but this plan is "
                                f"{plan.digest}; retrain it with `meshplan train --plan` on this plan file")


def compare(plan, measurements: Sequence[Measurement],
            flag_fraction: float = DEFAULT_FLAG_FRACTION) -> Comparison:
    """Compare a plan's prediction with its measured runs."""
    if not measurements:
        raise ValueError("compare needs at least one measurement")
    check_measurements(plan, measurements)
    prediction = plan.prediction or {}
    predicted = float(prediction["step_time_s"])
    steps = [t for run in measurements for t in run.timed_steps_s]
    predicted_per_pp = [float(m["total"]) for m in prediction.get("memory_bytes") or ()]
    ranks_per_stage = plan.config.dp * plan.config.tp
    memory = []
    # The last run's memory: peak memory is deterministic across runs of one plan, the step time is not.
    last = measurements[-1]
    for rank, measured in enumerate(last.peak_memory_bytes_per_rank):
        pipeline_rank = rank // ranks_per_stage
        if pipeline_rank < len(predicted_per_pp) and measured > 0:
            memory.append(RankMemory(rank, pipeline_rank, predicted_per_pp[pipeline_rank], measured))
    return Comparison(
        predicted_step_time_s=predicted, measured_median_s=statistics.median(steps),
        measured_min_s=min(steps), measured_max_s=max(steps),
        measured_stdev_s=statistics.stdev(steps) if len(steps) > 1 else 0.0,
        per_run_median_s=tuple(run.median_step_time_s for run in measurements),
        memory=tuple(memory), flag_fraction=flag_fraction)
