"""Checks of a `meshplan train` request that need no worker: refuse it before anything launches.

The process count, the timeout, where measured.json goes, and whether the checkpoint directory
can be created, written, and hold at least one checkpoint.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

from meshplan.planner.contracts.errors import MeshplanError

# DCP stores fp32 weights and AdamW's two fp32 moments (both precisions keep fp32 masters).
CHECKPOINT_BYTES_PER_PARAM = 4 + 4 + 4


def check_nproc(nproc: int, plan_gpus: int) -> None:
    if nproc < 1:
        raise MeshplanError(f"--nproc must be at least 1, got {nproc}; this plan needs --nproc {plan_gpus}")


def check_timeout(timeout_s: float | None, option: str = "--timeout-s") -> None:
    if timeout_s is not None and not 0 < timeout_s < math.inf:
        raise MeshplanError(f"{option} must be a positive number of seconds, got {timeout_s}")


def check_output_file(out: str | Path) -> None:
    """measured.json goes into an existing, writable directory and is not a directory itself."""
    path = Path(out)
    parent = path.resolve().parent
    if path.is_dir():
        raise MeshplanError(f"--out {out} is a directory; give a file name such as {path / 'measured.json'}")
    if not parent.is_dir():
        raise MeshplanError(f"--out {out}: directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise MeshplanError(f"--out {out}: directory {parent} is not writable; choose another path")


def checkpoint_size_bytes(num_params: int) -> int:
    """Estimate of one checkpoint on disk: weights and optimizer moments (metadata is small)."""
    return num_params * CHECKPOINT_BYTES_PER_PARAM


def check_checkpoint_dir(directory: str | Path, one_checkpoint_bytes: int, num_saves: int) -> None:
    """The directory can be created and written, and its file system holds one checkpoint."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".meshplan-write-test-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise MeshplanError(f"--checkpoint-dir {directory} cannot be created or written ({reason}); "
                            "choose a writable directory") from None
    free_bytes = shutil.disk_usage(path).free
    if free_bytes < one_checkpoint_bytes:
        raise MeshplanError(f"--checkpoint-dir {directory} has {free_bytes / 2**20:.1f} MiB free but one checkpoint "
                            f"needs about {one_checkpoint_bytes / 2**20:.1f} MiB ({num_saves} planned); free space "
                            "or choose another directory")


def count_parameters(spec: str, seq: int) -> int:
    """Parameters of the whole model (a tied embedding counted once), built on the meta device."""
    from meshplan.planner.models.registry import build_model

    module = build_model(spec, seq, device="meta").module
    return sum(param.numel() for param in module.parameters())
