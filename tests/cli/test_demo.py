"""`meshplan demo` plumbing: the steps, their order and arguments, failure handling, and a real
plan + report of the large-model half on a small model (the full demo is `make demo`)."""
from __future__ import annotations

import pytest

from meshplan.demo import DemoConfig, DemoResult, run_demo, run_large_plan
from meshplan.planner.contracts.errors import MeshplanError


def test_demo_runs_the_loop_in_order_and_names_the_failing_step(tmp_path):
    calls: list[list[str]] = []

    def fake_cli(argv: list[str]) -> int:  # records the commands; `train` fails like a crashed run
        calls.append(argv)
        return 2 if argv[0] == "train" else 0

    config = DemoConfig(out_dir=tmp_path, train_steps=3)
    with pytest.raises(MeshplanError, match="demo step 'train' failed"):
        run_demo(config, cli_main=fake_cli, say=lambda _: None)
    assert [argv[0] for argv in calls] == ["calibrate", "profile", "plan", "train"]
    calibrate, _, plan, train = calls
    profile_path = str(tmp_path / "local" / "cpu-calibrated.toml")
    assert calibrate[calibrate.index("--out") + 1] == profile_path and "--quick" in calibrate
    assert calibrate[calibrate.index("--nproc") + 1] == "2" and calibrate[calibrate.index("--backend") + 1] == "gloo"
    # The plan is made on the calibrated profile for 2 processes, and that very plan is trained.
    assert plan[plan.index("--cluster") + 1] == profile_path and plan[plan.index("--gpus") + 1] == "2"
    assert train[train.index("--plan") + 1] == plan[plan.index("--out") + 1]
    assert train[train.index("--steps") + 1] == "3"
    assert not (tmp_path / "local" / "report.html").exists()  # nothing reported after a failure


def test_demo_config_is_validated():
    with pytest.raises(ValueError, match="train_steps must be positive"):
        DemoConfig(train_steps=0)


@pytest.mark.timeout(240)
def test_large_plan_half_writes_a_real_report(tmp_path):
    # The same code path as llama3-70b on 64 H100s, on a model small enough for the test suite.
    config = DemoConfig(out_dir=tmp_path, large_model="gpt:layers=4,hidden=256,heads=4,vocab=4096",
                        large_gpus=8, large_global_batch=16, large_seq=128)
    result = DemoResult()
    from meshplan.cli import main

    report = run_large_plan(config, cli_main=main,
                            result=result, say=lambda _: None)
    html = report.read_text()
    assert result.files["large_plan"].exists()
    for anchor in ("summary", "layers", "memory", "timeline", "breakdown", "alternatives"):
        assert f'<section id="{anchor}">' in html
    assert "No timeline" not in html  # the simulator re-played the plan for the Gantt chart
    assert "gpt:layers=4,hidden=256,heads=4,vocab=4096" in html
