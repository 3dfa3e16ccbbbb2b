"""The alternatives section: what the planner considered, and why each runner-up lost.

An alternative in `plan.json` is a complete runnable configuration with its `prediction`. Its
configuration is read either plan-shaped (`mesh: {pp, dp, tp}`, `schedule: {name, microbatches,
microbatch_size, virtual_stages}`) or flat like `ParallelConfig` (`pp`, `dp`, `tp`, `schedule`,
`microbatch_size`, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.planner.contracts.axes import AXES
from meshplan.reports import figures
from meshplan.reports.html import Cell, Section, figure_div, fmt_bytes, fmt_ms, fmt_pct, paragraph, table

_REASON_KEYS = ("why_not", "reason", "why")


@dataclass(frozen=True)
class Candidate:
    """One configuration as the report shows it."""

    label: str
    step_time_s: float
    peak_memory_bytes: float
    fits: bool
    winner: bool
    breakdown: dict[str, float]
    stated_reason: str = ""


def _get(data: dict[str, Any], *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def config_label(data: dict[str, Any]) -> str:
    """'pp2 dp1 tp1, 1f1b x4 (mbs 1), ZeRO-0, recompute none' from either configuration shape."""
    mesh = data.get("mesh") if isinstance(data.get("mesh"), dict) else data
    schedule = data.get("schedule")
    if isinstance(schedule, dict):
        name, mbs = schedule.get("name", "?"), schedule.get("microbatch_size", data.get("microbatch_size", "?"))
        count, vpp = schedule.get("microbatches", data.get("num_microbatches")), schedule.get("virtual_stages", 1)
    else:
        name, mbs = schedule or "?", data.get("microbatch_size", "?")
        count, vpp = data.get("num_microbatches"), data.get("virtual_stages", 1)
    degrees = " ".join(f"{axis.name}{mesh.get(axis.name, '?')}" for axis in AXES  # optional axes only when on
                       if axis.shown(mesh))
    text = f"{degrees}, {name}"
    if count:
        text += f" x{count}"
    text += f" (mbs {mbs})"
    if vpp and int(vpp) > 1:
        text += f" vpp{vpp}"
    text += f", ZeRO-{data.get('zero', 0)}"
    if data.get("shard_group"):
        text += f" HSDP shard {data['shard_group']}"
    if data.get("sp"):
        text += ", SP"
    recompute = data.get("recompute")
    summary = data.get("recompute_summary")
    if isinstance(summary, dict) and sum(1 for v in summary.values() if v) > 1:
        recompute = " + ".join(f"{count} {level}" for level, count in summary.items() if count)
    elif isinstance(data.get("layers"), list):
        levels = [layer.get("recompute", "none") for layer in data["layers"]]
        recompute = " + ".join(f"{levels.count(r)} {r}" for r in ("none", "selective", "full") if r in levels)
        if len(set(levels)) == 1:
            recompute = levels[0]
    return text + f", recompute {recompute or 'none'}"


def candidates(plan) -> list[Candidate]:
    """The chosen plan first, then its alternatives."""
    winner_pred = plan.prediction or {}
    winner_json = plan.to_json()
    out = [Candidate(config_label(winner_json), float(winner_pred.get("step_time_s", 0.0)),
                     float(winner_pred.get("peak_memory_bytes", 0.0)), bool(winner_pred.get("fits", True)), True,
                     dict(winner_pred.get("breakdown") or {}))]
    for alt in plan.alternatives:
        pred = alt.get("prediction") or {}
        if "step_time_s" not in pred:
            continue
        reason = next((str(alt[k]) for k in _REASON_KEYS if alt.get(k)), "")
        out.append(Candidate(config_label(alt), float(pred["step_time_s"]), float(pred.get("peak_memory_bytes", 0.0)),
                             bool(pred.get("fits", True)), False, dict(pred.get("breakdown") or {}), reason))
    return out


def why_lost(candidate: Candidate, winner: Candidate, usable_bytes: float) -> str:
    """Why a runner-up lost: the planner's own reason if it gave one, else computed from the predictions."""
    if candidate.winner:
        return "chosen: fastest predicted step that fits"
    if candidate.stated_reason:
        return candidate.stated_reason
    parts = []
    if not candidate.fits or candidate.peak_memory_bytes > usable_bytes:
        parts.append(f"does not fit: needs {fmt_bytes(candidate.peak_memory_bytes)} per GPU, "
                     f"{fmt_bytes(usable_bytes)} usable")
    else:
        delta_s = candidate.step_time_s - winner.step_time_s
        text = f"slower by {fmt_ms(delta_s)} ({fmt_pct(delta_s / winner.step_time_s, signed=True)})"
        deltas = {k: candidate.breakdown.get(k, 0.0) - winner.breakdown.get(k, 0.0)
                  for k in set(candidate.breakdown) | set(winner.breakdown)}
        if deltas and max(deltas.values()) > 0:
            cause = max(deltas, key=deltas.get)
            text += f", mostly more {cause} (+{fmt_ms(deltas[cause])})"
        if delta_s <= 0:
            text = "as fast or faster but ranked lower by the simulator's re-ranking"
        parts.append(text)
    return "; ".join(parts)


def alternatives_section(plan) -> Section:
    usable = float(plan.solver.get("usable_memory_bytes") or plan.cluster.device.usable_memory_bytes)
    found = candidates(plan)
    winner = found[0]
    if len(found) == 1:
        body = paragraph("The plan lists no alternatives (it was given a fixed configuration, or nothing else fit).")
    else:
        body = ""
    ranked = [winner] + sorted(found[1:], key=lambda c: (not c.fits, c.step_time_s))
    rows = [[Cell(c.label, "winner" if c.winner else ""), fmt_ms(c.step_time_s),
             fmt_bytes(c.peak_memory_bytes), Cell("yes" if c.fits else "no", "ok" if c.fits else "flag"),
             why_lost(c, winner, usable)] for c in ranked]
    body += table(["configuration", "predicted step", "peak memory per GPU", "fits", "why"], rows)
    points = [dict(label=c.label, step_time_s=c.step_time_s, peak_memory_bytes=c.peak_memory_bytes,
                   fits=c.fits, winner=c.winner) for c in found]
    fig = figures.alternatives_scatter(points, plan.cluster.device.memory_bytes)
    body += f'<div class="fig">{figure_div(fig, "fig-alternatives")}</div>'
    return Section("alternatives", "Alternatives considered", body)
