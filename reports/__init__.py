"""meshplan reports: one self-contained HTML file per plan (plotly.js inlined once, opens offline).

    from meshplan.reports import write_report
    write_report("plan.json", measurements=["measured.json"], out="report.html")

`plan` is a `Plan` or a path; `measurements` are `Measurement`s or paths to `meshplan train`
output; `trace` is a path to `meshplan simulate --trace` output (without it the simulator
re-plays the plan). Reports never import the executor.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence


def build_report(plan, measurements: Sequence = (), trace=None, title: str | None = None,
                 sizing: dict | None = None, others: Sequence = ()) -> str:
    """The report's HTML text. `sizing`: the plan JSON's `sizing` (read from the file when `plan` is a
    path); `others`: more plans (or paths) shown side by side with this one."""
    from meshplan.reports.build import build_report as _build

    return _build(plan, measurements, trace, title, sizing, others)


def write_report(plan, measurements: Sequence = (), trace=None, out: str | Path = "report.html",
                 title: str | None = None, sizing: dict | None = None, others: Sequence = ()) -> Path:
    """Write the report to `out` and return its path."""
    out = Path(out)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    from meshplan.planner.contracts.atomicfile import write_text_atomic

    write_text_atomic(out, build_report(plan, measurements, trace, title, sizing, others), "report")
    return out


__all__ = ["build_report", "write_report"]
