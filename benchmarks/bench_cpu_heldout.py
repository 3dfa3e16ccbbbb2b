"""Predicted vs measured step time on CPU processes, on shapes the calibration never saw.

    python benchmarks/bench_cpu_heldout.py [--profile cpu.toml] [--profile-4 cpu4.toml] [--steps 8]
                                           [--repeats 2] [--skip-4]

`meshplan calibrate` fits the CPU profile's efficiency and fixed costs on one shape class: GPT
blocks of hidden 256 at sequences 128-256 and a 2-layer hidden-256 model (`planner.calibration`),
besides its kernel sweeps (matmuls, attention, copies, collectives). Here the fit shape is run
once for reference (its figure is in-sample), then every held-out configuration: wider models
(hidden 512 and 1024), a longer sequence (512), 2 processes (DP, TP, PP) and 4 processes (DP x TP,
PP x DP). The 4-process rows use a 4-process calibration, as a user training with 4 processes
would (`calibrate --nproc 4`: on a host with fewer cores every rate is scaled by the core share
each process gets), on the same shape class. Nothing is refitted between configurations. The
held-out rows are summarised apart (mean and max |error|), against the 15% target for 2
processes; 4 processes oversubscribe a 2-core machine and are reported without a bound.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_pred_vs_measured import MODEL as FIT_MODEL, SEQ as FIT_SEQ, calibrate, print_fixed_costs, run_config  # noqa: E402

HELD_OUT_TARGET = 0.15
GLOBAL_BATCH = 8
# (name, model, seq, processes, pins)
FIT = ("fit-DP", FIT_MODEL, FIT_SEQ, 2, dict(dp=2, tp=1, pp=1))
HELD_OUT = (
    ("h512-DP", "gpt:layers=4,hidden=512,heads=8,vocab=4096", 128, 2, dict(dp=2, tp=1, pp=1)),
    ("h512-TP", "gpt:layers=4,hidden=512,heads=8,vocab=4096", 128, 2, dict(tp=2, dp=1, pp=1)),
    ("h1024-DP", "gpt:layers=2,hidden=1024,heads=16,vocab=4096", 128, 2, dict(dp=2, tp=1, pp=1)),
    ("s512-DP", "gpt:layers=4,hidden=256,heads=4,vocab=4096", 512, 2, dict(dp=2, tp=1, pp=1)),
    ("s512-PP", "gpt:layers=4,hidden=256,heads=4,vocab=4096", 512, 2, dict(pp=2, dp=1, tp=1, schedule="1f1b")),
    ("h512-DPxTP", "gpt:layers=4,hidden=512,heads=8,vocab=4096", 128, 4, dict(dp=2, tp=2, pp=1)),
    ("h512-PPxDP", "gpt:layers=4,hidden=512,heads=8,vocab=4096", 128, 4, dict(pp=2, dp=2, tp=1, schedule="1f1b")),
)


def widened(profile: Path, num_processes: int, work: Path) -> Path:
    """The calibrated profile with enough (virtual) nodes for `num_processes` local processes,
    should it have been calibrated with fewer: the same measured figures, nothing refitted."""
    from dataclasses import replace

    from meshplan.planner.contracts.cluster import dump_cluster_toml
    from meshplan.planner.costing.hardware import load_cluster

    cluster = load_cluster(profile)
    nodes = -(-num_processes // cluster.gpus_per_node)
    if nodes <= cluster.max_nodes:
        return profile
    path = work / f"{profile.stem}-{num_processes}.toml"
    path.write_text(dump_cluster_toml(replace(cluster, max_nodes=nodes)))
    return path


def run(rows, profiles: dict[int, Path], work: Path, steps: int, repeats: int) -> list[dict]:
    """Each configuration `repeats` times in interleaved rounds, with the calibration of its
    process count; the least disturbed run is kept."""
    runs: dict[str, list[dict]] = {row[0]: [] for row in rows}
    for _ in range(repeats):
        for name, model, seq, gpus, pins in rows:
            result = run_config(name, pins, gpus, widened(profiles[gpus], gpus, work), work, steps, model=model, seq=seq,
                                global_batch=GLOBAL_BATCH)
            result.update(model=model, seq=seq)
            runs[name].append(result)
            print(f"  {name}: {result['measured_s'] * 1e3:.1f} ms measured, {result['predicted_s'] * 1e3:.1f} ms "
                  f"predicted (load {result['load']:.1f})", flush=True)
    return [min(runs[row[0]], key=lambda r: r["measured_s"]) for row in rows]


def summary(label: str, rows: list[dict]) -> str:
    errors = [abs(r["error"]) for r in rows]
    return (f"{label}: {len(rows)} configurations, mean |error| {statistics.mean(errors):.1%}, "
            f"max {max(errors):.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, help="a 2-process calibrated profile (default: calibrate now)")
    parser.add_argument("--profile-4", type=Path, help="a 4-process calibrated profile (default: calibrate now)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per configuration")
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration; the least disturbed is kept")
    parser.add_argument("--skip-4", action="store_true", help="leave out the 4-process configurations")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshplan-heldout-") as tmp:
        work = Path(tmp)
        profile = args.profile or calibrate(work / "cpu-calibrated.toml", 2)
        profile_4 = None if args.skip_4 else args.profile_4 or calibrate(work / "cpu-calibrated-4.toml", 4)
        start_s = time.perf_counter()
        print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        print_fixed_costs(profile)
        rows = [FIT] + [row for row in HELD_OUT if not (args.skip_4 and row[3] > 2)]
        results = run(rows, {2: profile, 4: profile_4}, work, args.steps, args.repeats)
        print(f"\n{'config':<11} {'model':<44} {'seq':>4} {'procs':>5} {'predicted ms':>12} {'measured ms':>11} "
              f"{'error':>7}")
        for result, row in zip(results, rows):
            print(f"{result['name']:<11} {result['model']:<44} {result['seq']:>4} {row[3]:>5} "
                  f"{result['predicted_s'] * 1e3:>12.1f} {result['measured_s'] * 1e3:>11.1f} {result['error']:>+7.1%}")
        fit, held = results[0], results[1:]
        two = [r for r, row in zip(held, rows[1:]) if row[3] == 2]
        four = [r for r, row in zip(held, rows[1:]) if row[3] > 2]
        print(f"\nfit shape (in-sample): error {fit['error']:+.1%}")
        print(summary("held out, 2 processes", two) + f" (target {HELD_OUT_TARGET:.0%})")
        if four:
            print(summary("held out, 4 processes (oversubscribed, no bound)", four))
        print(f"benchmark took {time.perf_counter() - start_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
