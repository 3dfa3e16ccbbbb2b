"""Fault injection for meshplan's own reliability tests: `MESHPLAN_FAULT=kind:key=value,...`.

Unset (the normal case) nothing here does anything. Each fault fires only in the first attempt of
a launch (torchrun restarts run clean), on the given rank (every rank when `rank` is omitted),
at the given 1-based optimizer step:

- `hang:rank=R,step=K`: rank R sleeps forever before step K (a stuck worker);
- `nan:rank=R,step=K`: rank R's first parameter becomes NaN before step K (a diverging run);
- `nan_in_save:rank=R,step=K`: rank R's first parameter becomes NaN just before checkpoint
  step_K is written (a state that went bad after a finite loss);
- `kill_in_save:rank=R,step=K`: rank R SIGKILLs itself inside the save of checkpoint step_K,
  after writing its shards and before the COMPLETE marker;
- `enospc_in_save:step=K`: writing the shards of checkpoint step_K fails with ENOSPC, through
  torch.distributed.checkpoint's own storage writer, as a full disk would.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

ENV = "MESHPLAN_FAULT"
KINDS = ("hang", "nan", "nan_in_save", "kill_in_save", "enospc_in_save")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {self.kind!r}; known: {', '.join(KINDS)}")
        if self.step < 1:
            raise ValueError(f"{ENV}: step must be >= 1, got {self.step}")


def parse_fault(text: str) -> Fault:
    kind, _, rest = text.partition(":")
    values = dict(item.split("=", 1) for item in rest.split(",") if item)
    unknown = set(values) - {"rank", "step"}
    if unknown or "step" not in values:
        raise ValueError(f"{ENV}={text!r}: expected kind:step=K[,rank=R]")
    rank = int(values["rank"]) if "rank" in values else None
    return Fault(kind=kind.strip(), step=int(values["step"]), rank=rank)


def active(kind: str, rank: int, step: int) -> bool:
    """True when the environment asks for fault `kind` on `rank` at 1-based `step` in this attempt."""
    text = os.environ.get(ENV)
    if not text or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return False
    fault = parse_fault(text)
    return fault.kind == kind and fault.step == step and fault.rank in (None, rank)


def before_step(runtime, rank: int, step: int) -> None:
    """The hang and NaN faults, injected before 1-based step `step` runs."""
    if active("hang", rank, step):
        while True:  # stuck for good: only a signal ends it
            time.sleep(3600)
    if active("nan", rank, step):
        _poison(runtime)


def before_save(runtime, rank: int, step: int) -> None:
    """The NaN-in-save fault: the state of checkpoint step_K turns NaN before it is written."""
    if active("nan_in_save", rank, step):
        _poison(runtime)


def _poison(runtime) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    param = next(runtime.parameters())
    with torch.no_grad():
        (param.to_local() if isinstance(param, DTensor) else param).fill_(float("nan"))


def inside_save(rank: int, step: int) -> None:
    """The kill-during-save fault: this rank's shards are written, the marker is not."""
    if active("kill_in_save", rank, step):
        os.kill(os.getpid(), signal.SIGKILL)


def storage_writer(path: str, rank: int, step: int):
    """DCP's file writer, or one whose writes fail with ENOSPC when that fault is asked for."""
    from torch.distributed.checkpoint import FileSystemWriter

    if not active("enospc_in_save", rank, step):
        return FileSystemWriter(path)

    class FullDiskWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    return FullDiskWriter(path)
