"""The predicted-vs-measured section (only when measured runs are given)."""
from __future__ import annotations

import json
from typing import Sequence

from meshplan.reports import figures
from meshplan.planner.contracts.measurement import Measurement
from meshplan.reports.compare import Comparison
from meshplan.reports.html import Cell, Section, figure_div, fmt_bytes, fmt_ms, fmt_pct, paragraph, table


def _error_cell(fraction: float, flagged: bool) -> Cell:
    text = fmt_pct(fraction, signed=True) + ("  over threshold" if flagged else "")
    return Cell(text, "flag error-pct" if flagged else "ok error-pct")


def measured_section(comparison: Comparison, measurements: Sequence[Measurement], plan=None) -> Section:
    """`plan` (when given) sets the throughput's unit: samples/s for file models, else tokens/s."""
    from meshplan.reports.plans import is_sequence_model

    sequences = plan is None or is_sequence_model(plan.model.spec)
    per_sample = 1 if sequences else plan.model.seq
    threshold = comparison.flag_fraction
    body = []
    if comparison.busy:
        body.append(paragraph(
            "Too noisy to judge: the machine was busy while measuring (" + "; ".join(comparison.busy) + "). Its "
            "step times include that work, which the calibrated profile does not price (calibration times "
            "compute in each process's own CPU seconds); measure again on a quiet machine.", "warn"))
    elif comparison.calibration:
        body.append(paragraph(
            "Too noisy to judge: the profile's calibration cannot judge these runs (" + "; ".join(comparison.calibration)
            + "). Calibrate again with the training's processes and threads on a quiet machine (meshplan calibrate "
            "--nproc N) before reading the error.", "warn"))
    elif comparison.too_noisy:
        body.append(paragraph(
            f"Too noisy to judge: the measured step times spread by {fmt_pct(comparison.spread_fraction)} "
            f"(coefficient of variation of the timed steps, or the spread of the runs' medians), more than the "
            f"{threshold:.0%} the prediction is judged by. The machine was busy or its clock varied; measure "
            "again on a quiet machine (and calibrate on that same machine state) before reading the error.", "warn"))
    elif comparison.flagged:
        body.append(paragraph(
            f"The predicted step time is off by {fmt_pct(comparison.error_fraction, signed=True)}, more than the "
            f"{threshold:.0%} the cost model aims for: recalibrate this machine (meshplan calibrate) or look at "
            "which term of the breakdown differs.", "warn"))
    body.append(table(
        ["predicted step", "measured median", "fastest", "slowest", "std dev", "runs", "timed steps", "error"],
        [[fmt_ms(comparison.predicted_step_time_s), fmt_ms(comparison.measured_median_s),
          fmt_ms(comparison.measured_min_s), fmt_ms(comparison.measured_max_s), fmt_ms(comparison.measured_stdev_s),
          len(measurements), sum(len(m.timed_steps_s) for m in measurements),
          _error_cell(comparison.error_fraction, comparison.flagged)]]))
    body.append(paragraph(f"Error = (predicted - measured median) / measured median; flagged above "
                          f"{threshold:.0%}. Positive means the prediction is pessimistic.", "note"))
    runs = [(m.source, m.step_times_s, m.warmup_steps) for m in measurements]
    fig = figures.measured_steps(runs, comparison.predicted_step_time_s, threshold)
    body.append(f'<div class="fig">{figure_div(fig, "fig-measured-steps")}</div>')
    run_rows = [[m.source, _host_text(m.host), len(m.step_times_s), m.warmup_steps, fmt_ms(m.median_step_time_s),
                 f"{m.tokens_per_s / per_sample:,.{0 if sequences else 1}f}", f"{m.losses[0]:.4f} -> {m.losses[-1]:.4f}" if m.losses else "n/a",
                 _versions_text(m.versions)] for m in measurements]
    body.append(table(["run", "host", "steps", "warm-up", "median step", "tokens/s" if sequences else "samples/s", "loss",
                       "versions"], run_rows))
    if comparison.memory:
        fig = figures.measured_memory([r.rank for r in comparison.memory], [r.predicted_bytes for r in comparison.memory],
                                      [r.measured_bytes for r in comparison.memory])
        body.append(f'<div class="fig">{figure_div(fig, "fig-measured-memory")}</div>')
        rows = [[f"rank {r.rank}", r.pipeline_rank, fmt_bytes(r.predicted_bytes), fmt_bytes(r.measured_bytes),
                 _error_cell(r.error_fraction, comparison.memory_flagged(r))] for r in comparison.memory]
        body.append(table(["rank", "pipeline stage", "predicted peak", "measured peak", "error"], rows))
        source = f" Measured by {comparison.memory_source}." if comparison.memory_source else ""
        body.append(paragraph(
            f"Per global rank: the measured peak of the last run against the predicted peak of the rank's "
            f"pipeline stage (rank r runs stage r // (dp x tp)). Error = (predicted - measured) / measured; "
            f"flagged above {comparison.memory_flag_fraction:.0%}.{source}", "note"))
    else:
        body.append(paragraph("The measured runs carry no per-rank peak memory.", "note"))
    return Section("measured", "Predicted vs measured", "".join(body))


def _host_text(host) -> str:
    if isinstance(host, dict):
        return ", ".join(f"{k}={v}" for k, v in host.items())
    return str(host)


def _versions_text(versions: dict) -> str:
    return json.dumps(versions, sort_keys=True)[:200] if versions else ""
