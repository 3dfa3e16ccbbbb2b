"""The per-rank entry point: `python -m meshplan.executor.worker` under torchrun.

    torchrun --nproc-per-node N -m meshplan.executor.worker --plan plan.json --steps 20 --out measured.json

or `--jobs jobs.json` (a list of job objects with the same keys) to run several plans one after
another in one launch (the tests group configurations this way: each launch costs seconds).
Each job: check the plan, build this rank's runtime, resume when asked (`--resume`: the newest
checkpoint that verifies, refusing another run's; `--resume-from`: the one named) or when
torchrun restarted the workers (this run's newest checkpoint that verifies; rank 0 chooses and
verifies, `executor.manifest`), train, checkpoint every K steps, and have rank 0 write
measured.json. Rank 0's process-group store listens on loopback on one node (`executor.loopback`). Teardown is a barrier, then `destroy_process_group`.

A collective that waits longer than the job's `timeout_s` fails (a hung peer); a NaN or infinite
loss or gradient norm stops every rank at the same step, before the update and before any save,
with measured.json holding the good steps; restarts after that stop at once (`fatal.txt`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path

DEFAULT_TIMEOUT_S = 600.0
FATAL_FILE = "fatal.txt"  # in run_dir: an error that restarting the workers cannot fix


@dataclass(frozen=True)
class Job:
    """One training run of one plan (what `meshplan train` asks for)."""

    plan_path: str
    steps: int = 20
    out: str = "measured.json"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    data: str = "synthetic"
    seed: int | None = None
    run_dir: str | None = None  # heartbeats (pid, step per rank) and per-rank error files
    timeout_s: float = DEFAULT_TIMEOUT_S  # process-group timeout: a hung collective fails instead
    # The run's id, written into every checkpoint it saves: restarts adopt only this run's
    # checkpoints. None: the resumed checkpoint's, else one derived from torchrun's --rdzv-id.
    run_id: str | None = None
    resume_from: str | None = None  # a checkpoint (DIR/step_N) or checkpoint dir named explicitly
    lr: float | None = None  # None: Hyperparameters' default
    measure_memory: bool = True  # track live tensors during the second step (CPU; slows that step)

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every and --resume need --checkpoint-dir")
        if self.resume and self.resume_from:
            raise ValueError("give --resume (the newest checkpoint of this run) or --resume-from DIR, not both")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    def to_json(self) -> dict:
        return asdict(self)


def job_from_json(data: dict) -> Job:
    known = {f.name for f in fields(Job)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown job field {unknown[0]!r}; known: {', '.join(sorted(known))}")
    return Job(**data)


def run_job(job: Job, device) -> None:
    """Train one job on the already initialised default process group (collective)."""
    import torch.distributed as dist

    from meshplan.executor.checkpoint import load_checkpoint
    from meshplan.executor.runtime import Hyperparameters, build_runtime
    from meshplan.executor.checks import check_plan_runnable
    from meshplan.planner.contracts.plan import load_plan

    plan = load_plan(job.plan_path)
    check_plan_runnable(plan, dist.get_world_size())
    seed = plan.seed if job.seed is None else job.seed
    hp = Hyperparameters() if job.lr is None else Hyperparameters(lr=job.lr)
    runtime = build_runtime(plan, device, hp, seed)
    source = _data_source(job, plan, seed)
    # torchrun restarted the workers after a failure: continue from this run's newest checkpoint
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    start = _agreed_start(job, plan, seed, restarted)
    if start["error"]:
        raise ResumeRefused(start["error"])
    identity = start["identity"]
    start_step, history = (load_checkpoint(runtime, start["path"], start["manifest"])
                           if start["path"] is not None else (0, []))
    if start_step > job.steps or (start_step == job.steps and not restarted):
        raise ResumeRefused(steps_already_done(start["path"], start_step, job.steps))
    if dist.get_rank() == 0 and (job.resume or job.resume_from or (restarted and job.checkpoint_dir)):
        for note in start["notes"]:
            print(note, flush=True)
        print(f"resuming after step {start_step} from {start['path']}" if start["path"] is not None else
              f"no complete checkpoint of this run in {job.checkpoint_dir}: starting from step 0", flush=True)
    history, peak_bytes, memory_source, stopped = _train_loop(job, runtime, source, hp, start_step,
                                                              [tuple(h) for h in history], identity)
    if history:  # a stopped run still reports its good steps
        _write_measurement(job, runtime, history, peak_bytes, memory_source, start_step, stopped)
    if stopped:
        raise NonFiniteLoss(stopped)


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm became NaN or infinite: training stopped before the update."""


class ResumeRefused(RuntimeError):
    """The checkpoint to resume from is not this run's, failed verification, or is past --steps."""


def steps_already_done(path, done: int, steps: int) -> str:
    return (f"checkpoint {path} has already trained {done} steps and --steps {steps} asks for "
            f"{'no more' if done == steps else 'fewer'}: nothing to train or measure; ask for --steps above {done}")


def _agreed_start(job: Job, plan, seed: int, restarted: bool) -> dict:
    """Rank 0 chooses (and verifies) the checkpoint to start from; every rank receives its choice."""
    import torch.distributed as dist

    box = [_choose_start(job, plan, seed, restarted) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # between this run's own ranks
    return box[0]


def _choose_start(job: Job, plan, seed: int, restarted: bool) -> dict:
    from meshplan.executor import manifest as mf
    from meshplan.executor.checkpoint import run_identity

    run_id = job.run_id or f"torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
    result = {"path": None, "manifest": None, "notes": (), "error": ""}
    try:
        choice = mf.Choice(None, None)
        if restarted:
            choice = mf.choose_for_restart(job.checkpoint_dir, run_id)
        if choice.path is None and job.resume_from:
            choice = mf.choose_explicit(job.resume_from)
        elif choice.path is None and job.resume:
            choice = mf.choose_for_resume(job.checkpoint_dir, run_identity(plan, seed, run_id))
            if choice.manifest is not None and job.run_id is None:  # --resume continues that run
                run_id = choice.manifest.identity.run_id
    except (mf.CheckpointInvalid, mf.OtherRunsCheckpoint) as exc:
        result["error"] = str(exc)
        choice = mf.Choice(None, None)
    result.update(path=choice.path, manifest=choice.manifest, notes=choice.notes,
                  identity=run_identity(plan, seed, run_id))
    return result


def _non_finite(job: Job, step: int, loss_value: float, grad_norm: float, num_good: int, run_id: str) -> str:
    from meshplan.executor.manifest import newest_of_run

    newest = newest_of_run(job.checkpoint_dir, run_id) if job.checkpoint_every else None
    kept = f"the last good checkpoint is {newest[1]}" if newest else "no checkpoint was saved"
    measured = f"{job.out} holds the {num_good} good step(s)" if num_good else "no step finished"
    return (f"the loss became {loss_value} at step {step} (gradient norm {grad_norm}): training stopped before "
            f"updating the weights; {kept}; {measured}; lower the learning rate or start from that checkpoint")


def _train_loop(job: Job, runtime, source, hp, start_step: int, history: list[tuple[float, float]], identity):
    """Steps start_step..steps-1; returns (loss, time) of every good step, this rank's peak memory
    and, when the loss or gradient norm stopped being finite, the message saying so."""
    import torch
    import torch.distributed as dist

    from meshplan.executor import faults
    from meshplan.executor.checkpoint import save_checkpoint
    from meshplan.executor.runtime import train_step

    device, rank = runtime.device, dist.get_rank()
    # Live-tensor tracking slows its step, so it runs on the second step of the attempt (a
    # warm-up step in a fresh run) once optimizer states exist.
    memory_step = min(start_step + 1, job.steps - 1)
    peak_bytes, memory_source, stopped = 0, "none", ""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(start_step, job.steps):
        inputs, targets = _replica_batch(runtime, source, step)
        faults.before_step(runtime, rank, step + 1)
        started = time.perf_counter()
        if step == memory_step and device.type == "cpu" and job.measure_memory:
            loss, grad_norm, peak_bytes = _tracked_step(runtime, step, job.steps, inputs, targets, hp)
            memory_source = "torch.distributed._tools.mem_tracker.MemTracker (live tensor bytes)"
        else:
            loss, grad_norm = train_step(runtime, step, job.steps, inputs, targets, hp)
        loss_value, step_time_s = _agree(runtime, loss, time.perf_counter() - started)
        # Every rank sees the same agreed loss and global norm, so every rank stops at the same step.
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            stopped = _non_finite(job, step + 1, loss_value, grad_norm, len(history), identity.run_id)
            break
        history.append((loss_value, step_time_s))
        _heartbeat(job.run_dir, rank, step + 1)
        if rank == 0:
            print(f"step {step + 1}/{job.steps} loss {loss_value:.6f} time {step_time_s * 1e3:.1f} ms", flush=True)
        if job.checkpoint_every and (step + 1) % job.checkpoint_every == 0:
            save_checkpoint(runtime, job.checkpoint_dir, step + 1, history, identity)
    if device.type == "cuda":
        peak_bytes, memory_source = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    return history, peak_bytes, memory_source, stopped


def _write_measurement(job: Job, runtime, history, peak_bytes: int, memory_source: str, start_step: int,
                       stopped: str = "") -> None:
    import torch.distributed as dist

    from meshplan.executor.measure import host_info, software_versions, tokens_per_s
    from meshplan.planner.contracts.measurement import Measurement, save_measurement

    plan, cfg = runtime.plan, runtime.plan.config
    losses, times = [h[0] for h in history], [h[1] for h in history]
    peaks = _gather_ints(runtime, peak_bytes)
    warmup = min(2, len(times) - 1) if len(times) > 1 else 0
    tokens_per_step = cfg.global_batch * plan.model.seq
    measurement = Measurement(
        world_size=dist.get_world_size(), plan_digest=plan.digest, step_times_s=tuple(times), warmup_steps=warmup,
        peak_memory_bytes_per_rank=tuple(peaks), losses=tuple(losses),
        tokens_per_s=tokens_per_s(times, warmup, tokens_per_step), tokens_per_step=tokens_per_step,
        memory_source=memory_source, precision=cfg.precision, backend=dist.get_backend(),
        device=runtime.device.type, resumed_from_step=start_step, host=host_info(), versions=software_versions(),
        stopped=stopped)
    if dist.get_rank() == 0:
        Path(job.out).parent.mkdir(parents=True, exist_ok=True)
        save_measurement(measurement, job.out)
    dist.barrier()


def _data_source(job: Job, plan, seed: int):
    """Token batches for the zoo and HF models; synthetic batches shaped like the example inputs
    for file models."""
    from meshplan.executor.data import make_source, token_vocab

    vocab = token_vocab(plan.model.spec, plan.model.seq)
    if vocab is not None:
        return make_source(job.data, vocab, plan.model.seq, seed)
    from meshplan.executor import checks, filemodel

    checks.check_file_data(job.data)
    return filemodel.data_source(filemodel.build_seeded(plan, seed), seed)


def _replica_batch(runtime, source, step: int):
    """This replica's (inputs, targets) of the step's global batch (file models: (inputs tuple, None))."""
    from meshplan.executor import data, filemodel

    cfg = runtime.plan.config
    if isinstance(source, filemodel.FileDataSource):
        batch = filemodel.global_batch(source, step, cfg.global_batch)
        return filemodel.replica_slice(batch, runtime.dp_rank, cfg.dp), None
    inputs, targets = data.global_batch(source, step, cfg.global_batch)
    inputs, targets = data.replica_slice(inputs, targets, runtime.dp_rank, cfg.dp)
    if cfg.cp > 1:  # this rank's load-balanced chunks of every sequence
        from meshplan.executor.parallel.context import shard_sequence

        inputs, targets = (shard_sequence(t, cfg.cp, runtime.cp_rank) for t in (inputs, targets))
    return inputs, targets


def _tracked_step(runtime, step, total_steps, inputs, targets, hp):
    """One step under MemTracker: the peak of live tensor bytes on this rank (CPU has no allocator stats)."""
    from meshplan.executor.memory import StepMemTracker
    from meshplan.executor.runtime import train_step

    tracker = StepMemTracker()
    tracker.track_external(*runtime.stages, *runtime.optimizers)
    with tracker:
        loss, grad_norm = train_step(runtime, step, total_steps, inputs, targets, hp)
    return loss, grad_norm, tracker.peak_bytes()


def _agree(runtime, loss, elapsed_s: float) -> tuple[float, float]:
    """All ranks agree on the step's loss (mean over replicas) and time (slowest rank): one all-reduce."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    values = torch.zeros(2 * world, dtype=torch.float64, device=runtime.device)
    if loss is not None and runtime.tp_rank == 0:  # CP ranks hold equal token counts: mean of means
        values[rank] = float(loss) / runtime.plan.config.data_ranks
    values[world + rank] = elapsed_s
    dist.all_reduce(values)
    return float(values[:world].sum()), float(values[world:].max())


def _gather_ints(runtime, value: int) -> list[int]:
    import torch
    import torch.distributed as dist

    values = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=runtime.device)
    values[dist.get_rank()] = value
    dist.all_reduce(values)
    return [int(v) for v in values.tolist()]


def _heartbeat(run_dir: str | None, rank: int, step: int) -> None:
    """`run_dir/rank{R}.json`: pid and completed steps, for progress and for fault-injection tests."""
    if not run_dir:
        return
    path = Path(run_dir) / f"rank{rank}.json"
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"pid": os.getpid(), "step": step,
                                     "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}))
    os.replace(temporary, path)


def _exit_with_parent() -> None:
    """If the torchrun agent dies (even by SIGKILL), its workers must not linger: poll the parent."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def parse_args(argv: list[str] | None = None) -> list[Job]:
    parser = argparse.ArgumentParser(prog="python -m meshplan.executor.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", help="JSON file with a list of jobs (instead of --plan ...)")
    parser.add_argument("--plan")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="measured.json")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--resume-from")
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--run-dir")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    args = parser.parse_args(argv)
    if args.jobs:
        return [job_from_json(item) for item in json.loads(Path(args.jobs).read_text())]
    if not args.plan:
        parser.error("give --plan plan.json or --jobs jobs.json")
    return [Job(plan_path=args.plan, steps=args.steps, out=args.out, checkpoint_dir=args.checkpoint_dir,
                checkpoint_every=args.checkpoint_every, resume=args.resume, resume_from=args.resume_from,
                data=args.data, seed=args.seed, run_dir=args.run_dir, timeout_s=args.timeout_s)]


def main(argv: list[str] | None = None) -> int:
    jobs = parse_args(argv)
    import torch
    import torch.distributed as dist

    _exit_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    for run_dir in {job.run_dir for job in jobs if job.run_dir}:  # pid known before anything can hang
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        Path(run_dir, f"error_rank{rank}.txt").unlink(missing_ok=True)  # only this attempt's errors count
        _heartbeat(run_dir, rank, 0)
        fatal = Path(run_dir, FATAL_FILE)
        if fatal.is_file():  # a restart cannot cure a diverged run: report it again and stop at once
            _record_text(jobs, fatal.read_text().strip())
            return 1
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        from meshplan.planner.calibration.host import reuse_freed_memory

        device = torch.device("cpu")
        reuse_freed_memory()  # as calibrate measured it (planner.calibration.host)
    from meshplan.executor.loopback import worker_store

    timeout = timedelta(seconds=max(j.timeout_s for j in jobs))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout, **worker_store(timeout))
    try:
        for job in jobs:
            if job.run_dir:
                Path(job.run_dir).mkdir(parents=True, exist_ok=True)
            run_job(job, device)
    except BaseException as exc:
        _record_error(jobs, exc)
        if _is_fatal(exc) and jobs[0].run_dir:  # every rank: the first to exit gets the rest killed
            temporary = Path(jobs[0].run_dir, f"{FATAL_FILE}.rank{rank}")
            temporary.write_text(_error_line(exc) + "\n")
            os.replace(temporary, Path(jobs[0].run_dir, FATAL_FILE))
        raise
    # A bare destroy_process_group() sometimes aborts after a good run on gloo: barrier first.
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _is_fatal(exc: BaseException) -> bool:
    """Errors a restart of the workers cannot cure: a diverged run, a refused or unloadable checkpoint."""
    from meshplan.executor.checkpoint import CheckpointLoadFailed, NonFiniteState

    return isinstance(exc, (NonFiniteLoss, NonFiniteState, ResumeRefused, CheckpointLoadFailed))


def _error_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _record_error(jobs: list[Job], exc: BaseException) -> None:
    _record_text(jobs, _error_line(exc))


def _record_text(jobs: list[Job], message: str) -> None:
    run_dir = next((job.run_dir for job in jobs if job.run_dir), None)
    if run_dir:
        rank = os.environ.get("RANK", "0")
        Path(run_dir, f"error_rank{rank}.txt").write_text(message[:2000] + "\n")


if __name__ == "__main__":
    sys.exit(main())
