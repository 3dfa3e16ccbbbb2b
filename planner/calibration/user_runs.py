"""A cluster profile fitted to a user's own measured runs (`meshplan calibrate --from-runs`).

Each run is something meshplan can predict on any profile (an engine config or a plan) and the
step time measured for it (a measured.json or an engine's log). The profile's efficiency fields
are fitted to the runs: the objective is the sum of squared log step-time errors,
log(predicted / measured), minimised by a bounded Levenberg-Marquardt in [0, 1]-scaled
coordinates with forward differences (`least_squares`, also the published fits' solver). Fewer
runs fit fewer fields: one field for every `RUNS_PER_FIELD` runs, in the order of
`FITTED_FIELDS` (the GEMMs' share of peak first: it moves every step; then the non-GEMM kernels'
traffic). Leave-one-out cross-validation says what the fit is worth: each run predicted by a
profile fitted to the others, against the profile the fit started from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from meshplan.planner.contracts.cluster import ClusterProfile, FittedRuns
from meshplan.planner.contracts.errors import MeshplanError


@dataclass(frozen=True)
class Field:
    """One fitted device field, bounded, optionally log-scaled."""

    name: str
    lower: float
    upper: float
    log: bool = False

    def to_unit(self, value: float) -> float:
        value = min(self.upper, max(self.lower, value))
        if self.log:
            return math.log(value / self.lower) / math.log(self.upper / self.lower)
        return (value - self.lower) / (self.upper - self.lower)

    def from_unit(self, unit: float) -> float:
        unit = min(1.0, max(0.0, unit))
        if self.log:
            return self.lower * (self.upper / self.lower) ** unit
        return self.lower + unit * (self.upper - self.lower)


FITTED_FIELDS = (Field("matmul_efficiency", 0.2, 0.98), Field("elementwise_bytes_per_activation_byte", 0.5, 6.0))
RUNS_PER_FIELD = 3  # a field is fitted only with at least this many runs per field
MIN_RUNS = 2  # leave-one-out needs a run to leave out and one to fit on


@dataclass(frozen=True)
class UserRun:
    """One measured run: `predict_s(profile)` is meshplan's step time for it on a profile."""

    name: str
    measured_step_s: float
    predict_s: Callable[[ClusterProfile], float]
    regime: str = ""  # the error band's regime its prediction belongs to (`costing.error_bands.regime_of`)

    def __post_init__(self):
        if not self.measured_step_s > 0:
            raise ValueError(f"{self.name}: the measured step must be positive, got {self.measured_step_s}")


@dataclass(frozen=True)
class LeftOut:
    """A run predicted by the starting profile and by one fitted without it."""

    name: str
    measured_s: float
    before_s: float
    after_s: float

    @property
    def error_before(self) -> float:
        return self.before_s / self.measured_s - 1

    @property
    def error_after(self) -> float:
        return self.after_s / self.measured_s - 1


@dataclass(frozen=True)
class RunFit:
    """The fitted fields, every run's leave-one-out figures, and the profile written."""

    values: dict[str, float]
    left_out: tuple[LeftOut, ...]
    profile: ClusterProfile

    def mean_abs_error(self, after: bool) -> float:
        return float(np.mean([abs(r.error_after if after else r.error_before) for r in self.left_out]))


def fields_for(num_runs: int) -> tuple[Field, ...]:
    return FITTED_FIELDS[:max(1, min(len(FITTED_FIELDS), num_runs // RUNS_PER_FIELD))]


def with_fields(cluster: ClusterProfile, values: dict[str, float]) -> ClusterProfile:
    return replace(cluster, device=replace(cluster.device, **values))


def fit_fields(runs: Sequence[UserRun], cluster: ClusterProfile, fields: Sequence[Field]) -> dict[str, float]:
    """The fields' values minimising the runs' squared log step errors, from the profile's own."""
    def residual_fn(unit: np.ndarray) -> np.ndarray:
        trial = with_fields(cluster, {f.name: f.from_unit(u) for f, u in zip(fields, unit)})
        return np.asarray([math.log(run.predict_s(trial) / run.measured_step_s) for run in runs])

    start = np.array([f.to_unit(getattr(cluster.device, f.name)) for f in fields])
    unit = least_squares(residual_fn, start)
    return {f.name: float(f.from_unit(u)) for f, u in zip(fields, unit)}


def fit_user_runs(runs: Sequence[UserRun], cluster: ClusterProfile, name: str) -> RunFit:
    """The profile fitted to all runs (named `name`, its fit set in the device's source), and
    the leave-one-out figures."""
    if len(runs) < MIN_RUNS:
        raise MeshplanError(f"calibrate --from-runs needs at least {MIN_RUNS} runs (one is left out in turn to "
                            f"check the fit), got {len(runs)}")
    fields = fields_for(len(runs))
    left_out = []
    for index, run in enumerate(runs):
        others = [other for j, other in enumerate(runs) if j != index]
        fitted = with_fields(cluster, fit_fields(others, cluster, fields_for(len(others))))
        left_out.append(LeftOut(run.name, run.measured_step_s, run.predict_s(cluster), run.predict_s(fitted)))
    values = fit_fields(runs, cluster, fields)
    fit = RunFit(values, tuple(left_out), cluster)
    source = (f"{cluster.device.source}; {', '.join(f'{k} {v:.4g}' for k, v in values.items())} fitted by meshplan "
              f"calibrate --from-runs to {len(runs)} measured runs ({', '.join(run.name for run in runs)}); "
              f"leave-one-out mean |step error| {fit.mean_abs_error(True):.1%} (from {fit.mean_abs_error(False):.1%})")
    profile = replace(with_fields(cluster, values), name=name, fitted_runs=fitted_runs(fit.left_out, runs))
    profile = replace(profile, device=replace(profile.device, source=source.lstrip("; ")))
    return replace(fit, profile=profile)


def fitted_runs(left_out: Sequence[LeftOut], runs: Sequence[UserRun]) -> FittedRuns:
    """The profile's record of its fit: the leave-one-out errors as a band, by the held-out bands'
    rule (`costing.error_bands.error_range`), and the regimes the runs ran in."""
    from meshplan.planner.costing.error_bands import error_range

    low, high = error_range([r.error_after for r in left_out])
    return FittedRuns(len(left_out), low, high, " ".join(sorted({run.regime for run in runs if run.regime})))


def least_squares(residual_fn: Callable[[np.ndarray], np.ndarray], start: np.ndarray, max_iter: int = 25,
                  step: float = 1e-2, tol: float = 1e-7) -> np.ndarray:
    """Bounded Levenberg-Marquardt on [0, 1]^n: minimise |residual_fn(u)|^2, u clipped to the box.
    Forward differences of `step` (backward at the upper bound)."""
    unit = np.clip(np.asarray(start, dtype=float), 0.0, 1.0)
    res = residual_fn(unit)
    cost, damping = float(res @ res), 1e-3
    for _ in range(max_iter):
        if cost < 1e-12:  # every log error under 1e-6: nothing left to fit
            break
        jac = np.empty((res.size, unit.size))
        for j in range(unit.size):
            delta = step if unit[j] + step <= 1.0 else -step
            moved = unit.copy()
            moved[j] += delta
            jac[:, j] = (residual_fn(moved) - res) / delta
        gradient, normal = jac.T @ res, jac.T @ jac
        improved = False
        while damping < 1e8:
            lhs = normal + damping * np.diag(np.diag(normal) + 1e-9)
            trial = np.clip(unit - np.linalg.solve(lhs, gradient), 0.0, 1.0)
            trial_res = residual_fn(trial)
            trial_cost = float(trial_res @ trial_res)
            if trial_cost < cost:
                improved, gain = True, cost - trial_cost
                unit, res, cost, damping = trial, trial_res, trial_cost, max(damping / 3, 1e-9)
                break
            damping *= 4
        if not improved or gain < tol * max(cost, 1e-12):
            break
    return unit
