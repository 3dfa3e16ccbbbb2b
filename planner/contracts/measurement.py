"""`Measurement`: what one `meshplan train` run did, as written to and read from measured.json.

The executor writes it; the report reads it (and compares it with the plan's prediction). One
schema, one loader. Global ranks follow the mesh order (pp, dp, tp) with tp innermost, so global
rank r sits on pipeline rank r // (dp * tp).
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.jsonfile import read_json_file

MEASUREMENT_SCHEMA_VERSION = 1
_REQUIRED = ("world_size", "step_times_s")
_NUMBER_LISTS = ("step_times_s", "losses", "peak_memory_bytes_per_rank")


@dataclass(frozen=True)
class Measurement:
    """Per-step figures of a run; list index i is optimizer step i + 1.

    `step_times_s` are the slowest rank's wall time of each step (ranks agree after every step);
    the first `warmup_steps` include one-off costs (allocation, first collectives) and are left out
    of `tokens_per_s` and of the timed steps. `peak_memory_bytes_per_rank` (by global rank) is CUDA
    max allocated on GPUs and the peak of live tensor bytes on CPU (not RSS). `source` is the file
    the run was read from ("" for a run made in this process); it is not written.
    """

    world_size: int
    plan_digest: str
    step_times_s: tuple[float, ...]
    warmup_steps: int
    peak_memory_bytes_per_rank: tuple[float, ...]
    losses: tuple[float, ...] = ()
    tokens_per_s: float = 0.0
    tokens_per_step: int = 0
    memory_source: str = ""
    precision: str = ""
    backend: str = ""
    device: str = ""
    resumed_from_step: int = 0
    host: Any = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    stopped: str = ""  # why the run stopped before its last step (non-finite loss); "" when it finished
    schema_version: int = MEASUREMENT_SCHEMA_VERSION
    source: str = field(default="", compare=False)

    def __post_init__(self):
        where = f"{self.source}: " if self.source else ""
        if self.world_size <= 0:
            raise ValueError(f"{where}world_size must be positive, got {self.world_size}")
        if not 0 <= self.warmup_steps <= max(len(self.step_times_s), 0):
            raise ValueError(f"{where}{len(self.step_times_s)} step time(s) but {self.warmup_steps} warm-up step(s); "
                             "train more steps (meshplan train --steps N)")
        if any(t <= 0 for t in self.step_times_s):
            raise ValueError(f"{where}step_times_s must all be positive")
        if self.losses and len(self.losses) != len(self.step_times_s):
            raise ValueError(f"{where}{len(self.losses)} losses but {len(self.step_times_s)} step times")
        if self.peak_memory_bytes_per_rank and len(self.peak_memory_bytes_per_rank) != self.world_size:
            raise ValueError(f"{where}{len(self.peak_memory_bytes_per_rank)} peak memory value(s) for "
                             f"world_size {self.world_size}")

    @property
    def timed_steps_s(self) -> tuple[float, ...]:
        """Step times after warm-up (all of them if every step was warm-up)."""
        return self.step_times_s[self.warmup_steps:] or self.step_times_s

    @property
    def mean_step_time_s(self) -> float:
        timed = self.timed_steps_s
        return sum(timed) / len(timed) if timed else 0.0

    @property
    def median_step_time_s(self) -> float:
        return statistics.median(self.timed_steps_s)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["source"]
        data["mean_step_time_s"] = self.mean_step_time_s
        return data


def _check_field_types(data: dict[str, Any], source: str) -> None:
    """JSON types as `meshplan train` writes them: a text world size or a null loss list is a
    broken file, not something to coerce."""
    if "world_size" in data and (not isinstance(data["world_size"], int) or isinstance(data["world_size"], bool)):
        raise ValueError(f"{source}: world_size must be a whole number, got {data['world_size']!r}")
    for key in _NUMBER_LISTS:
        if key in data and not isinstance(data[key], list):
            raise ValueError(f"{source}: {key} must be a list of numbers, got {data[key]!r}")
    for key in _NUMBER_LISTS:
        for value in data.get(key) or ():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{source}: {key} must hold finite numbers, found {value!r}")
    tokens = data.get("tokens_per_s", 0.0)
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not 0 <= tokens < math.inf:
        raise ValueError(f"{source}: tokens_per_s must be a finite number >= 0, got {tokens!r}")


def measurement_from_json(data: dict[str, Any], source: str) -> Measurement:
    """A Measurement from a measured.json object; ValueError naming `source` and the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a measured file must be a JSON object")
    _check_field_types(data, source)
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise ValueError(f"{source}: measured file is missing the field {missing[0]!r}; "
                         "write it with `meshplan train --out measured.json`")
    known = {f.name for f in fields(Measurement)} - {"source"}
    values = {key: value for key, value in data.items() if key in known}  # mean_step_time_s is derived
    for key in _NUMBER_LISTS:
        values[key] = tuple(float(x) for x in values.get(key) or ())
    values["peak_memory_bytes_per_rank"] = tuple(
        int(b) if float(b).is_integer() else b for b in values["peak_memory_bytes_per_rank"])
    values.setdefault("plan_digest", "")
    values.setdefault("warmup_steps", 0)
    try:
        return Measurement(**values, source=source)
    except ValueError as exc:
        if str(exc).startswith(source):
            raise
        raise ValueError(f"{source}: malformed measured file ({exc})") from None
    except TypeError as exc:
        raise ValueError(f"{source}: malformed measured file ({exc})") from None


def load_measurement(path: str | Path) -> Measurement:
    """Read a measured.json file (MeshplanError naming the file and what is wrong)."""
    path = Path(path)
    data = read_json_file(path, "measured", f"write one with `meshplan train --out {path}`")
    try:
        return measurement_from_json(data, path.name)
    except ValueError as exc:
        raise MeshplanError(str(exc)) from None


def save_measurement(measurement: Measurement, path: str | Path) -> None:
    from meshplan.planner.contracts.atomicfile import write_text_atomic

    write_text_atomic(path, json.dumps(measurement.to_json(), indent=2) + "\n", "measurement")
