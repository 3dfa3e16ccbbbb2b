"""Executor overhead: meshplan's training step against a minimal hand-written torch DDP loop.

Same model, weights, data, global batch, AdamW, gradient clipping, 2 CPU processes (gloo).

Paired (the figure): one torchrun launch builds both, the executor's runtime from a DDP plan
(`executor.runtime.build_runtime`, the step `meshplan train` times) and the hand-written DDP
model, and alternates their steps: executor, DDP, executor, DDP, ... Each pair ran within a
second of each other on the same processes, so a slow spell of a shared machine slows both;
the figure is the median of the per-pair ratios (target: <= 1.05), with its spread.

Separate (`--separate-runs`): whole `meshplan train` runs against separate DDP launches,
three each, alternating which goes first; on a shared machine single runs vary by +-20%.

    python benchmarks/bench_executor.py [--steps 40] [--separate-runs]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPEC = "gpt:layers=4,hidden=256,heads=4,vocab=1024"
SEQ, GLOBAL_BATCH, NUM_PROCESSES, SEED, WARMUP_STEPS = 128, 8, 2, 0, 2


def executor_step_time_s(steps: int, work_dir: Path) -> float:
    from meshplan.executor import train
    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.costing.hardware import load_cluster

    plan = uniform_plan(SPEC, SEQ, GLOBAL_BATCH, load_cluster("cpu"), dp=NUM_PROCESSES,
                        microbatch_size=GLOBAL_BATCH // NUM_PROCESSES, seed=SEED)
    measured = train(plan, steps=steps, out=work_dir / "measured.json", run_dir=work_dir / "run")
    return statistics.median(measured.step_times_s[WARMUP_STEPS:])


def run_workers(mode: str, steps: int, out: Path) -> list:
    """This script under torchrun with `--<mode>` on NUM_PROCESSES processes; rank 0's JSON."""
    from meshplan.executor.launch import free_port

    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={NUM_PROCESSES}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", __file__,
               f"--{mode}", "--steps", str(steps), "--out", str(out)]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def ddp_step_time_s(steps: int, work_dir: Path) -> float:
    return statistics.median(run_workers("ddp-worker", steps, work_dir / "ddp.json")[WARMUP_STEPS:])


def _hand_written_ddp(world: int):
    """The baseline, what a user would write without meshplan: the model under DDP with the
    executor's AdamW and clipping settings. Returns step(inputs, targets)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from meshplan.executor.runtime import Hyperparameters
    from meshplan.planner.models.registry import build_model
    from meshplan.planner.models.transformer import init_weights, lm_loss

    hp = Hyperparameters()
    model = build_model(SPEC, SEQ, device="cpu").module
    init_weights(model, SEED)
    model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=hp.lr, betas=(hp.beta1, hp.beta2), weight_decay=hp.weight_decay)

    def step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_grad_norm)
        optimizer.step()

    return step


def _replica_batch(step: int, rank: int, world: int):
    from meshplan.executor.data import DataSource, global_batch, replica_slice

    source = DataSource(vocab=1024, seq=SEQ, seed=SEED)
    return replica_slice(*global_batch(source, step, GLOBAL_BATCH), rank, world)


def _timed_s(fn) -> float:
    """Wall seconds of `fn()` on the slowest rank, every rank starting together."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _finish(rank: int, out: str, result) -> None:
    import torch.distributed as dist

    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def ddp_worker(steps: int, out: str) -> None:
    """The hand-written DDP loop alone: its step time per step."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp_step = _hand_written_ddp(world)
    times = []
    for step in range(steps):
        inputs, targets = _replica_batch(step, rank, world)
        times.append(_timed_s(lambda: ddp_step(inputs, targets)))
    _finish(rank, out, times)


def paired_worker(steps: int, out: str) -> None:
    """Alternate the executor's step and the hand-written DDP step on the same processes."""
    import torch
    import torch.distributed as dist

    from meshplan.executor.plans import uniform_plan
    from meshplan.executor.runtime import Hyperparameters, build_runtime, train_step
    from meshplan.planner.costing.hardware import load_cluster

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = uniform_plan(SPEC, SEQ, GLOBAL_BATCH, load_cluster("cpu"), dp=world,
                        microbatch_size=GLOBAL_BATCH // world, seed=SEED)
    hp = Hyperparameters()
    runtime = build_runtime(plan, torch.device("cpu"), hp, SEED)
    ddp_step = _hand_written_ddp(world)
    pairs = []
    for step in range(steps):
        inputs, targets = _replica_batch(step, rank, world)
        runs = {"executor": lambda: train_step(runtime, step, steps, inputs, targets, hp),
                "ddp": lambda: ddp_step(inputs, targets)}
        order = ("executor", "ddp") if step % 2 == 0 else ("ddp", "executor")
        times = {name: _timed_s(runs[name]) for name in order}
        pairs.append((times["executor"], times["ddp"]))
    _finish(rank, out, pairs)


def paired(steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pairs = run_workers("paired-worker", steps, Path(tmp, "pairs.json"))[WARMUP_STEPS:]
    ratios = sorted(executor_s / ddp_s for executor_s, ddp_s in pairs)
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"model {SPEC}, seq {SEQ}, global batch {GLOBAL_BATCH}, {NUM_PROCESSES} CPU processes (gloo), "
          f"{len(pairs)} paired steps after {WARMUP_STEPS} warm-up, order alternating")
    print(f"executor step  median {statistics.median(p[0] for p in pairs) * 1e3:8.2f} ms")
    print(f"DDP step       median {statistics.median(p[1] for p in pairs) * 1e3:8.2f} ms")
    print(f"ratio executor / DDP per pair: median {statistics.median(ratios):.3f} "
          f"(quartiles {quartiles[0]:.3f}..{quartiles[2]:.3f}; target <= 1.05)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--separate-runs", action="store_true", help="whole meshplan train runs vs DDP launches")
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--paired-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_worker:
        ddp_worker(args.steps, args.out)
        return
    if args.paired_worker:
        paired_worker(args.steps, args.out)
        return
    if not args.separate_runs:
        paired(args.steps)
        return
    executor_times, ddp_times = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(3):
            work = Path(tmp, str(attempt))
            work.mkdir()
            runs = [lambda: executor_times.append(executor_step_time_s(args.steps, work)),
                    lambda: ddp_times.append(ddp_step_time_s(args.steps, work))]
            for run in runs if attempt % 2 == 0 else reversed(runs):
                run()
    print(f"model {SPEC}, seq {SEQ}, global batch {GLOBAL_BATCH}, {NUM_PROCESSES} CPU processes (gloo), "
          f"{args.steps} steps ({WARMUP_STEPS} warm-up), median step time per run")
    for name, times in (("executor (meshplan train, DDP plan)", executor_times),
                        ("hand-written torch DDP loop", ddp_times)):
        print(f"{name:36s} best {min(times) * 1e3:8.2f} ms/step  runs: " + ", ".join(f"{t * 1e3:.2f}" for t in times))
    print(f"ratio executor / DDP: best runs {min(executor_times) / min(ddp_times):.3f}, "
          f"mean of runs {statistics.mean(executor_times) / statistics.mean(ddp_times):.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
