"""The documented Python API: `import meshplan; meshplan.<function>(...)`, plain functions that
give the same results as the stage functions they front."""
from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import meshplan

TINY = "gpt:layers=2,hidden=64,heads=4,vocab=128"


def test_public_api_is_plain_functions():
    assert sorted(meshplan.__all__) == ["estimate", "load_cluster", "load_plan", "plan", "profile", "simulate",
                                        "train", "write_report"]
    for name in meshplan.__all__:
        assert inspect.isfunction(getattr(meshplan, name)), name


@pytest.mark.timeout(120)
def test_importing_meshplan_does_not_import_torch():
    code = "import sys, meshplan; meshplan.load_cluster('cpu'); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


@pytest.mark.timeout(120)
def test_api_round_trip_matches_the_stage_functions(tmp_path):
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.simulation.simulator import simulate_config

    cluster = meshplan.load_cluster("cpu")
    graph = meshplan.profile(TINY, 32, dtype="fp32")
    assert graph.total_params > 0
    config = ParallelConfig(gpus=1, global_batch=2, precision="fp32")
    estimate = meshplan.estimate(TINY, cluster, gpus=1, global_batch=2, seq=32, precision="fp32")
    assert estimate.step_time_s == pytest.approx(simulate_config(graph, cluster, config).step_time_s, rel=1e-12)

    plan = meshplan.plan(TINY, "cpu", 2, 4, seq=32, workers=1)
    from meshplan.planner.contracts.plan import save_plan

    save_plan(plan, tmp_path / "plan.json")
    loaded = meshplan.load_plan(tmp_path / "plan.json")
    assert loaded.digest == plan.digest
    assert meshplan.simulate(loaded).step_time_s == pytest.approx(plan.prediction["step_time_s"], rel=1e-9)
    out = meshplan.write_report(loaded, out=tmp_path / "report.html")
    assert out.read_text().lstrip().lower().startswith("<!doctype html")
