"""Every check `train` makes before a process starts: the plan is one the executor runs as planned
(mesh, model, file models), and the request around it is sound (process count, timeouts, output
file, room for checkpoints)."""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.plan import Plan, check_plan_matches_model
from meshplan.planner.costing.state_memory import executed_zero

def check_plan_runnable(plan: Plan, world_size: int) -> None:
    """Raise MeshplanError naming what is unsupported and what would work."""
    cfg = plan.config
    if not plan.executable:
        reason = f" ({plan.not_executable_reason})" if plan.not_executable_reason else ""
        raise MeshplanError(f"this plan is not executable{reason}: it uses per-layer degrees outside the executor's "
                            "space; re-plan without --layerwise")
    if world_size != cfg.gpus:
        raise MeshplanError(f"the plan needs {cfg.gpus} processes (pp {cfg.pp} x dp {cfg.dp}"
                            f"{f' x cp {cfg.cp}' if cfg.cp > 1 else ''} x tp {cfg.tp}) but "
                            f"{world_size} were asked for; use --nproc {cfg.gpus}"
                            + (f" or re-plan with --gpus {world_size}" if world_size > 0 else ""))
    if executed_zero(cfg.zero, cfg.data_ranks, cfg.pp, cfg.schedule) != cfg.zero:
        raise MeshplanError(f"ZeRO-{cfg.zero} with the {cfg.schedule} schedule (pp {cfg.pp}, dp {cfg.dp}) runs as "
                            "ZeRO-1: a split backward defers gradient sync and resharding to the step's end; "
                            "set zero to 1, or use the 1f1b or interleaved schedule (meshplan plan does not "
                            "offer this combination)")
    check_precision_runnable(cfg.precision)
    from meshplan.planner.models.plan_check import model_changed

    changed = model_changed(plan)
    if changed:
        raise MeshplanError(changed)
    from meshplan.planner.models.registry import build_model

    built = build_model(plan.model.spec, plan.model.seq, tp=cfg.tp, device="meta")
    if cfg.cp > 1:
        _check_cp(plan, built)
    if built.config is None:
        check_file_plan(plan, built)
        check_plan_matches_model(plan, [name for name, _, _ in built.layer_modules])
        return
    check_plan_matches_model(plan, [name for name, _, _ in built.layer_modules])
    _check_tp(plan, built.config)
    _check_ep(plan, built.config)


def _check_ep(plan: Plan, model_cfg) -> None:
    """Expert parallelism runs with data, context and pipeline parallelism and ZeRO 0-3; MoE blocks
    have no tensor-parallel layout in the executor."""
    cfg = plan.config
    if model_cfg.family == "moe" and cfg.tp > 1:
        raise MeshplanError(f"the executor trains mixture-of-experts models with tp=1 (this plan has tp={cfg.tp}): "
                            "its MoE blocks have no tensor-parallel layout; re-plan with --tp 1 (use ep instead)")
    if cfg.ep == 1:
        return
    if model_cfg.family != "moe":
        raise MeshplanError(f"ep={cfg.ep} splits routed experts, and {plan.model.spec!r} has none; re-plan with ep=1")
    if model_cfg.num_experts % cfg.ep:
        raise MeshplanError(f"ep={cfg.ep} must divide the model's {model_cfg.num_experts} experts; use an ep that "
                            "divides it")
    if cfg.shard_group:
        raise MeshplanError(f"the executor does not combine expert parallelism (ep={cfg.ep}) with HSDP "
                            f"(shard_group={cfg.shard_group}); re-plan without --shard-group")


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


def _check_cp(plan: Plan, built) -> None:
    if built.config is None:
        raise MeshplanError(f"context parallelism (cp {plan.config.cp}) needs a zoo transformer whose attention "
                            "meshplan can split over the sequence; file and Hugging Face models train with cp 1")
    if plan.model.seq % (2 * plan.config.cp):
        raise MeshplanError(f"cp {plan.config.cp} cuts each sequence into {2 * plan.config.cp} chunks; sequence "
                            f"length {plan.model.seq} is not divisible by {2 * plan.config.cp}")


def _check_tp(plan: Plan, model_cfg) -> None:
    tp = plan.config.tp
    if tp == 1:
        return
    for what, value in (("attention heads", model_cfg.num_heads), ("key/value heads", model_cfg.kv_heads),
                        ("MLP width", model_cfg.ffn_dim)):
        if value % tp:
            raise MeshplanError(f"tp={tp} does not divide the model's {what} ({value}); use a tp that divides it")
    if plan.config.sp and plan.model.seq % tp:
        raise MeshplanError(f"sequence parallelism splits the sequence ({plan.model.seq} tokens) over tp={tp} "
                            f"ranks; use a sequence length divisible by {tp} or turn --sp off")


def check_file_plan(plan, built) -> None:
    """Refuse a file-model plan outside what the executor runs (one line naming the fix)."""
    import torch

    cfg, spec = plan.config, plan.model.spec
    if built.loss_fn is None:
        path = spec.rpartition(":")[0]
        raise MeshplanError(f"{spec!r} has no loss function: define loss_fn(output, inputs) in {path} to train it")
    if built.info.family == "hf":
        _check_hf_plan(plan, built)
    elif cfg.pp > 1 or cfg.tp > 1 or cfg.ep > 1:
        raise MeshplanError(f"file models train with data parallelism only, this plan has "
                            f"pp={cfg.pp} tp={cfg.tp}{f' ep={cfg.ep}' if cfg.ep > 1 else ''}; re-plan it "
                            "(meshplan plan keeps them at pp=1 tp=1)")
    if not all(isinstance(x, torch.Tensor) for x in built.example_inputs):
        raise MeshplanError(f"{spec!r}: the executor feeds tensor inputs only; make every example input a tensor")



def _check_hf_plan(plan, built) -> None:
    """Hugging Face models train with DP/ZeRO, TP over decoder layers of a known layout
    (`planner.models.hf_tp`) and PP cut at decoder layers; no SP, EP or CP."""
    cfg = plan.config
    if cfg.ep > 1:
        raise MeshplanError(f"Hugging Face models train without expert parallelism, this plan has ep={cfg.ep}; "
                            "re-plan it with --ep 1")
    if cfg.tp > 1 and cfg.sp:
        raise MeshplanError(f"sequence parallelism is not implemented for Hugging Face models (this plan has "
                            f"tp={cfg.tp} with sp); re-plan it without --sp")
    blocks = [group for group in built.layer_groups if group.kind == "block"]
    for group in blocks if cfg.tp > 1 else ():
        split = group.tp_split
        if split.kind == "none":
            raise MeshplanError(f"layer {group.name!r} cannot be split over tp={cfg.tp} ranks: {split.reason}; "
                                "re-plan it with --tp 1")
        if not split.max_degree_ok(cfg.tp):
            raise MeshplanError(f"tp={cfg.tp} does not divide layer {group.name!r}: {split.num_heads} heads, "
                                f"{split.num_kv_heads} K/V heads, MLP width {split.mlp_width}; use a tp that "
                                "divides them")
    if cfg.pp > 1:
        from meshplan.planner.models.hf import model_parts

        parts = model_parts(built.module, plan.model.spec)
        kept = (parts["layers"], parts["embed"], parts["norm"])
        glue = [name for name, child in built.module.base_model.named_children()
                if name not in kept and any(True for _ in child.parameters())]
        if glue:
            raise MeshplanError(f"{plan.model.spec!r} cannot be cut into pipeline stages: its base model has "
                                f"parameters outside the embedding, decoder layers and final norm "
                                f"({', '.join(glue)}); re-plan it with --pp 1")


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

