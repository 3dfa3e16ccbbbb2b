"""Calibration on training's clock: what `calibrate` records of the conditions it measured under
(`contracts.cluster.CalibrationConditions`), and how it combines repeated rounds.

Training on CPU runs `world size` processes at once, each with `calibration.host.threads_per_process`
threads, and times its steps in wall-clock seconds. Calibration runs the same processes with the
same threads, all measuring at once, and repeats each measurement in rounds: compute
(`compute_bench.COMPUTE_ROUNDS`, the process's CPU seconds per thread, which preemption does not inflate)
and the collectives (`COLLECTIVE_ROUNDS`, wall clock, as the steps that wait on them). Each figure
is the median of its rounds, and the rounds' spread ((max - min) / median, the median over the
figures) is recorded with the host's load average, so a report can say when a calibration was too
disturbed to judge a run by (`host.calibration_problems`).
"""
from __future__ import annotations

import os
import statistics

from meshplan.planner.calibration.host import relative_spread
from meshplan.planner.contracts.cluster import CalibrationConditions

COLLECTIVE_ROUNDS = 3


def median_of_rounds(rounds: list[list[tuple]]) -> tuple[list[tuple], float]:
    """Samples `(key..., seconds)` repeated in rounds (same keys, same order) -> each key's median
    seconds, and the median over keys of the rounds' relative spread."""
    if not rounds:
        return [], 0.0
    combined, spreads = [], []
    for samples in zip(*rounds):
        seconds = [sample[-1] for sample in samples]
        combined.append((*samples[0][:-1], statistics.median(seconds)))
        spreads.append(relative_spread(seconds))
    return combined, statistics.median(spreads) if spreads else 0.0


def load_average() -> float:
    """The host's 1-minute load average (0 where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def calibration_conditions(measured: dict, nproc: int, backend: str, compute_rounds: int) -> CalibrationConditions:
    """The conditions rank 0 recorded (`runner._worker`) as the profile's `[calibration]` table."""
    cuda = backend == "nccl"
    return CalibrationConditions(
        processes=nproc, threads_per_process=int(measured.get("threads", 1)), dtype=measured["dtype"],
        rounds=min(compute_rounds, COLLECTIVE_ROUNDS), compute_clock="cuda-events" if cuda else "cpu-time",
        link_clock="cuda-events" if cuda else "wall", compute_spread=float(measured.get("compute_spread", 0.0)),
        link_spread=float(measured.get("link_spread", 0.0)), load_avg_1m=float(measured.get("load_avg_1m", 0.0)),
        num_cpus=os.cpu_count() or 0)
