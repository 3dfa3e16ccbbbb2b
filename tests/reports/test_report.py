"""The HTML report: self-contained, every section, measured error figures, escaping, inputs."""
from __future__ import annotations

import json
import re
import statistics

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.plan import save_plan
from meshplan.reports import build_report, write_report
from meshplan.reports.alternatives import candidates, why_lost
from meshplan.planner.contracts.measurement import measurement_from_json
from meshplan.reports.compare import compare
from meshplan.reports.timeline import idle_fraction_per_rank, intervals_from_trace, with_idle
from tests.report_fixtures import GIB, gpipe_intervals, make_plan, measured

SECTION_IDS = ("summary", "layers", "memory", "timeline", "breakdown", "alternatives")


@pytest.fixture(scope="module")
def plan():
    return make_plan()


@pytest.fixture(scope="module")
def report_html(plan):
    return build_report(plan, trace=gpipe_intervals(2, 8, 1e-3, 2e-3))


def test_report_is_self_contained(report_html, tmp_path, plan):
    import plotly.offline

    # plotly.js inlined exactly once, and nothing loaded from elsewhere.
    assert report_html.count(plotly.offline.get_plotlyjs()) == 1
    assert not re.search(r"<script[^>]*\bsrc\s*=", report_html, re.I)
    assert not re.search(r"<link[^>]*\bhref\s*=", report_html, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?https?:", report_html, re.I)
    assert not re.search(r"<(img|iframe)[^>]*\bsrc\s*=\s*['\"]?https?:", report_html, re.I)
    out = write_report(plan, trace=gpipe_intervals(2, 8, 1e-3, 2e-3), out=tmp_path / "r" / "report.html")
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["report.html"]
    assert out.read_text().startswith("<!DOCTYPE html>")


def test_report_has_every_section(report_html, plan):
    for anchor in SECTION_IDS:
        assert f'<section id="{anchor}">' in report_html
    assert '<section id="measured">' not in report_html  # only with --measured
    # One plotly div per figure: layers, memory, timeline, breakdown, stage balance, alternatives.
    for div_id in ("fig-layers", "fig-memory", "fig-timeline", "fig-breakdown", "fig-balance", "fig-alternatives"):
        assert f'id="{div_id}"' in report_html
    # Summary figures come from the plan: step time, MFU, peak vs capacity.
    assert "500.00 ms" in report_html and "24.0%" in report_html
    peak_gib = plan.prediction["peak_memory_bytes"] / GIB
    assert f"{peak_gib:,.2f} GiB of 80.00 GiB" in report_html
    # Memory section speaks of model vs residual states and the precision recipe (2 + 2 + 12 bytes).
    assert "model states" in report_html and "residual states" in report_html
    assert "the ZeRO paper counts 2 + 2 + 12 = 16 bytes" in report_html
    # Per-layer table lists every layer.
    for layer in plan.layers:
        assert f"<td>{layer.name}</td>" in report_html


def test_zero_sharding_in_memory_recipe():
    plan = make_plan(pp=1, dp=4, tp=1, with_alternatives=False)
    from dataclasses import replace
    html = build_report(replace(plan, config=replace(plan.config, zero=3)), trace=[])
    # ZeRO-3 over dp=4 shards all three: 2/4 + 2/4 + 12/4 = 4 bytes per parameter (paper); the
    # executor's fully_shard keeps fp32 params, fp32 grads and two fp32 moments sharded: 4/4 + 4/4 + 8/4.
    assert "the ZeRO paper counts 0.5 + 0.5 + 3 = 4 bytes" in html
    assert "the executor allocates: 1 + 1 + 2 = 4 bytes" in html
    assert "No timeline" in html


def test_alternatives_explain_why_they_lost(plan):
    found = candidates(plan)
    assert [c.winner for c in found] == [True, False, False]
    usable = plan.cluster.device.usable_memory_bytes
    assert why_lost(found[1], found[0], usable).startswith("does not fit: needs 164.50 GiB")
    slower = why_lost(found[2], found[0], usable)
    # 1.3 x 500 ms = 650 ms: 150 ms slower (+30.0%); the largest breakdown increase is the bubble.
    assert slower.startswith("slower by 150.00 ms (+30.0%), mostly more bubble")


def _measured_report(plan, tmp_path, step_times_s, peak_scale=1.0, name="measured.json"):
    path = tmp_path / name
    path.write_text(json.dumps(measured(plan, step_times_s, warmup_steps=1, peak_scale=peak_scale)))
    return build_report(plan, measurements=[path], trace=gpipe_intervals(2, 8, 1e-3, 2e-3))


def test_measured_error_is_shown_and_flagged(plan, tmp_path):
    steps = [2.0, 0.61, 0.60, 0.59, 0.62]  # first step is warm-up: excluded
    html = _measured_report(plan, tmp_path, steps, peak_scale=1.0 / 0.8)
    median = statistics.median(steps[1:])
    error = (0.5 - median) / median  # -17.4%: over the 15% threshold
    assert '<section id="measured">' in html and 'id="fig-measured-steps"' in html
    assert f'<td class="flag error-pct">{error * 100:+.1f}%  over threshold</td>' in html
    assert "more than the 15%" in html
    assert f"605.00 ms, error {error * 100:+.1f}%  (over the threshold" in html  # summary row (median)
    # Memory: measured = predicted / 0.8, so the error is 0.8 - 1 = -20.0% on every rank, flagged.
    assert html.count('<td class="flag error-pct">-20.0%  over threshold</td>') == plan.config.gpus


def test_measured_within_threshold_is_not_flagged(plan, tmp_path):
    html = _measured_report(plan, tmp_path, [1.0, 0.52, 0.51, 0.53])
    assert f'<td class="ok error-pct">{(0.5 - 0.52) / 0.52 * 100:+.1f}%</td>' in html
    assert "over threshold" not in html


def test_compare_numbers(plan):
    run_a = measurement_from_json(measured(plan, [9.0, 0.4, 0.6]), "a.json")
    run_b = measurement_from_json(measured(plan, [9.0, 0.5, 0.7], peak_scale=0.5), "b.json")
    result = compare(plan, [run_a, run_b])
    assert result.measured_median_s == pytest.approx(statistics.median([0.4, 0.6, 0.5, 0.7]))
    assert (result.measured_min_s, result.measured_max_s) == (0.4, 0.7)
    assert result.per_run_median_s == pytest.approx((0.5, 0.6))
    assert result.error_fraction == pytest.approx((0.5 - 0.55) / 0.55)
    # Global rank r is on pipeline rank r // (dp * tp) = r // 4; memory is the last run's.
    assert [m.pipeline_rank for m in result.memory] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(m.error_fraction == pytest.approx(1.0) for m in result.memory)


def test_measured_for_another_plan_is_refused(plan, tmp_path):
    data = measured(plan, [1.0, 0.5])
    with pytest.raises(MeshplanError, match="measured for plan"):
        compare(plan, [measurement_from_json({**data, "plan_digest": "0" * 16}, "m.json")])
    with pytest.raises(MeshplanError, match="measured on 4 process"):
        compare(plan, [measurement_from_json({**data, "world_size": 4, "peak_memory_bytes_per_rank": []}, "m.json")])
    with pytest.raises(ValueError, match="warm-up"):
        measurement_from_json({**data, "warmup_steps": 3}, "m.json")
    assert measurement_from_json({**data, "warmup_steps": 2}, "m.json").timed_steps_s == (1.0, 0.5)


def test_user_text_is_escaped(tmp_path):
    evil = 'gpt:<script>alert("x")</script>&<b>'
    plan = make_plan(spec=evil)
    path = tmp_path / "<b>run&1.json"
    path.write_text(json.dumps(measured(plan, [1.0, 0.5, 0.5])))
    html = build_report(plan, measurements=[path], trace=[])
    assert evil not in html and "<script>alert" not in html and "<b>run" not in html
    assert "gpt:&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&lt;b&gt;" in html
    assert "&lt;b&gt;run&amp;1.json" in html
    assert "&lt;testhost&gt;" in html  # host names too


def test_gantt_idle_matches_gpipe_bubble():
    pp, num_microbatches, fwd_s, bwd_s = 2, 8, 1e-3, 2e-3
    step_s = (pp - 1 + num_microbatches) * (fwd_s + bwd_s)
    intervals = with_idle(gpipe_intervals(pp, num_microbatches, fwd_s, bwd_s), step_s)
    # GPipe's bubble: (pp - 1) / (pp - 1 + m) of the step on every rank.
    expected = (pp - 1) / (pp - 1 + num_microbatches)
    assert idle_fraction_per_rank(intervals) == pytest.approx({0: expected, 1: expected})


def test_chrome_trace_is_read():
    events = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}},
        {"ph": "X", "name": "forward", "ts": 0, "dur": 1000, "pid": 0, "tid": "compute", "args": {"microbatch": 0}},
        {"ph": "X", "name": "F0", "cat": "send", "ts": 1000, "dur": 50, "pid": 1, "tid": "p2p"},
    ]}
    intervals = intervals_from_trace(events)
    assert [(i.rank, i.stream, i.kind, i.microbatch) for i in intervals] == [(0, "compute", "forward", 0),
                                                                          (1, "p2p", "send", -1)]
    assert intervals[1].end_s == pytest.approx(1.05e-3)


def test_eighty_layer_plan_renders():
    plan = make_plan(num_blocks=80, pp=4, dp=2, tp=1)
    html = build_report(plan, trace=[])
    assert html.count("<tr><td>") >= 82  # every layer in the table


def test_cli_report(tmp_path, run_cli, plan):
    plan_path, trace_path = tmp_path / "plan.json", tmp_path / "trace.json"
    save_plan(plan, plan_path)
    trace_path.write_text(json.dumps({"timeline": [i.__dict__ for i in gpipe_intervals(2, 8, 1e-3, 2e-3)]}))
    (tmp_path / "m.json").write_text(json.dumps(measured(plan, [1.0, 0.5, 0.5])))
    code, out, err = run_cli("report", "--plan", plan_path, "--measured", tmp_path / "m.json", "--trace", trace_path,
                             "--out", tmp_path / "report.html")
    assert code == 0, err
    html = (tmp_path / "report.html").read_text()
    assert "trace file trace.json" in html and '<section id="measured">' in html
    code, _, err = run_cli("report", "--plan", tmp_path / "nope.json", "--out", tmp_path / "x.html")
    assert code == 2 and "plan file not found" in err
    code, _, err = run_cli("report", "--plan", plan_path, "--measured", tmp_path / "none.json",
                           "--out", tmp_path / "x.html")
    assert code == 2 and "measured file not found" in err


def test_simulator_chrome_trace_round_trips():
    from meshplan.planner.contracts.prediction import MemoryBreakdown, Prediction
    from meshplan.planner.simulation.simulator import chrome_trace
    from meshplan.reports.timeline import memory_from_trace

    intervals = gpipe_intervals(2, 4, 1e-3, 2e-3)
    curve = (((0.0, 1.0 * GIB), (4e-3, 3.0 * GIB)), ((0.0, 2.0 * GIB),))
    prediction = Prediction(step_time_s=0.015, tokens_per_s=1.0, model_tflops_per_gpu=1.0, hw_tflops_per_gpu=1.0,
                            mfu=0.1, peak_memory_bytes=3 * GIB, memory=(MemoryBreakdown(), MemoryBreakdown()),
                            bubble_fraction=0.2, fits=True, timeline=tuple(intervals), memory_timeline=curve)
    trace = json.loads(json.dumps(chrome_trace(prediction)))
    parsed = intervals_from_trace(trace)
    assert [(i.rank, i.stream, i.kind, i.microbatch) for i in parsed] == \
        [(i.rank, i.stream, i.kind, i.microbatch) for i in intervals]
    # Microsecond round trip: 1e-12 s absolute is far below anything the report shows.
    assert [i.end_s for i in parsed] == pytest.approx([i.end_s for i in intervals], abs=1e-12)
    parsed_curve = memory_from_trace(trace)
    assert [len(c) for c in parsed_curve] == [2, 1]
    flat = [value for c in parsed_curve for point in c for value in point]
    assert flat == pytest.approx([value for c in curve for point in c for value in point], rel=1e-9)


def test_hand_written_pipeline_plan_reports_memory_per_rank(tmp_path):
    """A `uniform_plan` under PP carries no per-layer times: the report still renders (stage balance
    left out) and compares every rank's measured peak with its pipeline stage's prediction."""
    from meshplan import simulate
    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.costing.hardware import load_cluster

    plan = uniform_plan("gpt:layers=2,hidden=64,heads=4,vocab=256", 32, 4, load_cluster("cpu"), pp=2,
                        microbatch_size=1)
    plan = plan.with_prediction(simulate(plan, timeline=False).to_json())
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({**measured(plan, [1.0, 0.5], peak_scale=1.25),
                                "memory_source": "torch.distributed._tools.mem_tracker.MemTracker"}))
    html = build_report(plan, measurements=[path])
    assert "no per-layer times" in html
    assert html.count('<td class="flag error-pct">-20.0%  over threshold</td>') == 2  # both ranks, 10% bound
    assert "Measured by torch.distributed._tools.mem_tracker.MemTracker" in html


def test_noisy_or_busy_measurements_are_said_so_not_judged_and_the_measured_throughput_is_shown(plan, tmp_path):
    """Step times that spread by more than the 15% threshold, or a CPU run on a host that other
    work loaded (its load average beyond the run's own workers), cannot judge a prediction: said,
    not flagged. A quiet run is judged, and its throughput shows in the summary beside the predicted."""
    from meshplan.executor.measure import host_info

    assert isinstance(host_info()["load_avg_1m"], float)  # the worker records it
    noisy = _measured_report(plan, tmp_path, [2.0, 0.40, 0.80, 0.45, 0.75])
    assert "Too noisy to judge" in noisy and "(too noisy to judge" in noisy
    assert "more than the 15% the cost model aims for" not in noisy
    steady = [1.0, 0.52, 0.51, 0.53]
    for load, busy in ((12.0, True), (8.5, False)):
        data = {**measured(plan, steady), "device": "cpu", "host": {"load_avg_1m": load, "cpu_count": 4}}
        path = tmp_path / f"m{load}.json"
        path.write_text(json.dumps(data))
        html = build_report(plan, measurements=[path], trace=[])
        assert ("the machine was busy while measuring" in html) is busy
        assert ("load average 12.0 on 4 CPU(s) with 8 worker(s): other work kept about 4.0 CPU(s) busy"
                in html) is busy
        assert ("noisy" in html) is busy
    predicted = plan.prediction["tokens_per_s"]  # the quiet run's summary: the measurement says 1000 tokens/s
    assert f"<th>predicted tokens/s (whole job)</th><td>{predicted:,.0f} tokens/s</td>" in html
    assert "<th>measured tokens/s (whole job)</th><td>1,000 tokens/s</td>" in html


def test_file_models_are_reported_in_samples_without_sequence_fields(tmp_path):
    plan = make_plan(spec="models/resnet.py:build")
    path = tmp_path / "m.json"
    path.write_text(json.dumps(measured(plan, [1.0, 0.52, 0.51, 0.53])))
    html = build_report(plan, measurements=[path], trace=[])
    assert "tokens/s" not in html and "tokens per step" not in html and "attention)" not in html
    assert "sequence 1024" not in html and "16 samples per step" in html
    assert f"{plan.prediction['tokens_per_s'] / 1024:,.1f} samples/s" in html
    assert f"<td>{1000.0 / 1024:,.1f}</td>" in html  # the run's samples/s


def test_compare_labels_plans_by_identity(tmp_path, run_cli):
    from meshplan.planner.contracts.plan import save_plan

    for folder, step in (("run1", 0.5), ("run2", 0.7)):
        (tmp_path / folder).mkdir()
        save_plan(make_plan(step_time_s=step, pp=2 if folder == "run1" else 1), tmp_path / folder / "plan.json")
    code, out, err = run_cli("compare", tmp_path / "run1" / "plan.json", tmp_path / "run2" / "plan.json")
    assert code == 0, err
    assert "run1/plan.json" in out.splitlines()[0] and "run2/plan.json" in out.splitlines()[0]
    assert "fastest: run1/plan.json" in out
    code, out, err = run_cli("compare", tmp_path / "run1" / "plan.json", tmp_path / "run1" / "plan.json")
    header = out.splitlines()[0]
    assert code == 0 and "plan.json (" in header and "#1" in header and "#2" in header


def test_the_live_memory_chart_covers_the_whole_step_and_is_not_flattened():
    """The simulator's curve ends at the last backward; the chart holds it to the step's end (the
    optimizer runs after it), and its axis starts at the resident states, not at zero."""
    from meshplan.reports.figures import memory_over_time

    gib = 2.0**30
    curves = (((0.0, 60 * gib), (0.1, 70 * gib), (0.3, 60 * gib)), ((0.0, 50 * gib), (0.2, 55 * gib), (0.35, 50 * gib)))
    fig = memory_over_time(curves, 80 * gib, step_time_s=0.5)
    assert [trace.x[-1] for trace in fig.data] == [500.0, 500.0]
    assert [trace.y[-1] for trace in fig.data] == [60.0, 50.0]
    low, high = fig.layout.yaxis.range
    assert 45.0 < low < 50.0 and 80.0 < high < 82.0


def test_one_busy_host_rule_for_calibration_and_the_report(monkeypatch):
    """Other work beyond half the CPUs makes a host busy; `meshplan calibrate` says so on stderr and
    in the profile's source, by the same rule the report applies to measured runs."""
    from meshplan.commands import calibrate
    from meshplan.planner.calibration.host import busy_host

    assert busy_host(2.9, 2, 2) == ""  # 0.9 CPUs of other work on 2: not over half
    assert busy_host(4.0, 2, 2) == "load average 4.0 on 2 CPU(s) with 2 worker(s): other work kept about 2.0 CPU(s) busy"
    monkeypatch.setattr("os.getloadavg", lambda: (9.7, 12.0, 13.6))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert calibrate._busy_note(2).startswith("load average 9.7 on 2 CPU(s)")
