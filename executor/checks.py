"""Every check `train` makes before a process starts: the plan is one the executor runs as planned
(the one executability rule, `planner.costing.executable`, on the model as built; file models'
loss and inputs), and the request around it is sound (process count, precision on this device,
timeouts, output file, room for checkpoints)."""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.plan import Plan, check_plan_matches_model
from meshplan.planner.costing.executable import (LAYERWISE, WHOLE_MODEL_FAMILIES, built_model_facts, dispatcher_problem,
                                                 whole_model_problem, why_not_executable)

def check_plan_runnable(plan: Plan, world_size: int) -> None:
    """Raise MeshplanError naming what is unsupported and what would work: the plan's own verdict
    (`Plan.not_executable_reason`), the process count, the device's precision, the model, and
    the executability rule (`costing.executable.why_not_executable`) on the model as built."""
    cfg = plan.config
    if not plan.executable:
        reason = plan.not_executable_reason or LAYERWISE
        raise MeshplanError(f"this plan is not executable: {reason}")
    if world_size != cfg.gpus:
        raise MeshplanError(f"the plan needs {cfg.gpus} processes (pp {cfg.pp} x dp {cfg.dp}"
                            f"{f' x cp {cfg.cp}' if cfg.cp > 1 else ''} x tp {cfg.tp}) but "
                            f"{world_size} were asked for; use --nproc {cfg.gpus}"
                            + (f" or re-plan with --gpus {world_size}" if world_size > 0 else ""))
    check_precision_runnable(cfg.precision)
    from meshplan.planner.models.plan_check import model_changed

    changed = model_changed(plan)
    if changed:
        raise MeshplanError(changed)
    from meshplan.planner.models.registry import build_model

    built = build_model(plan.model.spec, plan.model.seq, tp=cfg.tp, device="meta")
    check_plan_matches_model(plan, [name for name, _, _ in built.layer_modules])
    reason = (why_not_executable(cfg, built_model_facts(built, plan.model.spec, plan.model.seq),
                                 [(layer.tp, layer.dp) for layer in plan.layers])
              or dispatcher_problem(cfg, plan.model.moe_dispatcher))
    if reason:
        raise MeshplanError(f"this plan is not executable: {reason}")
    if built.config is None:
        check_file_plan(plan, built)


def check_precision_runnable(precision: str, device: str | None = None) -> None:
    """FP8 plans are planned, not executed: refuse them naming the device. `device`: what the
    workers would run on (default: this machine's first CUDA device, else cpu)."""
    from meshplan.planner.costing.fp8 import is_fp8

    if not is_fp8(precision):
        return
    device = device or _device_description()
    if device == "cpu" or "compute capability" in device and _capability(device) < (8, 9):
        raise MeshplanError(f"FP8 plans need a GPU with FP8 tensor cores (compute capability >= 8.9) and torchao; "
                            f"this device is {device}")
    raise MeshplanError(f"meshplan's executor does not run FP8 plans yet (FP8 Linears are planned, not executed); "
                        f"this device is {device}: re-plan with --precision bf16-mixed to train")


def _device_description() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability(0)
    return f"{torch.cuda.get_device_name(0)} (compute capability {major}.{minor})"


def _capability(device: str) -> tuple[int, int]:
    major, minor = device.rsplit("compute capability ", 1)[1].rstrip(")").split(".")
    return int(major), int(minor)


def check_file_plan(plan, built) -> None:
    """Refuse a file or Hugging Face model the executor cannot train, or a file-model plan with
    more than data parallelism (one line naming the fix)."""
    import torch

    spec = plan.model.spec
    if built.loss_fn is None:
        path = spec.rpartition(":")[0]
        raise MeshplanError(f"{spec!r} has no loss function: define loss_fn(output, inputs) in {path} to train it")
    problem = whole_model_problem(plan.config) if built.info.family in WHOLE_MODEL_FAMILIES else None
    if problem:
        raise MeshplanError(problem)
    if not all(isinstance(x, torch.Tensor) for x in built.example_inputs):
        raise MeshplanError(f"{spec!r}: the executor feeds tensor inputs only; make every example input a tensor")


def check_file_data(data: str) -> None:
    if data != "synthetic":
        raise MeshplanError(f"--data {data}: file models train on synthetic batches shaped like their example "
                            "inputs; use --data synthetic")



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


def check_checkpoint_dir(directory: str | Path, one_checkpoint_bytes: int, num_saves: int) -> None:
    """The directory can be created and written, and its file system holds one checkpoint
    (`executor.checkpoint.estimated_size_bytes`)."""
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

