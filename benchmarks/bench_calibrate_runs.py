"""What `meshplan calibrate --from-runs` is worth: a handful of one cluster's published runs used
as a user's own measured runs, and that cluster's other runs scored before and after.

    python benchmarks/bench_calibrate_runs.py [--runs N] [CLUSTER ...]

For each cluster (default: h100-sxm, a100-40g and gb200-nvl72, whose profile borrows H100's
efficiencies; the held-out BF16 runs of `published_runs.py`,
which never tuned the shipped profiles), N runs (default 5) spread over the cluster's list are
taken as the user's runs and the profile's efficiency fields are fitted to them with
`planner.calibration.user_runs.fit_user_runs`, the code behind the command. Printed: the fit's
leave-one-out figures over those N runs, and the mean |step error| of the cluster's remaining
runs with the shipped profile and with the fitted one. The shipped profiles are not changed:
this is a user's fit, on the user's runs, as the command makes it.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from fit_efficiency import predictions, published_step_s  # noqa: E402
from published_runs import HELD_OUT, Run, all_runs  # noqa: E402

DEFAULT_CLUSTERS = ("h100-sxm", "a100-40g", "gb200-nvl72")


def predicted_s(run: Run, cluster) -> float:
    """The step at the geometric mean over the run's unpublished layout options."""
    logs = [math.log(p.step_time_s) for p in predictions(run, cluster)]
    return math.exp(sum(logs) / len(logs))


def user_run(run: Run):
    from meshplan.planner.calibration.user_runs import UserRun

    return UserRun(run.name, published_step_s(run), lambda cluster, run=run: predicted_s(run, cluster))


def spread(runs: list[Run], count: int) -> tuple[list[Run], list[Run]]:
    """`count` runs evenly spaced over the list (the user's), and the rest."""
    picks = sorted({round(i * (len(runs) - 1) / max(1, count - 1)) for i in range(count)})
    return [runs[i] for i in picks], [run for i, run in enumerate(runs) if i not in picks]


def bench(cluster_name: str, count: int) -> None:
    from meshplan.planner.calibration.user_runs import fit_user_runs
    from meshplan.planner.costing.hardware import load_cluster

    base = load_cluster(cluster_name)
    runs = [run for run in all_runs() if run.group == HELD_OUT and run.cluster == cluster_name]
    mine, others = spread(runs, count)
    fit = fit_user_runs([user_run(run) for run in mine], base, f"{cluster_name}-mine")
    print(f"\n== {cluster_name}: fitted to {len(mine)} of its {len(runs)} published runs ==")
    print("  " + ", ".join(f"{k} {getattr(base.device, k):.4g} -> {v:.4g}" for k, v in fit.values.items()))
    print(f"  leave-one-out over the {len(mine)} runs: mean |error| {fit.mean_abs_error(False):.1%} shipped, "
          f"{fit.mean_abs_error(True):.1%} fitted without the run")
    for row in fit.left_out:
        print(f"    {row.name:<44} {row.error_before:+7.1%} -> {row.error_after:+7.1%}")
    before = [abs(predicted_s(run, base) / published_step_s(run) - 1) for run in others]
    after = [abs(predicted_s(run, fit.profile) / published_step_s(run) - 1) for run in others]
    print(f"  the other {len(others)} runs: mean |error| {np.mean(before):.1%} shipped -> {np.mean(after):.1%} fitted "
          f"(max {max(before):.1%} -> {max(after):.1%})")


def main(argv: list[str]) -> int:
    count = int(argv[argv.index("--runs") + 1]) if "--runs" in argv else 5
    names = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] != "--runs")]
    start = time.perf_counter()
    for name in names or DEFAULT_CLUSTERS:
        bench(name, count)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
