"""Predicted vs measured peak memory per rank of small plans on local CPU processes (gloo).

    python benchmarks/bench_memory.py [--steps 3] [--skip-4]

Trains the plans of tests/executor/test_memory_prediction.py (DP, ZeRO-1/2/3, TP, TP+SP, PP 1F1B and
interleaved, CP, EP, selective and full recomputation, bf16-mixed under FSDP2's policy, PP x DP and
DP x TP). Every rank's peak of live tensor bytes is measured during the second step
(`executor.memory.StepMemTracker`); the prediction is `meshplan.simulate(plan)` for the rank's
pipeline stage (global rank r runs stage r // (dp * cp * tp)), torch pipelining's receive buffers
included. Per plan and rank it prints the prediction and its breakdown, the measurement and the
error. Target: |error| <= 10% (the test asserts it).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.executor

from tests.executor.test_memory_prediction import (FOUR_PROCESS, TOLERANCE, TWO_PROCESS,  # noqa: E402
                                                   memory_rows, train_group)


def size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.2f} MiB"


def print_rows(results: dict) -> list[float]:
    print(f"{'plan':<26} {'rank':>4} {'stage':>5} {'predicted':>11} {'measured':>11} "
          f"{'error':>7}   params / grads / optimizer / activations / buffers (MiB)")
    errors = []
    for name, (plan, measured) in results.items():
        for row in memory_rows(plan, measured):
            b = row["breakdown"]
            flag = "  ok" if abs(row["error"]) <= TOLERANCE else "  OVER 10%"
            print(f"{name:<26} {row['rank']:>4} {row['stage']:>5} {size(row['predicted']):>11} "
                  f"{size(row['measured']):>11} {row['error'] * 100:>+6.1f}%   "
                  f"{b.params / 2**20:.2f} / {b.grads / 2**20:.2f} / "
                  f"{b.optimizer / 2**20:.2f} / {b.activations / 2**20:.2f} / {b.buffers / 2**20:.2f}{flag}")
            errors.append(abs(row["error"]))
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps per plan (memory: the second)")
    parser.add_argument("--skip-4", action="store_true", help="only the 2-process plans")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2: the peak is measured on the second step")
    start_s = time.perf_counter()
    print("error = (predicted - measured) / measured\n")
    with tempfile.TemporaryDirectory(prefix="meshplan-bench-memory-") as tmp:
        work = Path(tmp)
        print("2 processes")
        errors = print_rows(train_group(TWO_PROCESS, 2, work / "two", args.steps))
        if not args.skip_4:
            print("\n4 processes")
            errors += print_rows(train_group(FOUR_PROCESS, 4, work / "four", args.steps))
    print(f"\nworst |error| {max(errors) * 100:.1f}% (target {TOLERANCE:.0%}); "
          f"benchmark took {time.perf_counter() - start_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
