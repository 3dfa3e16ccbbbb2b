"""Calibration on training's clock: one threads rule for calibrate's and train's workers, rounds
combined by their median with their spread recorded in the profile, and the report refusing to
judge runs by a calibration that was disturbed or measured other processes."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from meshplan.planner.calibration.conditions import median_of_rounds
from meshplan.planner.calibration.host import MAX_SPREAD, calibration_problems, threads_per_process
from meshplan.planner.calibration.runner import build_profile
from meshplan.planner.contracts.cluster import CalibrationConditions, cluster_from_dict, dump_cluster_toml
from meshplan.planner.contracts.measurement import measurement_from_json
from meshplan.reports.compare import compare
from tests.report_fixtures import make_plan, measured


def test_calibrate_and_train_give_each_process_the_same_threads(monkeypatch, tmp_path):
    assert threads_per_process(2, {"OMP_NUM_THREADS": "3"}) == 3
    assert threads_per_process(2, {"OMP_NUM_THREADS": "0"}) == max(1, (os.cpu_count() or 1) // 2)
    assert threads_per_process(64, {}) == max(1, (os.cpu_count() or 1) // 64)
    # `meshplan train`'s launcher hands its workers exactly that count
    from meshplan.executor import launch

    seen = {}

    def fake_run(command, env, *args):
        seen.update(env)
        return launch.LaunchResult(0, "")

    monkeypatch.setattr(launch, "_run_in_own_group", fake_run)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    launch.launch_jobs([{"plan": "p.json"}], 2, tmp_path)
    assert seen["OMP_NUM_THREADS"] == str(threads_per_process(2)) == "3"


def test_rounds_combine_by_their_median_and_record_their_spread():
    rounds = [[("all_reduce", 4096, 1.0e-4), ("all_reduce", 2**22, 4e-3)],
              [("all_reduce", 4096, 1.2e-4), ("all_reduce", 2**22, 8e-3)],
              [("all_reduce", 4096, 1.1e-4), ("all_reduce", 2**22, 5e-3)]]
    combined, spread = median_of_rounds(rounds)
    assert combined == [("all_reduce", 4096, 1.1e-4), ("all_reduce", 2**22, 5e-3)]
    # spreads (1.2 - 1.0) / 1.1 and (8 - 4) / 5: their median
    assert spread == pytest.approx(((0.2 / 1.1) + 0.8) / 2)


def _measured_profile(link_spread: float, load: float = 0.0, threads: int = 1):
    measured_run = {"dtype": "fp32", "threads": threads, "matmul": [[2e6, 1e-4], [2e8, 3e-3]],
                    "copy_bw_bytes_per_s": 2e10, "block_overhead_s": 1.5e-4, "compute_spread": 0.03,
                    "link_spread": link_spread, "load_avg_1m": load,
                    "block": [{"fwd_bwd_s": 3e-2, "fwd_flops": 4e8, "bwd_flops": 8e8, "saved_bytes": 7e6}],
                    "collectives": [["all_reduce", 4096, 1e-4], ["all_reduce", 2**22, 5e-3],
                                    ["send_recv", 2**20, 1e-3]]}
    return build_profile(measured_run, 2, "gloo", "here")


def test_the_profile_records_the_clock_it_was_measured_on():
    profile = _measured_profile(0.4, load=1.5)
    conditions = profile.calibration
    assert (conditions.processes, conditions.threads_per_process, conditions.dtype, conditions.rounds) == (2, 1, "fp32", 3)
    assert (conditions.compute_clock, conditions.link_clock) == ("cpu-time", "wall")
    assert (conditions.compute_spread, conditions.link_spread, conditions.load_avg_1m) == (0.03, 0.4, 1.5)
    assert cluster_from_dict(__import__("tomllib").loads(dump_cluster_toml(profile))).calibration == conditions
    with pytest.raises(ValueError, match="calibration.processes must be a positive integer"):
        replace(conditions, processes=0)


def _run(plan, threads: int) -> object:
    data = {**measured(plan, [1.0, 0.52, 0.51, 0.53]), "device": "cpu", "source": "run.json",
            "host": {"load_avg_1m": 0.5, "cpu_count": 64, "threads_per_process": threads}}
    return measurement_from_json(json.loads(json.dumps(data)), "run.json")


@pytest.mark.parametrize("link_spread, threads, flagged", [(0.05, 1, ""), (0.40, 1, "link timings spread 40%"),
                                                           (0.05, 2, "calibrated with 2 process(es) x 1")])
def test_a_calibration_off_the_runs_clock_is_not_judged(link_spread, threads, flagged):
    plan = make_plan(pp=1, dp=2, tp=1)  # 2 processes, as calibrated
    plan = replace(plan, cluster=replace(plan.cluster, calibration=_measured_profile(link_spread).calibration))
    comparison = compare(plan, [_run(plan, threads)])
    assert comparison.too_noisy is bool(flagged)
    assert any(flagged in note for note in comparison.calibration) is bool(flagged)
    if flagged:
        from meshplan.reports.measured import measured_section

        html = measured_section(comparison, [_run(plan, threads)]).body_html
        assert "Too noisy to judge: the profile&#x27;s calibration cannot judge these runs" in html


def test_calibration_problems_name_the_numbers():
    quiet = CalibrationConditions(processes=2, threads_per_process=1, dtype="fp32", rounds=3, compute_clock="cpu-time",
                                  link_clock="wall", compute_spread=0.02, link_spread=MAX_SPREAD, load_avg_1m=2.0,
                                  num_cpus=2)
    assert calibration_problems(quiet, 2, 1) == []
    assert calibration_problems(replace(quiet, compute_spread=0.2)) == [
        "calibration's compute timings spread 20% over 3 rounds (above 15%)"]
    assert calibration_problems(replace(quiet, load_avg_1m=5.0)) == [
        "calibrated on a busy host (load average 5.0 on 2 CPU(s) with 2 worker(s): other work kept about 3.0 CPU(s) "
        "busy)"]
    assert calibration_problems(quiet, 4, 1) == [
        "calibrated with 2 process(es) x 1 thread(s), trained with 4 x 1: calibrate with --nproc 4 and the same "
        "OMP_NUM_THREADS"]
