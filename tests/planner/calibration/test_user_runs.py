"""calibrate --from-runs: a profile fitted to measured runs recovers the efficiency the runs were
measured at, with leave-one-out figures printed and the fit set recorded in the profile."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.measurement import Measurement, save_measurement
from meshplan.planner.contracts.plan import save_plan
from meshplan.planner.simulation.simulator import simulate
from tests.planner.engines.helpers import make_plan

TRUE_EFFICIENCY = 0.40  # the "cluster" the runs were measured on: slower GEMMs than the a100-80g profile


def _runs(tmp_path):
    """Three plans (different meshes and batches) and their measured.json, measured as the
    simulator predicts them on the a100-80g profile at TRUE_EFFICIENCY."""
    items = []
    for index, kw in enumerate((dict(tp=2, pp=2, dp=2), dict(tp=1, pp=1, dp=8, sp=False, gbs=64),
                                dict(tp=2, pp=1, dp=4, mbs=4, recompute="full"))):
        plan = make_plan(**kw)
        truth = replace(plan.cluster, device=replace(plan.cluster.device, matmul_efficiency=TRUE_EFFICIENCY))
        step = simulate(replace(plan, cluster=truth), timeline=False).step_time_s
        plan_path, measured_path = tmp_path / f"plan{index}.json", tmp_path / f"measured{index}.json"
        save_plan(plan, plan_path)
        save_measurement(Measurement(world_size=plan.config.gpus, plan_digest="", step_times_s=(step,) * 3,
                                     warmup_steps=0, peak_memory_bytes_per_rank=()), measured_path)
        items.append(f"{plan_path},{measured_path}")
    return items


def test_calibrate_from_runs_recovers_the_efficiency(run_cli, tmp_path):
    from meshplan.planner.costing.hardware import load_cluster

    out = tmp_path / "mine.toml"
    code, stdout, err = run_cli("calibrate", "--from-runs", *_runs(tmp_path), "--cluster", "a100-80g", "--out", out)
    assert code == 0, err
    profile = load_cluster(out)
    assert profile.device.matmul_efficiency == pytest.approx(TRUE_EFFICIENCY, rel=0.01)
    assert "fitted by meshplan calibrate --from-runs to 3 measured runs (plan0.json, plan1.json, plan2.json)" \
        in profile.device.source
    assert profile.name == "mine"
    text = out.read_text()
    assert "# leave-one-out" in text and "plan0.json" in text
    # every left-out run is predicted within 1% by the profile fitted to the other two, and was
    # off by more than 10% with the shipped profile
    rows = [line for line in stdout.splitlines() if "measured" in line and "ms" in line]
    assert len(rows) == 3
    for row in rows:
        before, after = (float(value.rstrip("%")) for value in row.split()[-3::2])
        assert abs(after) < 1.0 and abs(before) > 10.0, row
    # the profile records its fit for the error band: the runs, their regime, and the extremes of the
    # leave-one-out errors printed above (to their 0.1% rounding; under ten runs, no percentiles)
    afters = [float(row.split()[-1].rstrip("%")) / 100 for row in rows]
    fitted = profile.fitted_runs
    assert (fitted.num_runs, fitted.regimes) == (3, "dense")
    assert (fitted.error_low, fitted.error_high) == pytest.approx((min(afters), max(afters)), abs=6e-4)


def test_calibrate_from_runs_errors(run_cli, tmp_path):
    items = _runs(tmp_path)
    code, _, err = run_cli("calibrate", "--from-runs", *items, "--out", tmp_path / "x.toml")
    assert code == 2 and "--cluster" in err
    code, _, err = run_cli("calibrate", "--from-runs", items[0], "--cluster", "a100-80g", "--out", tmp_path / "x.toml")
    assert code == 2 and "at least 2 runs" in err
    code, _, err = run_cli("calibrate", "--from-runs", "plan.json", "--cluster", "a100-80g", "--out",
                           tmp_path / "x.toml")
    assert code == 2 and "CONFIG,MEASURED" in err


def test_a_run_measured_by_an_engine_log(tmp_path):
    """CONFIG,LOG: the engine config that ran and its training log (read with the config's engine)."""
    from pathlib import Path

    from meshplan.commands.calibrate_runs import user_run
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.engines.bridge import export_plan

    plan = make_plan(tp=2, pp=2, dp=2)
    config = tmp_path / "pretrain.args"
    config.write_text(export_plan(plan, "megatron").text)
    log = Path(__file__).parents[1] / "engines" / "fixtures" / "logs" / "nemo_esm2.log"
    run = user_run(f"{config},{log}", load_cluster("a100-80g"), None, None)
    assert run.name == "pretrain.args"
    assert run.measured_step_s == pytest.approx(0.0316)  # the median of the logged steps
    as_run = replace(plan, config=replace(plan.config, engine="megatron"))  # its memory recipe and overlap
    assert run.predict_s(plan.cluster) == pytest.approx(simulate(as_run, timeline=False).step_time_s, rel=0.01)
    with pytest.raises(MeshplanError, match="CONFIG,MEASURED"):
        user_run(str(config), plan.cluster, None, None)
