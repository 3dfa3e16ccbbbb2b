"""Plans side by side: `meshplan compare a.json b.json` and `meshplan report --plan a.json --plan b.json`.

`plan_facts` reduces a plan to the figures a reader compares (mesh, schedule, ZeRO, step time,
MFU, memory, throughput) as display strings; a fact whose text differs between the plans is a
difference. Plans without a prediction (hand-written ones) are simulated. No plotly here, so the
CLI's table stays light; the report section draws its figure through `reports.figures`.
"""
from __future__ import annotations

from typing import Any, Sequence

from meshplan.planner.contracts.plan import Plan, load_plan
from meshplan.planner.models.plan_check import is_sequence_model
from meshplan.reports.html import fmt_bytes

FACT_NAMES = ("model", "GPUs", "global batch", "mesh (pp x dp x cp x tp)", "schedule", "ZeRO", "sequence parallel",
              "recompute", "precision", "step time", "MFU", "peak memory per GPU", "fits", "throughput")


def throughput_text(spec: str, tokens_per_s: float, seq: int) -> str:
    if is_sequence_model(spec):
        return f"{tokens_per_s:,.0f} tokens/s"
    return f"{tokens_per_s / seq:,.1f} samples/s"


def as_plans(plans: Sequence) -> list[tuple[str, Plan]]:
    """(name, Plan) for each `Plan` or path, every name distinct: a file's name, with as many of its
    folders as tell it from the others (`run1/plan.json`, `run2/plan.json`), then its plan digest
    when the paths alone do not; `plan N (digest)` for objects."""
    from pathlib import Path

    loaded = [(None, item) if isinstance(item, Plan) else (Path(item), load_plan(item)) for item in plans]
    paths = [path for path, _ in loaded if path is not None]
    names = []
    for index, (path, plan) in enumerate(loaded, start=1):
        if path is None:
            names.append(f"plan {index} ({plan.digest})")
            continue
        name = _distinct_tail(path, [other for other in paths if other != path])
        same = [other for other in paths if other == path]
        names.append(name if len(same) == 1 else f"{name} ({plan.digest})")
    counts = {name: names.count(name) for name in names}
    names = [f"{name} #{index}" if counts[name] > 1 else name for index, name in enumerate(names, start=1)]
    return list(zip(names, (plan for _, plan in loaded)))


def _distinct_tail(path, others) -> str:
    """The fewest trailing parts of `path` that no other path ends with."""
    parts = path.resolve().parts
    for count in range(1, len(parts) + 1):
        tail = parts[-count:]
        if not any(other.resolve().parts[-count:] == tail for other in others):
            return "/".join(tail)
    return str(path)


def prediction_of(plan: Plan) -> dict[str, Any]:
    if plan.prediction and "step_time_s" in plan.prediction:
        return plan.prediction
    from meshplan.planner.simulation.simulator import simulate

    return simulate(plan, timeline=False).to_json()


def plan_facts(plan: Plan) -> dict[str, str]:
    cfg, pred = plan.config, prediction_of(plan)
    schedule = f"{cfg.schedule}" + (f" x{cfg.virtual_stages}" if cfg.virtual_stages > 1 else "")
    count = cfg.num_microbatches
    schedule += f", {count} micro-batch{'es' if count != 1 else ''} of {cfg.microbatch_size}"
    counts: dict[str, int] = {}
    for layer in plan.layers:
        counts[layer.recompute] = counts.get(layer.recompute, 0) + 1
    usable = plan.cluster.device.usable_memory_bytes
    return {
        "model": f"{plan.model.spec}" + (f" (seq {plan.model.seq})" if is_sequence_model(plan.model.spec) else ""),
        "GPUs": f"{cfg.gpus} x {plan.cluster.name}",
        "global batch": f"{cfg.global_batch}",
        "mesh (pp x dp x cp x tp)": f"{cfg.pp} x {cfg.dp} x {cfg.cp} x {cfg.tp}"
                                    + (f" ({cfg.cp_method})" if cfg.cp > 1 else ""),
        "schedule": schedule,
        "ZeRO": f"{cfg.zero}" + (f" (HSDP shard {cfg.shard_group})" if cfg.shard_group else ""),
        "sequence parallel": "on" if cfg.sp else "off",
        "recompute": ", ".join(f"{mode} {count}" for mode, count in sorted(counts.items())),
        "precision": cfg.precision_label(),
        "step time": f"{pred['step_time_s'] * 1e3:,.1f} ms",
        "MFU": f"{100 * pred['mfu']:.1f}%",
        "peak memory per GPU": f"{fmt_bytes(pred['peak_memory_bytes'])} of {fmt_bytes(usable)}",
        "fits": "yes" if pred.get("fits", True) else "NO",
        "throughput": throughput_text(plan.model.spec, pred["tokens_per_s"], plan.model.seq),
    }


def differing(facts: Sequence[dict[str, str]]) -> set[str]:
    """The facts whose text is not the same in every plan."""
    return {name for name in FACT_NAMES if len({f[name] for f in facts}) > 1}


def compare_text(plans: Sequence) -> str:
    """The side-by-side table of `meshplan compare`: one column per plan, '*' marks a difference."""
    named = as_plans(plans)
    facts = [plan_facts(plan) for _, plan in named]
    diff = differing(facts)
    names = [name for name, _ in named]
    label_width = max(len(n) for n in FACT_NAMES) + 2
    widths = [max(len(names[i]), *(len(f[n]) for n in FACT_NAMES)) for i, f in enumerate(facts)]
    lines = ["  " + " " * label_width + "  ".join(name.ljust(w) for name, w in zip(names, widths))]
    for fact in FACT_NAMES:
        mark = "* " if fact in diff else "  "
        lines.append(mark + fact.ljust(label_width) + "  ".join(f[fact].ljust(w) for f, w in zip(facts, widths)))
    fastest = min(range(len(named)), key=lambda i: prediction_of(named[i][1])["step_time_s"])
    lines += ["", f"* differs between the plans; fastest: {names[fastest]}"]
    return "\n".join(line.rstrip() for line in lines)


def plans_section(plans: Sequence[tuple[str, Plan]]):
    """The report's side-by-side section: the facts table (differences flagged) and a figure of each
    plan's step time by cause and peak memory."""
    from meshplan.reports import figures
    from meshplan.reports.html import Cell, Section, figure_div, paragraph, table

    facts = [plan_facts(plan) for _, plan in plans]
    diff = differing(facts)
    rows = [[Cell(name, "winner" if name in diff else ""),
             *(Cell(f[name], "flag" if name in diff else "") for f in facts)] for name in FACT_NAMES]
    predictions = [prediction_of(plan) for _, plan in plans]
    fig = figures.plans_bars([name for name, _ in plans], [p.get("breakdown") or {} for p in predictions],
                             [float(p["peak_memory_bytes"]) for p in predictions])
    body = (paragraph(f"{len(plans)} plans side by side; highlighted rows differ. The sections below detail the "
                      f"first, {plans[0][0]}.")
            + table(["", *(name for name, _ in plans)], rows)
            + f'<div class="fig">{figure_div(fig, "fig-plans")}</div>')
    return Section("plans", "Plans compared", body)
