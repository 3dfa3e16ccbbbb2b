"""Predicted vs measured: compare `meshplan train` runs (`planner.contracts.measurement`) with a
plan's prediction, step time and peak memory per rank."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.measurement import Measurement

# Above this relative error of the median step time the report flags the prediction as off
# (meshplan's accuracy target for predicted step time).
DEFAULT_FLAG_FRACTION = 0.15
# Above this relative error of a rank's peak memory (the memory model's target on CPU processes,
# tests/executor/test_memory_prediction.py).
MEMORY_FLAG_FRACTION = 0.10


@dataclass(frozen=True)
class RankMemory:
    """Predicted vs measured peak memory of one global rank."""

    rank: int
    pipeline_rank: int
    predicted_bytes: float
    measured_bytes: float

    @property
    def error_fraction(self) -> float:
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


@dataclass(frozen=True)
class Comparison:
    """Predicted vs measured over one or more runs of the same plan."""

    predicted_step_time_s: float
    measured_median_s: float  # median over all runs' timed steps
    measured_min_s: float
    measured_max_s: float
    measured_stdev_s: float
    per_run_median_s: tuple[float, ...]
    memory: tuple[RankMemory, ...]
    flag_fraction: float = DEFAULT_FLAG_FRACTION
    memory_flag_fraction: float = MEMORY_FLAG_FRACTION
    memory_source: str = ""  # how the last run measured its peaks (Measurement.memory_source)
    busy: tuple[str, ...] = ()  # runs measured while other work loaded the host (`busy_runs`)
    calibration: tuple[str, ...] = ()  # why the profile's calibration cannot judge the runs (`calibration_notes`)

    @property
    def error_fraction(self) -> float:
        """(predicted - measured) / measured: positive means the prediction is pessimistic."""
        return (self.predicted_step_time_s - self.measured_median_s) / self.measured_median_s

    @property
    def flagged(self) -> bool:
        return abs(self.error_fraction) > self.flag_fraction

    def memory_flagged(self, rank_memory: RankMemory) -> bool:
        return abs(rank_memory.error_fraction) > self.memory_flag_fraction

    @property
    def spread_fraction(self) -> float:
        """How noisy the measurement is: the larger of the timed steps' coefficient of variation
        (stdev / median) and the spread of the runs' medians ((max - min) / median over runs)."""
        cv = self.measured_stdev_s / self.measured_median_s
        medians = self.per_run_median_s
        runs = (max(medians) - min(medians)) / self.measured_median_s if len(medians) > 1 else 0.0
        return max(cv, runs)

    @property
    def too_noisy(self) -> bool:
        """The machine varied more than the error being judged: the step times spread by more than
        the flag threshold, so a prediction within it cannot be told from one outside it; or other
        work loaded the host while it measured (`busy`), which the calibrated profile does not
        price (calibration times compute in the process's own CPU seconds); or the profile's
        calibration was disturbed or measured other processes than the runs (`calibration`)."""
        return self.spread_fraction > self.flag_fraction or bool(self.busy) or bool(self.calibration)


def check_measurements(plan, measurements: Sequence[Measurement]) -> None:
    """Refuse runs of another plan or another world size: their comparison would mean nothing."""
    for run in measurements:
        if not run.step_times_s:
            raise MeshplanError(f"{run.source}: no step times; train at least one step (meshplan train --steps N)")
        if run.world_size != plan.config.gpus:
            raise MeshplanError(f"{run.source} was measured on {run.world_size} process(es) but the plan is for "
                                f"{plan.config.gpus}; pass the measured file of this plan")
        if run.plan_digest and run.plan_digest != plan.digest:
            raise MeshplanError(f"{run.source} was measured for plan {run.plan_digest} but this plan is "
                                f"{plan.digest}; retrain it with `meshplan train --plan` on this plan file")


def busy_runs(measurements: Sequence[Measurement]) -> tuple[str, ...]:
    """One sentence per CPU run whose host other work loaded while it trained (`calibration.host.
    busy_host` on the 1-minute load average the worker recorded at the end, `host.load_avg_1m`;
    GPU steps are timed on the device)."""
    from meshplan.planner.calibration.host import busy_host

    out = []
    for run in measurements:
        host = run.host if isinstance(run.host, dict) else {}
        load, cpus = host.get("load_avg_1m"), host.get("cpu_count")
        if not isinstance(load, (int, float)) or not isinstance(cpus, int) or run.device != "cpu":
            continue
        text = busy_host(float(load), cpus, run.world_size)
        if text:
            out.append(f"{run.source}: {text}")
    return tuple(out)


def calibration_notes(plan, measurements: Sequence[Measurement]) -> tuple[str, ...]:
    """Why the plan's calibrated profile cannot judge its CPU runs (`calibration.host.
    calibration_problems` on the profile's `calibration` table against each run's world size and
    threads); () for a profile calibrate did not measure and for GPU runs."""
    from meshplan.planner.calibration.host import calibration_problems

    conditions = getattr(plan.cluster, "calibration", None)
    out: list[str] = []
    for run in measurements:
        if conditions is None or run.device != "cpu":
            continue
        host = run.host if isinstance(run.host, dict) else {}
        threads = host.get("threads_per_process")
        for problem in calibration_problems(conditions, run.world_size, threads if isinstance(threads, int) else None):
            if problem not in out:
                out.append(problem)
    return tuple(out)


def compare(plan, measurements: Sequence[Measurement],
            flag_fraction: float = DEFAULT_FLAG_FRACTION,
            memory_flag_fraction: float = MEMORY_FLAG_FRACTION) -> Comparison:
    """Compare a plan's prediction with its measured runs. Memory: each global rank's measured
    peak against the predicted peak of its pipeline stage (rank r is on stage r // (dp * tp):
    the mesh is (pp, dp, tp), tp innermost, as the executor builds it)."""
    if not measurements:
        raise ValueError("compare needs at least one measurement")
    check_measurements(plan, measurements)
    prediction = plan.prediction or {}
    predicted = float(prediction["step_time_s"])
    steps = [t for run in measurements for t in run.timed_steps_s]
    predicted_per_pp = [float(m["total"]) for m in prediction.get("memory_bytes") or ()]
    ranks_per_stage = plan.config.dp * plan.config.tp
    memory = []
    # The last run's memory: peak memory is deterministic across runs of one plan, the step time is not.
    last = measurements[-1]
    for rank, measured in enumerate(last.peak_memory_bytes_per_rank):
        pipeline_rank = rank // ranks_per_stage
        if pipeline_rank < len(predicted_per_pp) and measured > 0:
            memory.append(RankMemory(rank, pipeline_rank, predicted_per_pp[pipeline_rank], measured))
    return Comparison(
        predicted_step_time_s=predicted, measured_median_s=statistics.median(steps),
        measured_min_s=min(steps), measured_max_s=max(steps),
        measured_stdev_s=statistics.stdev(steps) if len(steps) > 1 else 0.0,
        per_run_median_s=tuple(run.median_step_time_s for run in measurements),
        memory=tuple(memory), flag_fraction=flag_fraction, memory_flag_fraction=memory_flag_fraction,
        memory_source=last.memory_source or "", busy=busy_runs(measurements),
        calibration=calibration_notes(plan, measurements))
