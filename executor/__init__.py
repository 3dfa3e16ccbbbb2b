"""The executor: run a Plan for real with torch.distributed and measure it.

`train(plan, ...)` checks the plan, launches one worker per rank with torchrun, and returns the
`Measurement` rank 0 wrote. torch is imported only inside the workers and where needed.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from meshplan.planner.contracts.measurement import Measurement, load_measurement

__all__ = ["train", "Measurement", "load_measurement"]


def train(plan_path_or_plan, nproc: int | None = None, steps: int = 20, out: str | Path = "measured.json",
          checkpoint_dir: str | Path | None = None, checkpoint_every: int = 0, resume: bool = False,
          max_restarts: int = 0, data: str = "synthetic", seed: int | None = None,
          run_dir: str | Path | None = None, timeout_s: float | None = None, run_limit_s: float | None = None,
          echo: bool = False, progress=False) -> Measurement:
    """Train `steps` optimizer steps of a plan on this node and return what was measured.

    Refuses (MeshplanError) before launching anything the executor cannot run as planned.
    `run_dir` receives per-rank heartbeats (`rank{R}.json`: pid, completed steps) and error files;
    `timeout_s` is the collective timeout: a rank waiting longer than that for the others (a hung
    peer) fails the run, which names the rank it waited for (None: 600 s); `run_limit_s` bounds
    the whole launch (None: no limit); `echo` streams the workers' output; `progress`: False, True
    (a bar of completed steps on stderr when it is a terminal) or fn(done, total).
    """
    from meshplan.executor.data import make_source, token_vocab
    from meshplan.executor import checks
    from meshplan.executor.launch import launch_jobs
    from meshplan.executor.worker import DEFAULT_TIMEOUT_S, Job
    from meshplan.planner.contracts.plan import Plan, load_plan, save_plan

    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="meshplan-train-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(plan_path_or_plan, Plan):
        plan, plan_path = plan_path_or_plan, run_dir / "plan.json"
        save_plan(plan, plan_path)
    else:
        plan_path = Path(plan_path_or_plan).resolve()
        plan = load_plan(plan_path)
    nproc = plan.config.gpus if nproc is None else nproc
    checks.check_nproc(nproc, plan.config.gpus)
    checks.check_plan_runnable(plan, nproc)
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    checks.check_timeout(timeout_s)
    checks.check_timeout(run_limit_s, "the run limit")
    checks.check_output_file(out)
    job = Job(plan_path=str(plan_path), steps=steps, out=str(Path(out).resolve()),
              checkpoint_dir=str(Path(checkpoint_dir).resolve()) if checkpoint_dir else None,
              checkpoint_every=checkpoint_every, resume=resume, data=data, seed=seed, run_dir=str(run_dir),
              timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    source_seed = plan.seed if seed is None else seed
    vocab = token_vocab(plan.model.spec, plan.model.seq)
    if vocab is None:  # a file model: synthetic batches shaped like its example inputs
        checks.check_file_data(data)
    else:
        make_source(data, vocab, plan.model.seq, source_seed)
    if checkpoint_dir:  # writable even when only resuming: a restart may save there
        one_bytes = checks.checkpoint_size_bytes(checks.count_parameters(plan.model.spec, plan.model.seq))
        num_saves = steps // checkpoint_every if checkpoint_every else 0
        checks.check_checkpoint_dir(checkpoint_dir, one_bytes if num_saves else 0, num_saves)
    if Path(out).exists():
        Path(out).unlink()  # never report a previous run's figures as this one's
    launch_jobs([job.to_json()], nproc, run_dir, max_restarts=max_restarts, timeout_s=run_limit_s, echo=echo,
                progress=progress)
    return load_measurement(out)
