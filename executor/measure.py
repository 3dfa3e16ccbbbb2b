"""What a training run records beside its step figures: tokens per second, host and versions.
The `Measurement` schema itself is a contract (`planner.contracts.measurement`)."""
from __future__ import annotations

import platform
import socket
from typing import Any

def tokens_per_s(step_times_s: list[float], warmup_steps: int, tokens_per_step: int) -> float:
    timed = step_times_s[warmup_steps:] or step_times_s
    return tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else 0.0


def host_info() -> dict[str, Any]:
    import os

    out = {"hostname": socket.gethostname(), "platform": platform.platform(),
           "python": platform.python_version(), "cpu_count": os.cpu_count() or 0,
           "processor": platform.processor() or platform.machine()}
    if hasattr(os, "getloadavg"):  # the last minute's load, at the end of the run: was the host busy?
        out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    import torch

    # the clock of the steps (wall) and each process's threads, to hold against the calibration's
    out["threads_per_process"] = torch.get_num_threads()
    out["clock"] = "wall"
    return out


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
