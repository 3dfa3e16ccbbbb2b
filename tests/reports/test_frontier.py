"""The time/cost frontier of `plan --train-tokens --deadline-days` in the report: table and figure."""
from __future__ import annotations

import json

from meshplan.planner.contracts.plan import save_plan
from meshplan.planner.engines.sizing import Sizing, training_cost
from meshplan.reports import build_report
from tests.report_fixtures import make_plan

TOKENS = 1e12


def _sizing() -> Sizing:
    # 8 GPUs scale perfectly to 16 (2x the tokens/s), 32 GPUs keep only 75% per GPU.
    rows = tuple(training_cost(gpus, TOKENS, tokens_per_s, 1.0, 2.0, f"config {gpus}")
                 for gpus, tokens_per_s in ((8, 1e5), (16, 2e5), (32, 3e5)))
    return Sizing(rows=rows, deadline_days=60.0, chosen=rows[1])


def test_frontier_section_table_and_plot():
    sizing = _sizing()
    html = build_report(make_plan(), trace=[], sizing=sizing.to_json())
    assert '<section id="frontier">' in html and 'id="fig-frontier"' in html
    section = html.split('<section id="frontier">')[1].split("</section>")[0]
    for heading in ("GPUs", "tokens/s", "tokens/s per GPU", "per GPU vs 8 GPUs", "days", "GPU-hours", "cost USD",
                    "meets 60 days"):
        assert f"<th>{heading}</th>" in section
    # Days, GPU-hours and cost from the sizing arithmetic; per-GPU throughput against 8 GPUs.
    days_16 = TOKENS / 2e5 / 86400
    assert f"<td>{days_16:,.2f}</td>" in section and f"<td>{days_16 * 24 * 16 * 2:,.0f}</td>" in section
    assert section.count('<td>100.0%</td>') == 2  # 8 GPUs itself and 16 GPUs: linear
    assert '<td class="flag">75.0%</td>' in section  # 32 GPUs: a quarter lost to scaling
    assert '<td class="winner">16</td>' in section  # the size chosen for the deadline
    assert "the cheapest size that meets it is 16 GPUs" in section
    # The plot: tokens/s against the linear-scaling line, days against the deadline, cost.
    assert "linear scaling" in section and "deadline 60 days" in section


def test_frontier_read_from_the_plan_file(tmp_path):
    plan = make_plan()
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    assert '<section id="frontier">' not in build_report(path, trace=[])
    data = json.loads(path.read_text())
    data["sizing"] = _sizing().to_json()
    path.write_text(json.dumps(data))
    html = build_report(path, trace=[])
    assert '<section id="frontier">' in html and "config 32" in html
