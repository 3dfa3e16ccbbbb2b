"""Report sections about the plan itself: summary, per-layer plan, memory, timeline, step time.

Each `*_section` returns a `Section` whose HTML is already escaped. The prediction is the plan's
`prediction` dict (the keys of `estimate --json`).
"""
from __future__ import annotations

from typing import Any, Sequence

from meshplan.reports import figures
from meshplan.reports.html import (Cell, Section, esc, figure_div, fmt_bytes, fmt_ms, fmt_pct, key_values, paragraph,
                          table)
from meshplan.reports.timeline import idle_fraction_per_rank

# The mixed-precision recipes (ZeRO paper, Rajbhandari et al. 2020, section 3.1): bytes per
# parameter for (parameters, gradients, optimizer states) before any ZeRO sharding.
# What each recipe keeps (its byte counts: costing.precision.PRECISION_RECIPES).
PRECISION_RECIPE_TEXT = {
    "bf16-mixed": "bf16 parameters and gradients; fp32 master weights plus Adam's two fp32 moments (4 + 4 + 4 bytes)",
    "fp8": ("bf16-mixed's model states; the blocks' Linears run their GEMMs in fp8 with a transient fp8 copy of "
            "each weight and save their inputs in fp8 (planned only: the executor does not run fp8)"),
    "fp32": "fp32 parameters and gradients; Adam's two fp32 moments (4 + 4 bytes)",
}


# How context-parallel ranks attend: Ulysses (`ParallelConfig.cp_method`), else the K/V exchange
# the plan's engine runs (`contracts.overlap.EngineOverlap.cp_exchange`), as the cost model prices it.
CP_METHOD_TEXT = {"ulysses": "Ulysses: all-to-alls trade sequence shards for head shards around attention"}
CP_EXCHANGE_TEXT = {
    "all_gather": "K and V all-gathered before attention",
    "ring_p2p": "K and V passed around a ring, each step behind the previous chunk's attention",
    "torch_ring": "torch's ring attention: K and V rotated, partial outputs merged in fp32",
}


def _cp_text(config) -> str:
    from meshplan.planner.contracts.overlap import engine_overlap

    return CP_METHOD_TEXT.get(config.cp_method) or CP_EXCHANGE_TEXT[engine_overlap(config.engine).cp_exchange]


def _mesh_text(config) -> str:
    cp = (f" x cp={config.cp} (each rank holds 1/{config.cp} of every sequence; {_cp_text(config)})"
          if config.cp > 1 else "")
    return f"pp={config.pp} x dp={config.dp}{cp} x tp={config.tp}"


def _schedule_text(config) -> str:
    text = f"{config.schedule}, {config.num_microbatches} micro-batches of {config.microbatch_size}"
    if config.virtual_stages > 1:
        text += f", {config.virtual_stages} virtual stages"
    return text


def _band_text(plan, prediction: dict[str, Any]) -> str:
    """", likely A-B ms (...)": the held-out error band of the plan's regime on its cluster profile
    (`costing.error_bands`), or why an unvalidated profile has none."""
    from meshplan.planner.costing.error_bands import MissingBand, step_uncertainty, uncertainty_text

    step = prediction.get("step_time_s")
    if not step:
        return ""
    uncertainty = step_uncertainty(plan.config, plan.model.spec, plan.model.seq, plan.cluster)
    text = uncertainty_text(uncertainty, float(step), 1e3, "ms")
    return f", band {text}" if isinstance(uncertainty, MissingBand) else f", {text}" if text else ""


def summary_section(plan, prediction: dict[str, Any], source_name: str, comparison=None,
                    measured_tokens_per_s: float | None = None) -> Section:
    """`measured_tokens_per_s`: the measured runs' whole-job throughput (their median), when given."""
    from meshplan.reports.plans import is_sequence_model, throughput_text

    cfg, device = plan.config, plan.cluster.device
    peak = float(prediction.get("peak_memory_bytes", 0.0))
    sequences = is_sequence_model(plan.model.spec)
    unit = "tokens/s" if sequences else "samples/s"
    pairs = [
        ("plan file", source_name),
        ("model", f"{plan.model.spec} (sequence {plan.model.seq}, {plan.model.dtype}, "
                  f"{plan.model.attention} attention)" if sequences else f"{plan.model.spec} ({plan.model.dtype})"),
        ("cluster", f"{plan.cluster.name}: {cfg.gpus} x {device.name}, {plan.cluster.gpus_per_node} per node"),
        ("global batch", f"{cfg.global_batch} sequences = {cfg.global_batch * plan.model.seq:,} tokens per step"
                         if sequences else f"{cfg.global_batch} samples per step"),
        ("mesh", _mesh_text(cfg)),
        ("schedule", _schedule_text(cfg)),
        ("ZeRO stage / sequence parallel / precision",
         f"{cfg.zero}{f' (HSDP: sharded over {cfg.shard_group}, replicated x{cfg.dp // cfg.shard_group})' if cfg.shard_group else ''}"
         f" / {'on' if cfg.sp else 'off'} / {cfg.precision_label()}"),
        ("predicted step time", fmt_ms(prediction.get("step_time_s")) + _band_text(plan, prediction)),
        (f"predicted {unit} (whole job)",
         throughput_text(plan.model.spec, float(prediction.get("tokens_per_s", 0.0)), plan.model.seq)),
        ("model TFLOP/s per GPU (MFU convention)", f"{prediction.get('model_tflops_per_gpu', 0.0):,.2f}"),
        ("hardware TFLOP/s per GPU (with recomputation)", f"{prediction.get('hw_tflops_per_gpu', 0.0):,.2f}"),
        ("MFU", fmt_pct(prediction.get("mfu"))),
        ("peak memory vs capacity", f"{fmt_bytes(peak)} of {fmt_bytes(device.memory_bytes)} "
                                    f"({fmt_pct(peak / device.memory_bytes)}; usable "
                                    f"{fmt_bytes(device.usable_memory_bytes)})"),
        ("pipeline bubble", fmt_pct(prediction.get("bubble_fraction"))),
        ("fits", "yes" if prediction.get("fits", True) else "NO"),
        ("plan digest", plan.digest),
    ]
    if comparison is not None:
        flag = ("  (too noisy to judge: see Predicted vs measured)" if comparison.too_noisy
                else "  (over the threshold: see Predicted vs measured)" if comparison.flagged else "")
        pairs.insert(8, ("measured step time (median)", f"{fmt_ms(comparison.measured_median_s)}, error "
                                                        f"{fmt_pct(comparison.error_fraction, signed=True)}{flag}"))
    if measured_tokens_per_s is not None:
        pairs.insert(10, (f"measured {unit} (whole job)",
                          throughput_text(plan.model.spec, measured_tokens_per_s, plan.model.seq)))
    solver = plan.solver or {}
    if "num_candidates" in solver:
        pairs.append(("search", f"{solver['num_candidates']} candidate configurations, "
                                f"{solver.get('num_solved', '?')} solved by the ILP ({solver.get('backend', '?')}, "
                                f"status {solver.get('status', '?')}, gap {100 * float(solver.get('gap', 0.0)):.2g}%)"))
    body = key_values(pairs)
    if not prediction.get("fits", True):
        body = paragraph("This plan does not fit in device memory: see the memory section.", "warn") + body
    if not plan.executable:
        body = paragraph(f"Not executable by meshplan train: {plan.not_executable_reason}", "warn") + body
    return Section("summary", "Summary", body)


def _layer_compute_s(layer) -> float:
    return layer.fwd_time_s + layer.bwd_time_s


def layers_section(plan) -> Section:
    layers = plan.layers
    fig = figures.layer_strip([l.name for l in layers], [l.stage for l in layers], [l.recompute for l in layers],
                              [_layer_compute_s(l) for l in layers], [l.comm_time_s for l in layers],
                              [l.mem_bytes for l in layers])
    rows = []
    for index, layer in enumerate(layers):
        colour = figures.STAGE_COLOURS[layer.stage % len(figures.STAGE_COLOURS)]
        recompute_cls = "" if layer.recompute == "none" else "flag"
        rows.append([index, layer.name, Cell(layer.stage, background=colour + "55"), layer.virtual_stage,
                     layer.tp, layer.dp, Cell(layer.recompute, recompute_cls), fmt_ms(layer.fwd_time_s),
                     fmt_ms(layer.bwd_time_s), fmt_ms(layer.comm_time_s), fmt_bytes(layer.mem_bytes)])
    detail = table(["#", "layer", "stage", "virtual stage", "TP", "DP", "recompute", "forward", "backward",
                    "communication", "memory"], rows)
    body = (paragraph(f"{len(layers)} layers in {plan.config.num_model_chunks} pipeline chunk(s). Times are per "
                      "micro-batch on one rank; memory is what the layer holds on its rank at the peak.")
            + f'<div class="fig">{figure_div(fig, "fig-layers")}</div>'
            + f"<details><summary>Per-layer table ({len(layers)} rows)</summary>{detail}</details>")
    return Section("layers", "Plan per layer", body)


def _states_bytes_per_param(config) -> tuple[dict[str, float], dict[str, float]]:
    """Model-state bytes per parameter of a stage: (as the executor allocates, as the ZeRO paper counts)."""
    from meshplan.planner.costing.state_memory import executor_state_bytes, paper_state_bytes

    return (executor_state_bytes(1.0, config.dp, config.zero, config.precision, config.tp, config.pp,
                                 config.shard_group),
            paper_state_bytes(1.0, config.dp, config.zero, config.precision, config.shard_group))


def _experts_text(cfg, prediction: dict[str, Any]) -> str:
    """Where the routed experts live and what moving tokens to them costs."""
    ep = cfg.ep
    a2a_s = float((prediction.get("breakdown") or {}).get("ep_comm", 0.0))
    etp = cfg.expert_tp
    shard = f", each expert split over {etp} expert-tensor-parallel ranks" if etp > 1 else ""
    layout = (f"expert parallelism ep={ep}: each rank holds 1/{ep} of every MoE block's routed experts{shard}, their "
              f"gradients reduced over the {cfg.expert_data_ranks} ranks holding the same experts"
              if ep > 1 else f"no expert parallelism: every data-parallel rank holds every expert{shard}")
    return (f"Routed experts ({layout}). 'of which experts' is their part of the model states. Dispatch and combine "
            f"all-to-alls take {fmt_ms(a2a_s)} of the step on the busiest rank (ep_comm in the breakdown).")


def memory_section(plan, prediction: dict[str, Any], memory_timeline: Sequence = ()) -> Section:
    device, cfg = plan.cluster.device, plan.config
    per_rank = list(prediction.get("memory_bytes") or [])
    body = []
    if per_rank:
        fig = figures.memory_bars(per_rank, device.memory_bytes, device.usable_memory_bytes)
        body.append(f'<div class="fig">{figure_div(fig, "fig-memory")}</div>')
        rows, moe = [], any(mem.get("experts", 0.0) > 0 for mem in per_rank)
        for rank, mem in enumerate(per_rank):
            model_states = sum(mem.get(k, 0.0) for k in ("params", "grads", "optimizer"))
            residual = sum(mem.get(k, 0.0) for k in ("activations", "buffers"))
            total = mem.get("total", model_states + residual)
            over = total > device.usable_memory_bytes
            rows.append([f"stage {rank}", *(fmt_bytes(mem.get(k, 0.0)) for k in figures.MEMORY_KINDS),
                         fmt_bytes(model_states), *([fmt_bytes(mem.get("experts", 0.0))] if moe else []),
                         fmt_bytes(residual),
                         Cell(fmt_bytes(total), "flag" if over else "ok",
                              title="over the usable memory" if over else "fits")])
        body.append(table(["pipeline rank", *figures.MEMORY_KINDS, "model states",
                           *(["of which experts"] if moe else []), "residual states", "total"], rows))
        if moe:
            body.append(paragraph(_experts_text(cfg, prediction), "note"))
    else:
        body.append(paragraph("The plan carries no per-rank memory prediction.", "warn"))
    executor_bytes, paper_bytes = _states_bytes_per_param(cfg)
    recipe = PRECISION_RECIPE_TEXT.get(cfg.precision, cfg.precision)

    def _sum_text(parts: dict[str, float]) -> str:
        values = [parts[k] for k in ("params", "grads", "optimizer")]
        return " + ".join(f"{v:g}" for v in values) + f" = {sum(values):g}"

    sharded_over = f"shard groups of {cfg.shard_group} (HSDP, dp={cfg.dp})" if cfg.shard_group else f"dp={cfg.dp}"
    body.append(paragraph(
        f"Model states are the parameters, gradients and optimizer states; residual states are activations "
        f"saved for backward plus temporary buffers (communication buffers, gathered ZeRO-3 parameters, the "
        f"recomputation working set). Precision recipe {cfg.precision}: {recipe}. With ZeRO stage {cfg.zero} "
        f"over {sharded_over}, the ZeRO paper counts {_sum_text(paper_bytes)} bytes of model states (params + "
        f"grads + optimizer) per parameter of a stage; the figures above are what the executor allocates: "
        f"{_sum_text(executor_bytes)} bytes (meshplan.planner.costing.state_memory says why they differ)."))
    body.append(paragraph(f"Device: {device.name}, {fmt_bytes(device.memory_bytes)} of which "
                          f"{fmt_bytes(device.reserved_memory_bytes)} is reserved (runtime context, allocator, "
                          "communication buffers).", "note"))
    if memory_timeline and any(memory_timeline):
        fig = figures.memory_over_time(memory_timeline, device.memory_bytes, prediction.get("step_time_s"))
        body.append(f'<div class="fig">{figure_div(fig, "fig-memory-time")}</div>')
    return Section("memory", "Memory per stage", "".join(body))


def timeline_section(intervals: Sequence, prediction: dict[str, Any], source_note: str) -> Section:
    if not intervals:
        return Section("timeline", "Timeline of one step",
                       paragraph(f"No timeline: {source_note}", "warn"))
    step_time_s = float(prediction.get("step_time_s") or max(i.end_s for i in intervals))
    fig = figures.timeline_gantt(intervals, step_time_s)
    idle = idle_fraction_per_rank(list(intervals))
    rows = [[f"rank {rank}", fmt_pct(fraction)] for rank, fraction in idle.items()]
    body = (paragraph(f"Source: {source_note}. Each row is one pipeline rank's stream; grey spans on the compute "
                      f"stream are idle time: the fill and drain of the pipeline (the bubble, "
                      f"{fmt_pct(prediction.get('bubble_fraction'))} of the step on the busiest rank) and waits "
                      "for blocking communication.")
            + f'<div class="fig">{figure_div(fig, "fig-timeline")}</div>'
            + table(["rank", "compute stream idle"], rows))
    return Section("timeline", "Timeline of one step", body)


def stage_totals(plan) -> tuple[list[float], list[float], list[int]]:
    """Per pipeline rank: compute and communication time per micro-batch, and its layer count."""
    num_stages = plan.config.pp
    compute, comm, count = [0.0] * num_stages, [0.0] * num_stages, [0] * num_stages
    for layer in plan.layers:
        compute[layer.stage] += _layer_compute_s(layer)
        comm[layer.stage] += layer.comm_time_s
        count[layer.stage] += 1
    return compute, comm, count


def breakdown_section(plan, prediction: dict[str, Any]) -> Section:
    step_time_s = float(prediction.get("step_time_s") or 0.0)
    breakdown = {k: float(v) for k, v in (prediction.get("breakdown") or {}).items()}
    body = []
    if breakdown and step_time_s > 0:
        fig = figures.breakdown_bar(breakdown, step_time_s)
        body.append(f'<div class="fig">{figure_div(fig, "fig-breakdown")}</div>')
        accounted = sum(breakdown.values())
        rows = [[cause, fmt_ms(value), fmt_pct(value / step_time_s)] for cause, value in breakdown.items()]
        rows.append([Cell("sum", "winner"), fmt_ms(accounted), fmt_pct(accounted / step_time_s)])
        body.append(table(["cause (exposed time, busiest rank)", "time", "share of step"], rows))
    else:
        body.append(paragraph("The prediction carries no step-time breakdown.", "warn"))
    compute, comm, count = stage_totals(plan)
    per_stage = [c + m for c, m in zip(compute, comm)]
    mean = sum(per_stage) / len(per_stage)
    if plan.config.pp > 1 and mean <= 0:  # a hand-written plan (executor.plans): no per-layer times
        body.append(paragraph("The plan's layers carry no per-layer times (a hand-written plan, not one from "
                              "`meshplan plan`), so stage balance is not shown.", "note"))
    elif plan.config.pp > 1:
        slowest = max(range(len(per_stage)), key=per_stage.__getitem__)
        body.append(paragraph(
            f"Load balance: the slowest stage (stage {slowest}, {fmt_ms(per_stage[slowest])} per micro-batch) "
            f"sets the pipeline's pace; it is {per_stage[slowest] / mean:.2f}x the mean stage "
            f"({fmt_ms(mean)}). Stages may hold different layer counts to even this out (the embedding and the "
            "head weigh differently from a block)."))
    fig = figures.stage_balance(compute, comm, count)
    body.append(f'<div class="fig">{figure_div(fig, "fig-balance")}</div>')
    return Section("breakdown", "Step-time breakdown", "".join(body))


def frontier_section(sizing: dict[str, Any]) -> Section:
    """The time/cost frontier of `plan --train-tokens` (the plan JSON's `sizing`): one row per GPU
    count planned, with the throughput each GPU keeps relative to the smallest size (scaling loss)."""
    rows_data = sorted(sizing.get("frontier") or [], key=lambda row: row["gpus"])
    if not rows_data:
        return Section("frontier", "Time and cost frontier", paragraph("The sizing holds no planned size.", "warn"))
    deadline, chosen = sizing.get("deadline_days"), sizing.get("chosen_gpus")
    base_per_gpu = rows_data[0]["tokens_per_s"] / rows_data[0]["gpus"]
    with_usd = any(row.get("usd") is not None for row in rows_data)
    rows = []
    for row in rows_data:
        efficiency = row["tokens_per_s"] / row["gpus"] / base_per_gpu
        css = "winner" if row["gpus"] == chosen else ""
        meets = "" if deadline is None else Cell("yes" if row["days"] <= deadline else "no",
                                                 "ok" if row["days"] <= deadline else "flag")
        rows.append([Cell(row["gpus"], css), f"{row['tokens_per_s']:,.0f}", f"{row['tokens_per_s'] / row['gpus']:,.0f}",
                     Cell(fmt_pct(efficiency), "" if efficiency >= 0.9 else "flag"), fmt_ms(row["step_time_s"]),
                     f"{row['days']:,.2f}", f"{row['gpu_hours']:,.0f}",
                     *([f"{row['usd']:,.0f}" if row.get("usd") is not None else "n/a"] if with_usd else []),
                     *([meets] if deadline is not None else []), row.get("label", "")])
    headers = ["GPUs", "tokens/s", "tokens/s per GPU", f"per GPU vs {rows_data[0]['gpus']} GPUs", "step time",
               "days", "GPU-hours", *(["cost USD"] if with_usd else []),
               *([f"meets {deadline:g} days"] if deadline is not None else []), "configuration"]
    tokens = rows_data[0]["tokens"]
    text = (f"Training on {tokens:.3g} tokens at each cluster size planned. Per GPU vs the smallest size is "
            "tokens/s per GPU over that of the smallest size: what scaling out loses to communication and the "
            "pipeline bubble (100% is linear scaling; under 90% is flagged).")
    if deadline is not None:
        text += (f" Deadline {deadline:g} days: " + (f"the cheapest size that meets it is {chosen} GPUs (highlighted)."
                                                     if chosen else "no size planned meets it."))
    fig = figures.frontier_plot([row["gpus"] for row in rows_data], [row["tokens_per_s"] for row in rows_data],
                                [row["days"] for row in rows_data],
                                [row["usd"] if with_usd else row["gpu_hours"] for row in rows_data],
                                "cost (USD)" if with_usd else "GPU-hours", deadline, chosen)
    body = (paragraph(text) + f'<div class="fig">{figure_div(fig, "fig-frontier")}</div>' + table(headers, rows))
    skipped = sizing.get("skipped") or []
    if skipped:
        body += paragraph("Sizes with no plan: " + "; ".join(skipped), "note")
    return Section("frontier", "Time and cost frontier", body)
