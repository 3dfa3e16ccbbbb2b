"""Sizing: how long and how much a training run takes, and how many GPUs meet a deadline.

    days      = tokens / tokens_per_s / 86400          (tokens_per_s of the whole job)
    GPU-hours = days * 24 * gpus
    cost      = GPU-hours * usd_per_gpu_hour

The sweep plans node-sized multiples (one node, two, four, ... up to the largest count asked
for) in increasing order and stops one size past the first that meets the deadline: a larger
cluster only adds scaling loss (more communication, more bubble), so the cheapest plan that
meets the deadline is among the smallest that do.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from meshplan.planner.contracts.errors import MeshplanError

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class TrainingCost:
    """One cluster size: its step and what training on `tokens` costs with it."""

    gpus: int
    tokens: float
    step_time_s: float
    tokens_per_s: float
    days: float
    gpu_hours: float
    usd: float | None = None
    label: str = ""  # the plan's configuration
    # The step's held-out error band (`costing.error_bands`: error_low, error_high); time and cost
    # scale with the step, so they carry it too. None: no band measured.
    step_error_band: tuple[float, float] | None = None

    def __post_init__(self):
        if self.gpus <= 0 or self.tokens <= 0 or self.tokens_per_s <= 0:
            raise ValueError(f"gpus, tokens and tokens/s must be positive: {self.gpus}, {self.tokens}, "
                             f"{self.tokens_per_s}")
        if self.step_error_band is not None and not -1 < self.step_error_band[0] <= self.step_error_band[1]:
            raise ValueError(f"step error band {self.step_error_band} is not a band")

    def likely(self, value: float) -> tuple[float, float] | None:
        """(low, high) of a figure proportional to the step, from the band."""
        if self.step_error_band is None:
            return None
        low, high = self.step_error_band
        return value / (1 + high), value / (1 + low)

    def to_json(self) -> dict:
        data = asdict(self)
        if self.step_error_band is not None:
            data.update(days_range=self.likely(self.days), gpu_hours_range=self.likely(self.gpu_hours),
                        usd_range=self.likely(self.usd) if self.usd is not None else None)
        return data


@dataclass(frozen=True)
class Sizing:
    """The sizes tried (the time/cost frontier) and the one chosen for the deadline."""

    rows: tuple[TrainingCost, ...]
    deadline_days: float | None = None
    chosen: TrainingCost | None = None
    skipped: tuple[str, ...] = ()  # sizes that had no plan, with why

    def __post_init__(self):
        if self.chosen is not None and self.chosen not in self.rows:
            raise ValueError(f"the chosen size ({self.chosen.gpus} GPUs) must be one of the sizes tried")

    def to_json(self) -> dict:
        return {"deadline_days": self.deadline_days, "chosen_gpus": self.chosen.gpus if self.chosen else None,
                "frontier": [row.to_json() for row in self.rows], "skipped": list(self.skipped)}


def training_cost(gpus: int, tokens: float, tokens_per_s: float, step_time_s: float,
                  usd_per_gpu_hour: float | None = None, label: str = "",
                  step_error_band: tuple[float, float] | None = None) -> TrainingCost:
    if not tokens > 0:
        raise MeshplanError(f"--train-tokens must be positive, got {tokens}")
    if usd_per_gpu_hour is not None and not usd_per_gpu_hour > 0:
        raise MeshplanError(f"--usd-per-gpu-hour must be positive, got {usd_per_gpu_hour}")
    days = tokens / tokens_per_s / SECONDS_PER_DAY
    gpu_hours = days * 24.0 * gpus
    usd = gpu_hours * usd_per_gpu_hour if usd_per_gpu_hour is not None else None
    return TrainingCost(gpus=gpus, tokens=tokens, step_time_s=step_time_s, tokens_per_s=tokens_per_s, days=days,
                        gpu_hours=gpu_hours, usd=usd, label=label, step_error_band=step_error_band)


def sweep_counts(gpus_per_node: int, max_gpus: int) -> list[int]:
    """One node, two, four, ... up to `max_gpus`, and `max_gpus` itself; below one node, `max_gpus` alone."""
    if max_gpus <= gpus_per_node:
        return [max_gpus]
    counts, count = [], gpus_per_node
    while count < max_gpus:
        counts.append(count)
        count *= 2
    return counts + [max_gpus]


def ceiling_tokens_per_s(gpus: int, executed_flops_per_token: float, peak_flops_per_s: float) -> float:
    """No plan on `gpus` GPUs trains faster than this: every executed FLOP (causal attention as
    run, no recomputation: `costing.flops`) shared perfectly over the GPUs, each at its achievable
    ceiling (`peak_flops_per_s`: the cost model's peak x matmul_efficiency, which every GEMM's
    efficiency curve stays below), with no communication, bubble or memory-bound work."""
    return gpus * peak_flops_per_s / executed_flops_per_token


def size_cluster(counts: list[int], cost_at: Callable[[int], TrainingCost], deadline_days: float,
                 ceiling_at: Callable[[int], float] | None = None, tokens: float = 0.0) -> Sizing:
    """Cost each count in increasing order (`cost_at` raises MeshplanError when a count has no
    plan) until one size past the first that meets the deadline; the cheapest that meets it wins.
    `ceiling_at(gpus)`: an upper bound on tokens/s (`ceiling_tokens_per_s`); a count whose ceiling
    cannot train `tokens` within the deadline is skipped without planning, and said so."""
    if not deadline_days > 0:
        raise MeshplanError(f"--deadline-days must be positive, got {deadline_days}")
    rows, skipped, met_at = [], [], None
    for index, count in enumerate(sorted(set(counts))):
        if met_at is not None and index > met_at + 1:
            break
        if ceiling_at is not None and tokens > 0:
            ceiling = ceiling_at(count)  # profiles the model: once per count
            best_days = tokens / ceiling / 86400
            if best_days > deadline_days:
                skipped.append(f"{count} GPUs: cannot meet the deadline (at least {best_days:.1f} days even at "
                               f"{ceiling:,.0f} tokens/s, the device's compute ceiling); not planned")
                continue
        try:
            row = cost_at(count)
        except MeshplanError as exc:
            skipped.append(f"{count} GPUs: {exc}")
            continue
        rows.append(row)
        if met_at is None and row.days <= deadline_days:
            met_at = index
    meeting = [row for row in rows if row.days <= deadline_days]
    chosen = min(meeting, key=lambda row: (row.gpu_hours, row.gpus)) if meeting else None
    return Sizing(rows=tuple(rows), deadline_days=deadline_days, chosen=chosen, skipped=tuple(skipped))
