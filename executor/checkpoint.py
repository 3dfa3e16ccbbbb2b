"""Distributed checkpoints with `torch.distributed.checkpoint` (DCP).

Layout: `DIR/step_N/` (N = completed optimizer steps) holds the sharded model and optimizer
state under their full-model parameter names (so a checkpoint loads into another layout), the
step, the loss history and each rank's RNG state; `DIR/step_N/COMPLETE` is its manifest
(`executor.manifest`: the run's identity and the SHA-256 of every file), written last, after
every rank has finished writing and only when every saved tensor is finite, so neither a crash
mid-save nor a diverged state ever looks whole (a manifest left in `step_N/` by an earlier run is
removed before the save starts). A failed write (disk full, unwritable) raises
`CheckpointSaveFailed` in one line with the OS reason; earlier checkpoints are never touched.
Loading happens only after the checkpoint verified against its manifest (`manifest.verify`).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from meshplan.executor.manifest import MARKER, Manifest, RunIdentity, describe_files, newest_of_run, write_manifest

# What DCP adds to each record it stores (a tensor, or one optimizer hyperparameter per
# parameter in a flattened state dict), in its shard (torch.save's zip entry) and in .metadata:
# measured 1.64 KB per record on torch 2.13 (a 2-layer GPT: 545 records, 1.34 MB on disk).
DCP_BYTES_PER_RECORD = 1640
FULL_DISK_BYTES = 1 << 20  # less free space than this after a failed write: the disk was full


class CheckpointSaveFailed(RuntimeError):
    """Writing a checkpoint failed (disk full, unwritable); earlier checkpoints are untouched."""


class CheckpointLoadFailed(RuntimeError):
    """A verified checkpoint could not be loaded into this run's model (one line, the cause)."""


class NonFiniteState(RuntimeError):
    """The state to checkpoint holds NaN or infinite values: it is not marked complete."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step}"


def run_identity(plan, seed: int, run_id: str) -> RunIdentity:
    """This run's identity: its id, the plan's digest, the seed, and the model's digest (the
    plan's record of it, else computed from the spec)."""
    from meshplan.planner.models.plan_check import model_digest

    return RunIdentity(run_id=run_id, plan_digest=plan.digest, seed=seed,
                       model_digest=plan.model.digest or model_digest(plan.model.spec))


def estimated_size_bytes(spec: str, seq: int, world_size: int) -> int:
    """What DCP writes for one checkpoint of the whole model: the model state (a tied embedding
    stored under both names) in fp32, two fp32 AdamW moments per parameter, and a record per
    tensor, per step counter, per AdamW hyperparameter per parameter (the flattened optimizer
    state), per rank's RNG state and for the progress."""
    import torch

    from meshplan.planner.models.registry import build_model

    module = build_model(spec, seq, device="meta").module
    stored = dict(module.named_parameters(remove_duplicate=False))
    unique = dict(module.named_parameters())
    num_group_keys = len(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults)
    values_bytes = 4 * sum(p.numel() for p in stored.values()) + 8 * sum(p.numel() for p in unique.values())
    num_records = len(stored) + len(unique) * (3 + num_group_keys) + 2 + world_size
    return values_bytes + num_records * DCP_BYTES_PER_RECORD


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


def save_checkpoint(runtime, directory: str | Path, step: int, history: list[tuple[float, float]],
                    identity: RunIdentity) -> Path:
    """Collective: every rank writes its shards, then rank 0 writes the manifest.

    `history` is (loss, step time in s) of every completed step, so a resumed run reports them all.
    Raises NonFiniteState (every rank) when a saved tensor is NaN or infinite: no manifest then.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from meshplan.executor import faults

    path = checkpoint_path(directory, step)
    rank = dist.get_rank()
    if rank == 0 and (path / MARKER).exists():
        (path / MARKER).unlink()  # a manifest left by an earlier run must not vouch for this save
    dist.barrier()
    faults.before_save(runtime, rank, step)
    model_state, optim_state, _ = _model_and_optim_state(runtime)
    state = {"model": model_state, "optim": optim_state,
             "train": {"step": step, "history_json": json.dumps(history)},
             f"rng_rank{rank}": torch.get_rng_state()}
    try:
        dcp.save(state, storage_writer=faults.storage_writer(str(path), rank, step))
    except (Exception, dcp.api.CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointSaveFailed(_save_failure(path, step, exc, identity.run_id)) from None
    faults.inside_save(rank, step)
    finite = _all_finite(runtime, (model_state, optim_state))
    dist.barrier()
    if not finite:
        raise NonFiniteState(_non_finite_state(path, step, identity.run_id))
    if rank == 0:
        try:
            write_manifest(path, Manifest(step=step, world_size=dist.get_world_size(), identity=identity,
                                          files=describe_files(path)))
        except OSError as exc:
            raise CheckpointSaveFailed(_save_failure(path, step, exc, identity.run_id)) from None
    dist.barrier()
    return path


def _all_finite(runtime, states) -> bool:
    """Every rank agrees whether every floating-point tensor it saved is finite (one all-reduce)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    finite = True
    for state in states:
        for value in state.values():
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
                finite = False
    flag = torch.tensor([1 if finite else 0], dtype=torch.int32, device=runtime.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _last_good(directory: Path, run_id: str) -> str:
    previous = newest_of_run(directory, run_id)
    return f"the newest complete checkpoint, {previous[1]}, is intact" if previous else \
        "no earlier complete checkpoint exists"


def _non_finite_state(path: Path, step: int, run_id: str) -> str:
    return (f"the weights or optimizer state after step {step} hold NaN or infinite values: checkpoint "
            f"{path} was not marked complete; {_last_good(path.parent, run_id)}; lower the learning rate "
            f"or start from that checkpoint")


def _first_cause(exc: BaseException) -> BaseException:
    """DCP wraps every rank's error in one CheckpointException: the first rank's own error."""
    failures = getattr(exc, "failures", None)
    return next(iter(failures.values()))[0] if failures else exc


def _os_reason(cause: BaseException, path: Path) -> str | None:
    """The OS's words for a failed write: an OSError in the chain, else "No space left on device"
    when torch's C++ writer failed (its enforce message hides errno) on a file system left with
    (almost) no room: a write fails with ENOSPC only once the free space is used up."""
    seen = cause
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    try:
        if shutil.disk_usage(path if path.exists() else path.parent).free < FULL_DISK_BYTES:
            return os.strerror(errno.ENOSPC)
    except OSError:
        pass
    return None


def _save_failure(path: Path, step: int, exc: BaseException, run_id: str) -> str:
    """One line: the first underlying error (its OS reason when there is one) and what is still safe."""
    cause = _first_cause(exc)
    reason = _os_reason(cause, path) or _one_line(cause)
    return (f"saving checkpoint step_{step} to {path} failed ({reason}); {_last_good(path.parent, run_id)}; "
            f"free disk space or use another --checkpoint-dir, then --resume")


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def load_checkpoint(runtime, path: Path, manifest: Manifest) -> tuple[int, list[list[float]]]:
    """Collective: load model, optimizer and progress in place from a checkpoint that verified
    against `manifest` (`manifest.verify`: DCP unpickles .metadata, which only verified bytes may be).
    Raises CheckpointLoadFailed in one line naming the cause."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    model_state, optim_state, keys = _model_and_optim_state(runtime)
    rank = dist.get_rank()
    optim_request, optim_names, optim_copies = _tied_requests(runtime.plan, path, optim_state)
    state = {"model": model_state, "optim": optim_request, "train": {"step": 0, "history_json": ""}}
    # per-rank RNG state only maps onto the same layout and world size
    same_layout = manifest.identity.plan_digest == runtime.plan.digest and manifest.world_size == dist.get_world_size()
    if same_layout:
        state[f"rng_rank{rank}"] = torch.get_rng_state()
    try:
        dcp.load(state, checkpoint_id=str(path))
        state["optim"] = _fill_copies({optim_names.get(k, k): v for k, v in state["optim"].items()}, optim_copies)
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for module, optimizer, (model_keys, optim_keys) in zip(runtime.modules, runtime.optimizers, keys):
            set_model_state_dict(module, {k: v for k, v in state["model"].items() if k in model_keys})
            set_optimizer_state_dict(module, optimizer, {k: v for k, v in state["optim"].items() if k in optim_keys},
                                     options=options)
    except (Exception, dcp.api.CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointLoadFailed(f"loading checkpoint {path} failed ({_one_line(_first_cause(exc))})") from None
    if same_layout:
        torch.set_rng_state(state[f"rng_rank{rank}"])
    return int(state["train"]["step"]), list(json.loads(state["train"]["history_json"]))


def _tied_aliases(plan) -> dict[str, str]:
    """Each parameter name that shares its tensor with an earlier one (a tied LM head), mapped to
    that first name: the one a layout holding both saves the optimizer state under."""
    from meshplan.planner.models.registry import build_model

    module = build_model(plan.model.spec, plan.model.seq, device="meta").module
    first, aliases = {}, {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.update({name: first[id(param)]} if id(param) in first else {})
        first.setdefault(id(param), name)
    return aliases


def _tied_requests(plan, path: Path, optim_state: dict) -> tuple[dict, dict, dict]:
    """(the optimizer state to ask DCP for, requested name -> this rank's name, this rank's name
    -> the requested name to copy it from).

    A layout holding both ends of a tied embedding (dp, tp) saves their one optimizer state under
    the first name; a pipeline stage holding only the head's copy asks for it under the head's
    name. Such a request is redirected to the first name when only that is in the checkpoint."""
    aliases = _tied_aliases(plan)
    if not aliases:
        return optim_state, {}, {}
    from torch.distributed.checkpoint import FileSystemReader

    stored = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)  # verified bytes
    request, names, copies = {}, {}, {}
    for key, value in optim_state.items():
        kind, _, rest = key.partition(".")  # "state" / "param_groups", then "<fqn>.<field>"
        alias = next((a for a in aliases if rest.startswith(f"{a}.")), None)
        if alias is not None and f"optim.{key}" not in stored:
            redirected = f"{kind}.{aliases[alias]}{rest[len(alias):]}"
            if redirected in optim_state:  # this rank holds both copies (a V-shaped pipeline)
                copies[key] = redirected
                continue
            if f"optim.{redirected}" in stored:
                request[redirected], names[redirected] = value, key
                continue
        request[key] = value
    return request, names, copies


def _fill_copies(optim: dict, copies: dict) -> dict:
    """The head copy's optimizer state from the first copy's, as tensors of its own."""
    import torch

    for key, source in copies.items():
        value = optim[source]
        optim[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return optim
