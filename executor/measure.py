"""`Measurement`: what one training run did, written as measured.json."""
from __future__ import annotations

import json
import platform
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MEASUREMENT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Measurement:
    """Per-step figures of a run; list index i is optimizer step i + 1.

    `step_times_s` are the slowest rank's wall time of each step (ranks agree after every step);
    steps before `warmup_steps` include one-off costs (allocation, first collectives) and are
    left out of `tokens_per_s`. `peak_memory_bytes_per_rank` is CUDA max allocated on GPUs and the
    peak of live tensor bytes on CPU (not RSS), both in bytes.
    """

    world_size: int
    plan_digest: str
    step_times_s: tuple[float, ...]
    warmup_steps: int
    peak_memory_bytes_per_rank: tuple[int, ...]
    losses: tuple[float, ...]
    tokens_per_s: float
    tokens_per_step: int
    memory_source: str
    precision: str
    backend: str
    device: str
    resumed_from_step: int = 0
    host: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    stopped: str = ""  # why the run stopped before its last step (non-finite loss); "" when it finished
    schema_version: int = MEASUREMENT_SCHEMA_VERSION

    def __post_init__(self):
        if len(self.losses) != len(self.step_times_s):
            raise ValueError(f"{len(self.losses)} losses but {len(self.step_times_s)} step times")
        if len(self.peak_memory_bytes_per_rank) != self.world_size:
            raise ValueError(f"{len(self.peak_memory_bytes_per_rank)} memory figures for world size "
                             f"{self.world_size}")
        if not 0 <= self.warmup_steps <= len(self.step_times_s):
            raise ValueError(f"warmup_steps {self.warmup_steps} outside 0..{len(self.step_times_s)}")

    @property
    def mean_step_time_s(self) -> float:
        timed = self.step_times_s[self.warmup_steps:] or self.step_times_s
        return sum(timed) / len(timed)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["mean_step_time_s"] = self.mean_step_time_s
        return data


def tokens_per_s(step_times_s: list[float], warmup_steps: int, tokens_per_step: int) -> float:
    timed = step_times_s[warmup_steps:] or step_times_s
    return tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else 0.0


def host_info() -> dict[str, Any]:
    import os

    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "cpu_count": os.cpu_count() or 0,
            "processor": platform.processor() or platform.machine()}


def software_versions() -> dict[str, str]:
    import torch

    versions = {"torch": torch.__version__, "meshplan": _meshplan_version()}
    if torch.cuda.is_available():
        versions["cuda"] = str(torch.version.cuda)
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return versions


def _meshplan_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshplan")
    except PackageNotFoundError:
        return "unknown"


def save_measurement(measurement: Measurement, path: str | Path) -> None:
    Path(path).write_text(json.dumps(measurement.to_json(), indent=2) + "\n")


def load_measurement(path: str | Path) -> Measurement:
    data = json.loads(Path(path).read_text())
    data.pop("mean_step_time_s", None)
    for key in ("step_times_s", "peak_memory_bytes_per_rank", "losses"):
        data[key] = tuple(data[key])
    return Measurement(**data)
