"""The executor: run a Plan for real with torch.distributed and measure it.

`train(plan, ...)` checks the plan, launches one worker per rank with torchrun, and returns the
`Measurement` rank 0 wrote. torch is imported only inside the workers and where needed.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from meshplan.planner.contracts.measurement import Measurement, load_measurement

__all__ = ["train", "Measurement", "load_measurement"]


def train(plan_path_or_plan, nproc: int | None = None, steps: int = 20, out: str | Path = "measured.json",
          checkpoint_dir: str | Path | None = None, checkpoint_every: int = 0, resume: bool = False,
          max_restarts: int = 0, data: str = "synthetic", seed: int | None = None,
          run_dir: str | Path | None = None, timeout_s: float | None = None, run_limit_s: float | None = None,
          echo: bool = False, progress=False, resume_from: str | Path | None = None,
          force: bool = False) -> Measurement:
    """Train `steps` optimizer steps of a plan on this node and return what was measured.

    Refuses (MeshplanError) before launching anything the executor cannot run as planned, and
    (`executor.preflight`, unless `force`) a plan this machine cannot hold: a GPU plan here without
    GPUs or with fewer, or ranks whose predicted memory exceeds this machine's.
    `resume` continues this run from the newest checkpoint in `checkpoint_dir` that verifies
    (one written by another run, with another seed, plan or model, is refused);
    `resume_from` starts from the checkpoint it names (`DIR/step_N`, or the newest one in DIR
    that verifies) whatever run wrote it. `run_dir` receives per-rank heartbeats
    (`rank{R}.json`: pid, completed steps) and error files (None: a temporary directory, removed
    afterwards); `timeout_s` is the collective timeout: a rank waiting longer than that for the
    others (a hung peer) fails the run, which names the rank it waited for (None: 600 s);
    `run_limit_s` bounds the whole launch (None: no limit); `echo` streams the workers' output;
    `progress`: False, True (a bar of completed steps on stderr when it is a terminal) or fn(done, total).
    """
    from meshplan.planner.contracts.atomicfile import refuse_output_over_input
    from meshplan.planner.contracts.plan import Plan, load_plan

    # before anything is written or cleared at `out`: it may be the plan or the data itself
    refuse_output_over_input("out", str(out), [("plan", None if isinstance(plan_path_or_plan, Plan)
                                                 else str(plan_path_or_plan)),
                                                ("data", None if data == "synthetic" else data)])
    temporary = run_dir is None
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="meshplan-train-"))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if isinstance(plan_path_or_plan, Plan):
            from meshplan.planner.contracts.plan import save_plan

            plan, plan_path = plan_path_or_plan, run_dir / "plan.json"
            save_plan(plan, plan_path)
        else:
            plan_path = Path(plan_path_or_plan).resolve()
            plan = load_plan(plan_path)
        job, nproc = _checked_job(plan, plan_path, nproc, steps, out, checkpoint_dir, checkpoint_every, resume,
                                  resume_from, max_restarts, data, seed, run_dir, timeout_s, run_limit_s, force)
        from meshplan.executor.launch import launch_jobs

        if Path(out).exists():
            Path(out).unlink()  # never report a previous run's figures as this one's
        launch_jobs([job.to_json()], nproc, run_dir, max_restarts=max_restarts, timeout_s=run_limit_s, echo=echo,
                    progress=progress)
        return load_measurement(out)
    finally:
        if temporary:
            shutil.rmtree(run_dir, ignore_errors=True)


def _checked_job(plan, plan_path, nproc, steps, out, checkpoint_dir, checkpoint_every, resume, resume_from,
                 max_restarts, data, seed, run_dir, timeout_s, run_limit_s, force=False):
    """The Job to launch and the process count, after every check that needs no worker; the
    preflight (unless `force`) first, before the model is built: it needs only the plan."""
    from meshplan.executor import checks
    from meshplan.executor.checkpoint import estimated_size_bytes
    from meshplan.executor.data import make_source, token_vocab
    from meshplan.executor.worker import DEFAULT_TIMEOUT_S, Job

    nproc = plan.config.gpus if nproc is None else nproc
    checks.check_nproc(nproc, plan.config.gpus)
    if not force:
        _preflight(plan, nproc)
    checks.check_plan_runnable(plan, nproc)
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    checks.check_timeout(timeout_s)
    checks.check_timeout(run_limit_s, "the run limit")
    checks.check_output_file(out)
    source_seed = plan.seed if seed is None else seed
    vocab = token_vocab(plan.model.spec, plan.model.seq)
    if vocab is None:  # a file model: synthetic batches shaped like its example inputs
        checks.check_file_data(data)
    else:
        make_source(data, vocab, plan.model.seq, source_seed)
    if checkpoint_dir:  # writable even when only resuming: a restart may save there
        num_saves = steps // checkpoint_every if checkpoint_every else 0
        one_bytes = estimated_size_bytes(plan.model.spec, plan.model.seq, nproc) if num_saves else 0
        checks.check_checkpoint_dir(checkpoint_dir, one_bytes, num_saves)
    if resume and not checkpoint_dir:
        raise ValueError("--checkpoint-every and --resume need --checkpoint-dir")
    run_id, start = _resume_choice(plan, source_seed, steps, checkpoint_dir, resume, resume_from)
    job = Job(plan_path=str(plan_path), steps=steps, out=str(Path(out).resolve()),
              checkpoint_dir=str(Path(checkpoint_dir).resolve()) if checkpoint_dir else None,
              checkpoint_every=checkpoint_every, resume=False, resume_from=start, data=data, seed=seed,
              run_dir=str(run_dir), timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s, run_id=run_id)
    return job, nproc


def _preflight(plan, nproc: int) -> None:
    from meshplan.executor.preflight import preflight_refusal, this_machine
    from meshplan.planner.contracts.errors import MeshplanError

    refusal = preflight_refusal(plan, nproc, this_machine())
    if refusal:
        raise MeshplanError(refusal)


def _resume_choice(plan, seed: int, steps: int, checkpoint_dir, resume: bool, resume_from):
    """(run id, checkpoint to start from or None): a new run gets a new id; `--resume` continues
    the run of the newest checkpoint that verifies, refusing another run's; `--resume-from` names
    a checkpoint of any run (a new run starts from it). Skipped checkpoints are said on stderr."""
    from meshplan.executor import manifest
    from meshplan.executor.checkpoint import run_identity
    from meshplan.executor.worker import steps_already_done
    from meshplan.planner.contracts.errors import MeshplanError

    run_id = uuid.uuid4().hex[:16]
    if resume and resume_from:
        raise MeshplanError("give --resume (the newest checkpoint of this run) or --resume-from DIR, not both")
    if not (checkpoint_dir if resume else resume_from):
        return run_id, None
    try:
        choice = (manifest.choose_for_resume(checkpoint_dir, run_identity(plan, seed, run_id)) if resume
                  else manifest.choose_explicit(resume_from))
    except (manifest.CheckpointInvalid, manifest.OtherRunsCheckpoint) as exc:
        raise MeshplanError(str(exc)) from None
    for note in choice.notes:
        print(f"meshplan train: {note}", file=sys.stderr, flush=True)
    if choice.manifest is None:
        print(f"meshplan train: no complete checkpoint in {checkpoint_dir}: starting from step 0", file=sys.stderr,
              flush=True)
        return run_id, None
    if choice.manifest.step >= steps:
        raise MeshplanError(steps_already_done(choice.path, choice.manifest.step, steps))
    return (choice.manifest.identity.run_id if resume else run_id), str(choice.path.resolve())
