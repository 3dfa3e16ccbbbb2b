"""Assemble a report: read inputs, get the step timeline, build every section, wrap it in a page."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

from meshplan.planner.contracts.errors import MeshplanError, PlanNeedsModelCode
from meshplan.planner.contracts.plan import Plan, load_plan
from meshplan.reports.alternatives import alternatives_section
from meshplan.planner.contracts.measurement import Measurement, load_measurement
from meshplan.reports.compare import check_measurements, compare
from meshplan.reports.html import page
from meshplan.reports.measured import measured_section
from meshplan.reports.plans import as_plans, plans_section
from meshplan.reports.sections import (breakdown_section, frontier_section, layers_section, memory_section,
                                       summary_section, timeline_section)
from meshplan.reports.timeline import load_trace, simulate_timeline, with_idle


def _as_plan(plan) -> tuple[Plan, str]:
    if isinstance(plan, Plan):
        return plan, f"(plan {plan.digest})"
    return load_plan(plan), Path(plan).name


def _sizing_of(plan) -> dict[str, Any] | None:
    """The `sizing` key of a plan file (`plan --train-tokens`; `Plan` itself does not keep it)."""
    if isinstance(plan, Plan):
        return None
    from meshplan.planner.contracts.jsonfile import read_json_file

    data = read_json_file(plan, "plan", "create a plan with `meshplan plan --out plan.json`")
    sizing = data.get("sizing") if isinstance(data, dict) else None
    return sizing if isinstance(sizing, dict) else None


def _as_measurements(measurements: Sequence) -> list[Measurement]:
    return [m if isinstance(m, Measurement) else load_measurement(m) for m in measurements]


def _timeline(plan: Plan, trace) -> tuple[list, Sequence, dict[str, Any] | None, str]:
    """(intervals, memory timeline, simulated prediction or None, where they came from)."""
    if trace is not None:
        if isinstance(trace, (str, Path)):
            intervals, memory_timeline = load_trace(trace)
            return intervals, memory_timeline, None, f"trace file {Path(trace).name}"
        return list(trace), (), None, "timeline given by the caller"
    try:
        simulated = simulate_timeline(plan)
    except PlanNeedsModelCode:
        raise  # the plan's model is user code it does not carry: refused, never run
    except (MeshplanError, ValueError) as exc:
        return [], (), None, f"the simulator could not re-play this plan ({exc})"
    if simulated is None:
        return [], (), None, "the simulator is not available in this installation; pass --trace"
    return list(simulated.timeline), simulated.memory_timeline, simulated.to_json(), "the simulator re-playing the plan"


def build_report(plan, measurements: Sequence = (), trace=None, title: str | None = None,
                 sizing: dict[str, Any] | None = None, others: Sequence = ()) -> str:
    sizing = sizing if sizing is not None else _sizing_of(plan)
    compared = as_plans([plan, *others]) if others else []
    plan, source_name = _as_plan(plan)
    runs = _as_measurements(measurements)
    check_measurements(plan, runs)  # before the (slower) simulation: a wrong file fails fast
    intervals, memory_timeline, simulated, source_note = _timeline(plan, trace)
    prediction = plan.prediction or simulated
    if not prediction or "step_time_s" not in prediction:
        raise MeshplanError("the plan carries no prediction and the simulator could not make one; "
                            "create the plan with `meshplan plan`")
    if plan.prediction is None:
        plan = plan.with_prediction(prediction)
    intervals = with_idle(intervals, float(prediction["step_time_s"]))
    comparison = compare(plan, runs) if runs else None
    sections = [
        summary_section(plan, prediction, source_name, comparison,
                        statistics.median(m.tokens_per_s for m in runs) if runs else None),
        layers_section(plan),
        memory_section(plan, prediction, memory_timeline),
        timeline_section(intervals, prediction, source_note),
        breakdown_section(plan, prediction),
        alternatives_section(plan),
    ]
    if sizing:
        sections.insert(1, frontier_section(sizing))
    if compared:
        sections.insert(0, plans_section(compared))
    if comparison is not None:
        sections.append(measured_section(comparison, runs, plan))
    import plotly.offline

    heading = title or f"meshplan report: {plan.model.spec} on {plan.config.gpus} x {plan.cluster.device.name}"
    subtitle = f"{plan.cluster.name}, mesh {plan.config.mesh_label()}, plan {plan.digest}"
    return page(heading, subtitle, sections, plotly.offline.get_plotlyjs())
