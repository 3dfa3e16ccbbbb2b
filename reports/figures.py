"""The report's plotly figures. Each function takes plain numbers and returns a `go.Figure`.

Times are shown in milliseconds and memory in GiB (the code keeps seconds and bytes until here).
"""
from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from meshplan.reports.html import bytes_unit, esc

MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "buffers")
# Model states (blues) vs residual states (oranges), as in the ZeRO paper's vocabulary.
MEMORY_COLOURS = {"params": "#1f4e79", "grads": "#2e75b6", "optimizer": "#9dc3e6",
                  "activations": "#ed7d31", "buffers": "#f4b183"}
KIND_COLOURS = {"forward": "#2e75b6", "backward": "#70ad47", "recompute": "#ffc000", "tp_comm": "#7030a0",
                "dp_comm": "#c00000", "zero_gather": "#ff66cc", "send": "#00b0a0", "recv": "#66d9cc",
                "optimizer": "#595959", "idle": "#e7e6e6"}
STAGE_COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
                 "#9c755f", "#bab0ac")
RECOMPUTE_LEVELS = ("none", "selective", "full")


def _layout(fig: go.Figure, title: str, height: int, **kwargs) -> go.Figure:
    fig.update_layout(title=title, height=height, margin=dict(l=70, r=20, t=50, b=50),
                      template="plotly_white", **kwargs)
    return fig


def layer_strip(names: Sequence[str], stages: Sequence[int], recompute: Sequence[str],
                compute_s: Sequence[float], comm_s: Sequence[float], mem_bytes: Sequence[float]) -> go.Figure:
    """One column per layer, one coloured row per attribute: scannable at 80+ layers."""
    labels = [esc(n) for n in names]
    mem_div, mem_unit = bytes_unit(max(mem_bytes, default=0.0))
    fig = make_subplots(rows=5, cols=1, shared_xaxes=True, vertical_spacing=0.02)
    num_stages = max(stages) + 1
    stage_scale = [[i / max(num_stages - 1, 1), STAGE_COLOURS[i % len(STAGE_COLOURS)]] for i in range(num_stages)]
    if num_stages == 1:
        stage_scale = [[0, STAGE_COLOURS[0]], [1, STAGE_COLOURS[0]]]
    rows = [
        ("stage", list(stages), stage_scale, [f"stage {s}" for s in stages]),
        ("recompute", [RECOMPUTE_LEVELS.index(r) for r in recompute],
         [[0, "#f0f0f0"], [0.5, "#ffc000"], [1, "#c00000"]], list(recompute)),
        ("compute ms", [t * 1e3 for t in compute_s], "Blues", [f"{t * 1e3:.3f} ms" for t in compute_s]),
        ("comm ms", [t * 1e3 for t in comm_s], "Purples", [f"{t * 1e3:.3f} ms" for t in comm_s]),
        (f"memory {mem_unit}", [b / mem_div for b in mem_bytes], "Oranges",
         [f"{b / mem_div:.3f} {mem_unit}" for b in mem_bytes]),
    ]
    for row, (label, values, scale, text) in enumerate(rows, start=1):
        zmax = {"stage": max(num_stages - 1, 1), "recompute": 2}.get(label)
        fig.add_trace(go.Heatmap(z=[values], x=labels, y=[label], colorscale=scale, showscale=False,
                                 zmin=0, zmax=zmax, text=[text], xgap=1,
                                 hovertemplate="%{x}<br>" + label.split()[0] + ": %{text}<extra></extra>"),
                      row=row, col=1)
    fig.update_xaxes(showticklabels=len(names) <= 40, row=5, col=1)
    return _layout(fig, "Plan per layer (hover a cell for its values)", 330)


def memory_bars(per_rank: Sequence[dict], capacity_bytes: float, usable_bytes: float) -> go.Figure:
    """Stacked bars of each pipeline rank's peak memory by kind, against the device capacity."""
    x = [f"stage {rank}" for rank in range(len(per_rank))]
    peak_bytes = max((sum(m.get(k, 0.0) for k in MEMORY_KINDS) for m in per_rank), default=0.0)
    # A capacity far above the peak would squash the bars flat: then it is named, not drawn.
    draw_capacity = peak_bytes > 0.05 * capacity_bytes
    div, unit = bytes_unit(max(peak_bytes, capacity_bytes) if draw_capacity else peak_bytes)
    fig = go.Figure()
    for kind in MEMORY_KINDS:
        group = "model states" if kind in ("params", "grads", "optimizer") else "residual states"
        fig.add_trace(go.Bar(name=f"{kind} ({group})", x=x, y=[m.get(kind, 0.0) / div for m in per_rank],
                             marker_color=MEMORY_COLOURS[kind],
                             hovertemplate="%{x}: %{y:.2f} " + unit + "<extra>" + kind + "</extra>"))
    title = "Peak memory per pipeline stage (each rank of a stage holds the same)"
    if draw_capacity:
        fig.add_hline(y=capacity_bytes / div, line_color="#c00000", line_dash="solid",
                      annotation_text=f"device capacity {capacity_bytes / div:.1f} {unit}",
                      annotation_position="top left")
        if usable_bytes < capacity_bytes:
            fig.add_hline(y=usable_bytes / div, line_color="#c00000", line_dash="dot",
                          annotation_text=f"usable {usable_bytes / div:.1f} {unit}", annotation_position="bottom left")
    else:
        title += f"; capacity {capacity_bytes / 2**30:.1f} GiB is off the scale"
    return _layout(fig, title, 420, barmode="stack", yaxis_title=unit, legend_orientation="h", legend_y=-0.15)


def timeline_gantt(intervals: Sequence, step_time_s: float) -> go.Figure:
    """A Gantt chart: one row per (rank, stream), one colour per kind; grey is idle (the bubble)."""
    rows = sorted({(i.rank, i.stream) for i in intervals}, key=lambda rs: (rs[0], rs[1] != "compute", rs[1]))
    labels = {rs: f"rank {rs[0]} {rs[1]}" for rs in rows}
    fig = go.Figure()
    for kind, colour in KIND_COLOURS.items():
        spans = [i for i in intervals if i.kind == kind]
        if not spans:
            continue
        fig.add_trace(go.Bar(
            name=kind, orientation="h", y=[labels[(i.rank, i.stream)] for i in spans],
            x=[(i.end_s - i.start_s) * 1e3 for i in spans], base=[i.start_s * 1e3 for i in spans],
            marker_color=colour, marker_line_width=0,
            customdata=[[i.microbatch, i.chunk] for i in spans],
            hovertemplate=kind + " %{base:.3f}+%{x:.3f} ms, micro-batch %{customdata[0]}, chunk %{customdata[1]}"
                          "<extra>%{y}</extra>"))
    fig.add_vline(x=step_time_s * 1e3, line_dash="dash", line_color="#333",
                  annotation_text=f"step {step_time_s * 1e3:.2f} ms")
    order = [labels[rs] for rs in rows]
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(order)))
    _layout(fig, "Simulated timeline of one step (grey = idle: pipeline bubble and waits)",
            max(300, 120 + 26 * len(rows)), barmode="overlay", xaxis_title="time in the step (ms)")
    # The legend goes above the plot: below it, it would collide with the axis title.
    fig.update_layout(legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0),
                      margin=dict(t=80))
    return fig


def memory_over_time(memory_timeline: Sequence[Sequence[Sequence[float]]], capacity_bytes: float,
                     step_time_s: float | None = None) -> go.Figure:
    """Live bytes on each pipeline rank over the simulated step: each curve held to the step's end
    (`step_time_s`: the optimizer runs after the last backward), and the y axis starting at the
    smallest resident model states, so the activations' rise and fall is not flattened by them."""
    fig = go.Figure()
    curves = [list(points) for points in memory_timeline]
    if step_time_s is not None:
        curves = [points + [(step_time_s, points[-1][1])] if points and points[-1][0] < step_time_s else points
                  for points in curves]
    peak_bytes = max((p[1] for points in curves for p in points), default=0.0)
    floor_bytes = min((points[0][1] for points in curves if points), default=0.0)
    draw_capacity = peak_bytes > 0.05 * capacity_bytes
    top_bytes = max(peak_bytes, capacity_bytes) if draw_capacity else peak_bytes
    div, unit = bytes_unit(top_bytes)
    for rank, points in enumerate(curves):
        if points:
            fig.add_trace(go.Scatter(x=[p[0] * 1e3 for p in points], y=[p[1] / div for p in points],
                                     mode="lines", line_shape="hv", name=f"stage {rank}"))
    if draw_capacity:
        fig.add_hline(y=capacity_bytes / div, line_color="#c00000", annotation_text="device capacity")
    fig = _layout(fig, "Live memory over the step (what the simulator tracks; the axis starts at the resident "
                       "model states)", 320, xaxis_title="ms", yaxis_title=unit)
    margin = 0.03 * (top_bytes - floor_bytes) or 0.03 * top_bytes
    fig.update_yaxes(range=[max(0.0, floor_bytes - margin) / div, (top_bytes + margin) / div])
    return fig


def breakdown_bar(breakdown: dict[str, float], step_time_s: float) -> go.Figure:
    """Where the step goes on the busiest rank (exposed time by cause)."""
    causes = [k for k, v in breakdown.items() if v > 0]
    fig = go.Figure(go.Bar(
        x=[breakdown[k] * 1e3 for k in causes], y=causes, orientation="h",
        text=[f"{breakdown[k] * 1e3:.2f} ms ({breakdown[k] / step_time_s:.0%})" for k in causes],
        textposition="auto", marker_color=[KIND_COLOURS.get(_cause_kind(k), "#4e79a7") for k in causes]))
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(causes)))
    return _layout(fig, f"Step-time breakdown (step {step_time_s * 1e3:.2f} ms)", 60 + 40 * max(len(causes), 3),
                   xaxis_title="ms")


def _cause_kind(cause: str) -> str:
    return {"compute": "forward", "pp_comm": "send", "bubble": "idle"}.get(cause, cause)


def stage_balance(stage_compute_s: Sequence[float], stage_comm_s: Sequence[float],
                  stage_num_layers: Sequence[int]) -> go.Figure:
    """Per-stage work per micro-batch: the slowest stage sets the pipeline's pace."""
    x = [f"stage {s} ({n} layers)" for s, n in enumerate(stage_num_layers)]
    fig = go.Figure([
        go.Bar(name="compute (fwd+bwd)", x=x, y=[t * 1e3 for t in stage_compute_s], marker_color="#2e75b6"),
        go.Bar(name="communication", x=x, y=[t * 1e3 for t in stage_comm_s], marker_color="#7030a0"),
    ])
    return _layout(fig, "Load balance across pipeline stages (per micro-batch)", 340, barmode="stack",
                   yaxis_title="ms")


def alternatives_scatter(points: Sequence[dict], capacity_bytes: float) -> go.Figure:
    """Predicted step time vs peak memory of every configuration considered; the winner starred.

    Each point: label, step_time_s, peak_memory_bytes, fits, winner.
    """
    fig = go.Figure()
    peak_bytes = max((p["peak_memory_bytes"] for p in points), default=0.0)
    draw_capacity = peak_bytes > 0.05 * capacity_bytes  # else the points would squash into one column
    div, unit = bytes_unit(max(peak_bytes, capacity_bytes) if draw_capacity else peak_bytes)
    groups = (("chosen plan", lambda p: p["winner"], "star", "#0969da", 18),
              ("fits", lambda p: not p["winner"] and p["fits"], "circle", "#59a14f", 10),
              ("does not fit", lambda p: not p["winner"] and not p["fits"], "x", "#c00000", 10))
    for name, keep, symbol, colour, size in groups:
        chosen = [p for p in points if keep(p)]
        if chosen:
            fig.add_trace(go.Scatter(
                name=name, mode="markers", x=[p["peak_memory_bytes"] / div for p in chosen],
                y=[p["step_time_s"] * 1e3 for p in chosen], text=[esc(p["label"]) for p in chosen],
                marker=dict(symbol=symbol, color=colour, size=size),
                hovertemplate="%{text}<br>%{y:.2f} ms, %{x:.3f} " + unit + "<extra></extra>"))
    title = "Configurations considered: step time vs peak memory"
    if draw_capacity:
        fig.add_vline(x=capacity_bytes / div, line_color="#c00000", annotation_text="capacity")
    else:
        title += f" (capacity {capacity_bytes / 2**30:.1f} GiB is off the scale)"
    return _layout(fig, title, 400,
                   xaxis_title=f"peak memory per GPU ({unit})", yaxis_title="predicted step time (ms)")


def measured_steps(runs: Sequence[tuple[str, Sequence[float], int]], predicted_s: float,
                   flag_fraction: float) -> go.Figure:
    """Every measured step of every run against the prediction and its +-flag band."""
    fig = go.Figure()
    upper, lower = predicted_s * (1 + flag_fraction) * 1e3, predicted_s * (1 - flag_fraction) * 1e3
    fig.add_hrect(y0=lower, y1=upper, fillcolor="#0969da", opacity=0.08, line_width=0)
    fig.add_hline(y=predicted_s * 1e3, line_color="#0969da", line_dash="dash",
                  annotation_text=f"predicted {predicted_s * 1e3:.2f} ms (band ±{flag_fraction:.0%})")
    for name, step_times_s, warmup in runs:
        steps = list(range(len(step_times_s)))
        fig.add_trace(go.Scatter(x=steps, y=[t * 1e3 for t in step_times_s], mode="lines+markers",
                                 name=esc(name), marker_symbol=["circle-open" if s < warmup else "circle"
                                                                for s in steps]))
    return _layout(fig, "Measured step time per step (open markers: warm-up, not counted)", 360,
                   xaxis_title="step", yaxis_title="ms")


def measured_memory(ranks: Sequence[int], predicted_bytes: Sequence[float],
                    measured_bytes: Sequence[float]) -> go.Figure:
    x = [f"rank {r}" for r in ranks]
    div, unit = bytes_unit(max(list(predicted_bytes) + list(measured_bytes), default=0.0))
    fig = go.Figure([go.Bar(name="predicted", x=x, y=[b / div for b in predicted_bytes], marker_color="#9dc3e6"),
                     go.Bar(name="measured", x=x, y=[b / div for b in measured_bytes], marker_color="#ed7d31")])
    return _layout(fig, "Peak memory per rank: predicted vs measured", 340, barmode="group", yaxis_title=unit)


def frontier_plot(gpus: Sequence[int], tokens_per_s: Sequence[float], days: Sequence[float],
                  cost: Sequence[float], cost_title: str, deadline_days: float | None = None,
                  chosen_gpus: int | None = None) -> go.Figure:
    """Throughput, training days and cost against the GPU count; the dashed line is linear scaling
    from the smallest size, so the gap to it is the scaling-efficiency loss."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=("tokens/s", "days to train", cost_title))
    ideal = [tokens_per_s[0] / gpus[0] * count for count in gpus]
    fig.add_trace(go.Scatter(x=list(gpus), y=ideal, mode="lines", name="linear scaling",
                             line=dict(dash="dash", color="#999")), row=1, col=1)
    marker = dict(size=[14 if count == chosen_gpus else 8 for count in gpus],
                  symbol=["star" if count == chosen_gpus else "circle" for count in gpus])
    for col, (name, values, colour) in enumerate((("tokens/s", tokens_per_s, "#2e75b6"), ("days", days, "#70ad47"),
                                                  (cost_title, cost, "#c00000")), start=1):
        fig.add_trace(go.Scatter(x=list(gpus), y=list(values), mode="lines+markers", name=name,
                                 marker=dict(color=colour, **marker), line=dict(color=colour),
                                 hovertemplate="%{x} GPUs: %{y:,.4g}<extra>" + esc(name) + "</extra>"),
                      row=1, col=col)
    if deadline_days is not None:
        fig.add_hline(y=deadline_days, line_dash="dot", line_color="#c00000", row=1, col=2,
                      annotation_text=f"deadline {deadline_days:g} days")
    fig.update_xaxes(type="log", title_text="GPUs", tickvals=list(gpus))
    return _layout(fig, "Time and cost against cluster size (star: the size chosen for the deadline)", 380,
                   showlegend=True, legend_orientation="h", legend_y=-0.25)


def plans_bars(names: Sequence[str], breakdowns: Sequence[dict[str, float]],
               peak_bytes: Sequence[float]) -> go.Figure:
    """Each plan's step time stacked by cause (left) and its peak memory per GPU (right)."""
    labels = [esc(name) for name in names]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("step time by cause (ms)", "peak memory per GPU"))
    causes = [c for c in dict.fromkeys(k for b in breakdowns for k in b) if any(b.get(c, 0.0) > 0 for b in breakdowns)]
    for cause in causes:
        fig.add_trace(go.Bar(name=cause, x=labels, y=[b.get(cause, 0.0) * 1e3 for b in breakdowns],
                             marker_color=KIND_COLOURS.get(_cause_kind(cause), "#4e79a7")), row=1, col=1)
    div, unit = bytes_unit(max(peak_bytes, default=0.0))
    fig.add_trace(go.Bar(name="peak memory", x=labels, y=[b / div for b in peak_bytes], marker_color="#ed7d31",
                         showlegend=False, hovertemplate="%{x}: %{y:.2f} " + unit + "<extra></extra>"), row=1, col=2)
    fig.update_yaxes(title_text=unit, row=1, col=2)
    return _layout(fig, "Plans compared", 380, barmode="stack", legend_orientation="h", legend_y=-0.2)
