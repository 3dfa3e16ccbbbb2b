"""Distributed checkpoints with `torch.distributed.checkpoint` (DCP).

Layout: `DIR/step_N/` (N = completed optimizer steps) holds the sharded model and optimizer
state under their full-model parameter names (so a checkpoint loads into another layout), the
step, the loss history and each rank's RNG state; `DIR/step_N/COMPLETE` is written last, after
every rank has finished writing, so a crash mid-save never leaves a checkpoint that looks whole
(a marker left in `step_N/` by an earlier run is removed before the save starts). A failed write
(disk full, unwritable) raises `CheckpointSaveFailed` in one line; earlier checkpoints are never
touched.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

MARKER = "COMPLETE"


class CheckpointSaveFailed(RuntimeError):
    """Writing a checkpoint failed (disk full, unwritable); earlier checkpoints are untouched."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step}"


def newest_complete(directory: str | Path | None) -> tuple[int, Path] | None:
    """(step, path) of the newest checkpoint whose marker exists, or None."""
    if directory is None or not Path(directory).is_dir():
        return None
    found = []
    for child in Path(directory).iterdir():
        name = child.name
        if name.startswith("step_") and name[5:].isdigit() and (child / MARKER).is_file():
            found.append((int(name[5:]), child))
    return max(found) if found else None


def read_marker(path: Path) -> dict:
    return json.loads((path / MARKER).read_text())


def _model_and_optim_state(runtime) -> tuple[dict, dict, list[tuple[set, set]]]:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state, keys = {}, {}, []
    for module, optimizer in zip(runtime.modules, runtime.optimizers):
        part_model = get_model_state_dict(module)
        part_optim = get_optimizer_state_dict(module, optimizer, options=options)
        model_state.update(part_model)
        optim_state.update(part_optim)
        keys.append((set(part_model), set(part_optim)))
    return model_state, optim_state, keys


def save_checkpoint(runtime, directory: str | Path, step: int, history: list[tuple[float, float]]) -> Path:
    """Collective: every rank writes its shards, then rank 0 writes the marker.

    `history` is (loss, step time in s) of every completed step, so a resumed run reports them all.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from meshplan.executor import faults

    path = checkpoint_path(directory, step)
    rank = dist.get_rank()
    if rank == 0 and (path / MARKER).exists():
        (path / MARKER).unlink()  # a marker left by an earlier run must not vouch for this save
    dist.barrier()
    model_state, optim_state, _ = _model_and_optim_state(runtime)
    state = {"model": model_state, "optim": optim_state,
             "train": {"step": step, "history_json": json.dumps(history)},
             f"rng_rank{rank}": torch.get_rng_state()}
    try:
        dcp.save(state, storage_writer=faults.storage_writer(str(path), rank, step))
    except (Exception, dcp.api.CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointSaveFailed(_save_failure(path, step, exc)) from None
    faults.inside_save(rank, step)
    dist.barrier()
    if rank == 0:
        marker = {"step": step, "world_size": dist.get_world_size(), "plan_digest": runtime.plan.digest}
        temporary = path / f".{MARKER}.tmp"
        try:
            temporary.write_text(json.dumps(marker))
            os.replace(temporary, path / MARKER)  # atomic: the marker is either absent or whole
        except OSError as exc:
            raise CheckpointSaveFailed(_save_failure(path, step, exc)) from None
    dist.barrier()
    return path


def _save_failure(path: Path, step: int, exc: BaseException) -> str:
    """One line: the first underlying error (DCP wraps every rank's in one long traceback) and
    what is still safe."""
    failures = getattr(exc, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else exc
    if isinstance(cause, OSError) and cause.strerror:
        reason = cause.strerror
    else:
        reason = f"{type(cause).__name__}: {cause}"
    previous = newest_complete(path.parent)
    kept = f"the newest complete checkpoint, {previous[1]}, is intact" if previous else \
        "no earlier complete checkpoint exists"
    return (f"saving checkpoint step_{step} to {path} failed ({reason}); {kept}; free disk space or use "
            f"another --checkpoint-dir, then --resume")


def load_checkpoint(runtime, path: Path) -> tuple[int, list[list[float]]]:
    """Collective: load model, optimizer and progress from a complete checkpoint in place."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    marker = read_marker(path)
    model_state, optim_state, keys = _model_and_optim_state(runtime)
    rank = dist.get_rank()
    state = {"model": model_state, "optim": optim_state, "train": {"step": 0, "history_json": ""}}
    same_layout = marker.get("plan_digest") == runtime.plan.digest
    if same_layout:  # per-rank RNG state only maps onto the same layout
        state[f"rng_rank{rank}"] = torch.get_rng_state()
    dcp.load(state, checkpoint_id=str(path))
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    for module, optimizer, (model_keys, optim_keys) in zip(runtime.modules, runtime.optimizers, keys):
        set_model_state_dict(module, {k: v for k, v in state["model"].items() if k in model_keys})
        set_optimizer_state_dict(module, optimizer, {k: v for k, v in state["optim"].items() if k in optim_keys},
                                 options=options)
    if same_layout:
        torch.set_rng_state(state[f"rng_rank{rank}"])
    return int(state["train"]["step"]), list(json.loads(state["train"]["history_json"]))
