"""The error bands: measured by the benchmark on the held-out runs (not typed), and shown beside
every predicted step in the CLI and its JSON, and beside training time and cost."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.planner.costing.error_bands import (Band, band_for, band_from_errors, band_text, bands_document,
                                                  load_all_bands, load_bands, MissingBand, profile_runs,
                                                  step_uncertainty)
from meshplan.planner.costing.hardware import PROFILES_DIR
from tests.benchmark_modules import benchmark_module



def missing_band_text(config, spec: str, seq: int, cluster) -> str:
    """The line a prediction prints for its missing band ("" where it has one)."""
    uncertainty = step_uncertainty(config, spec, seq, cluster)
    return uncertainty.text() if isinstance(uncertainty, MissingBand) else ""


def test_the_bands_file_is_the_benchmarks_measurement():
    """Each regime's band counts its held-out runs on validated profiles in published_runs.py, each
    unvalidated profile's its own runs, and every band says how it was measured: the file is
    written by bench_fidelity.py --write-bands, not by hand."""
    from meshplan.planner.costing.hardware import load_cluster

    runs = benchmark_module("published_runs")
    data = json.loads((Path(PROFILES_DIR) / "error_bands.json").read_text())
    assert data["written_by"] == "benchmarks/bench_fidelity.py --write-bands"
    groups = {"dense": runs.HELD_OUT, "fp8": runs.HELD_OUT_FP8, "moe": runs.HELD_OUT_MOE}
    bands = load_bands()
    for regime, group in groups.items():
        members = [run for run in runs.all_runs() if run.group == group]
        validated = sum(load_cluster(run.cluster).validated for run in members)
        assert bands[regime].num_runs == validated and "bench_fidelity.py" in bands[regime].how
        for profile in {run.cluster for run in members if not load_cluster(run.cluster).validated}:
            own = profile_runs(profile, regime)
            assert own.num_runs == sum(run.cluster == profile for run in members) and profile in own.how


def test_band_from_errors_percentiles_and_extremes():
    many = band_from_errors("dense", [i / 100 for i in range(-50, 51)], "synthetic")
    assert (many.error_low, many.error_high) == pytest.approx((-0.40, 0.40))
    few = band_from_errors("moe", [-0.2, 0.1, 0.5], "synthetic")
    assert (few.error_low, few.error_high) == (-0.2, 0.5) and "extremes of 3 runs" in few.how
    # predicted 1 s, errors -20%..+50%: the measured step is expected in [1/1.5, 1/0.8] s
    assert few.around(1.0) == pytest.approx((1 / 1.5, 1 / 0.8))
    with pytest.raises(ValueError):
        Band("dense", 0.2, 0.1, 5, "not a band")


def test_band_text_reads_without_exponents():
    """A step predicted 5.274 s with a band of -50% to +1% is likely 5,222 to 10,548 ms: the
    predicted time over (1 + error), thousands written out, not as 1.055e+04."""
    band = Band("moe", -0.5, 0.01, 13, "test")
    text = band_text(band, 5.274, 1e3, "ms")
    low, high = 5.274 / 1.01 * 1e3, 5.274 / 0.5 * 1e3
    assert text.startswith(f"likely {low:.4g}-{high:,.0f} ms") and "e+" not in text, text
    assert band_text(band, 0.5, 1e3, "ms").startswith("likely 495-1000 ms")


def test_estimate_json_and_text_carry_the_band(run_cli):
    args = ("estimate", "--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "32", "--seq",
            "2048", "--tp", "2", "--zero", "1")
    code, stdout, err = run_cli(*args, "--json")
    assert code == 0, err
    data = json.loads(stdout)
    dense = load_bands()["dense"]
    band = data["uncertainty"]
    assert band["regime"] == "dense" and band["num_runs"] == dense.num_runs
    assert band["step_time_s"] == pytest.approx(list(dense.around(data["step_time_s"])))
    assert (band["profile_validated"], band["runs"]) == (True, "validated profiles")
    code, stdout, _ = run_cli(*args, "--precision", "fp8", "--json")
    assert json.loads(stdout)["uncertainty"]["regime"] == "fp8"
    code, stdout, _ = run_cli(*args)
    assert "step time band   likely" in stdout and "held-out dense runs" in stdout
    code, stdout, _ = run_cli("estimate", "--model", "gpt:layers=2,hidden=64,heads=4,vocab=256", "--cluster", "cpu",
                              "--gpus", "2", "--gbs", "4", "--seq", "32", "--json")
    assert "uncertainty" not in json.loads(stdout)  # fp32 on CPU processes: no published run measured it


def test_training_time_and_cost_carry_the_band():
    from meshplan.planner.engines.sizing import training_cost

    cost = training_cost(64, 1e12, 2e6, 1.0, usd_per_gpu_hour=2.0, step_error_band=(-0.2, 0.25))
    data = cost.to_json()
    assert data["days_range"] == pytest.approx([cost.days / 1.25, cost.days / 0.8])
    assert data["usd_range"] == pytest.approx([cost.usd / 1.25, cost.usd / 0.8])
    assert "days_range" not in training_cost(64, 1e12, 2e6, 1.0).to_json()


def _bands_file(tmp_path, bands: list[Band]) -> str:
    path = tmp_path / "bands.json"
    path.write_text(bands_document(bands, "test"))
    return str(path)


def test_an_unvalidated_profile_takes_only_its_own_runs(tmp_path, monkeypatch):
    """A validated profile gets its regime's pooled band; a profile from published specifications
    only gets a band from its own held-out runs when it has at least 10, else none, with one line
    saying what its runs read (or that none ran)."""
    from dataclasses import replace

    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.costing import error_bands
    from meshplan.planner.costing.hardware import load_cluster

    pooled = Band("dense", -0.05, 0.12, 200, "pooled")
    many = band_from_errors("fp8", [-0.25 + i / 100 for i in range(12)], "its own", "h100-96g-500w")
    few = band_from_errors("moe", [-0.58, -0.24, -0.42], "its own", "b200")
    path = _bands_file(tmp_path, [pooled, many, few])
    written = load_all_bands.__wrapped__(path)  # the file read back, uncached
    monkeypatch.setattr(error_bands, "load_all_bands", lambda path=None: written)
    assert {(band.regime, band.profile) for band in error_bands.load_all_bands()} == {
        ("dense", ""), ("fp8", "h100-96g-500w"), ("moe", "b200")}
    dense = ParallelConfig(gpus=8, dp=8, global_batch=8)
    fp8 = replace(dense, precision="fp8")
    h100, capped, b200 = (load_cluster(name) for name in ("h100-sxm", "h100-96g-500w", "b200"))
    assert band_for(dense, False, h100) == pooled
    assert band_for(fp8, False, h100) is None  # the file has no pooled fp8 band
    assert band_for(fp8, False, capped) == many and band_for(dense, False, capped) is None
    assert band_for(dense, True, b200) is None  # 3 runs: too few for a band
    text = missing_band_text(dense, "qwen3-30b-a3b", 4096, b200)
    assert "profile 'b200' is not validated" in text and "3 held-out moe runs read -58% to -24%" in text, text
    assert "no held-out dense run has checked it" in missing_band_text(dense, "llama3-8b", 4096, b200)
    assert missing_band_text(dense, "llama3-8b", 4096, h100) == ""
    assert "on profile h100-96g-500w (not validated)" in band_text(many, 1.0, 1e3, "ms")


def test_estimate_on_an_unvalidated_profile_claims_no_band(run_cli):
    """The shipped file: b200 has no held-out dense run, so its dense prediction carries no band but
    says why, in the text and under `unvalidated_profile` in the JSON."""
    args = ("estimate", "--model", "llama3-8b", "--cluster", "b200", "--gpus", "8", "--gbs", "32", "--seq",
            "2048", "--zero", "1")
    code, stdout, err = run_cli(*args, "--json")
    assert code == 0, err
    data = json.loads(stdout)
    assert "uncertainty" not in data
    assert data["unvalidated_profile"] == {"profile": "b200", "regime": "dense", "num_runs": 0}
    code, stdout, _ = run_cli(*args)
    assert "step time band   none: profile 'b200' is not validated" in stdout and "likely" not in stdout
    assert "`meshplan calibrate --from-runs` fits it to steps you measured" in stdout  # the way to a band
    assert stdout.splitlines()[0].startswith("llama3-8b on 8 x b200 (profile not validated): ")
    # the power-capped H100 ran 18 held-out FP8 runs of its own: its FP8 predictions carry their band
    capped = ("estimate", "--model", "llama3-8b", "--cluster", "h100-96g-500w", "--gpus", "8", "--gbs", "32",
              "--seq", "2048", "--zero", "1", "--precision", "fp8", "--json")
    code, stdout, err = run_cli(*capped)
    assert code == 0, err
    band = json.loads(stdout)["uncertainty"]
    own = profile_runs("h100-96g-500w", "fp8")
    assert (band["profile_validated"], band["runs"], band["num_runs"]) == (False, "own", own.num_runs)


def test_a_profile_fitted_to_measured_runs_carries_their_band(tmp_path):
    """`calibrate --from-runs` records the leave-one-out errors of its fit (`FittedRuns`): from ten
    runs on, predictions in a regime the runs covered carry them as the profile's own band, on a
    validated profile or not; fewer, a validated profile keeps the pooled band and one that is not
    validated still has none, its line saying what the fitted runs read. The record survives the
    profile's TOML."""
    from dataclasses import replace

    from meshplan.planner.contracts.cluster import FittedRuns, cluster_from_dict, dump_cluster_toml
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.costing.hardware import load_cluster

    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover
        import tomli as tomllib
    dense = ParallelConfig(gpus=8, dp=8, global_batch=8)
    ours = replace(load_cluster("h100-sxm"), name="ours", fitted_runs=FittedRuns(12, -0.04, 0.03, "dense"))
    band = band_for(dense, False, ours)
    assert (band.error_low, band.error_high, band.num_runs, band.fitted) == (-0.04, 0.03, 12, True)
    assert "(the runs it was fitted to, left out in turn, err -4% to +3%, 12 runs)" in band_text(band, 1.0, 1e3, "ms")
    assert band_for(dense, True, ours) == load_bands()["moe"]  # no MoE run was fitted: the pooled band
    few = replace(ours, fitted_runs=FittedRuns(3, -0.02, 0.05, "dense"))
    assert band_for(dense, False, few) == load_bands()["dense"]
    b200 = replace(load_cluster("b200"), fitted_runs=FittedRuns(3, -0.02, 0.05, "dense"))
    assert band_for(dense, False, b200) is None
    text = missing_band_text(dense, "llama3-8b", 4096, b200)
    assert "the 3 measured runs it was fitted to read -2% to +5% left out in turn, too few for a band" in text, text
    assert "calibrate --from-runs" not in text  # already fitted: no hint to do it again
    assert band_for(dense, False, replace(b200, fitted_runs=FittedRuns(10, -0.02, 0.05, "dense"))).fitted
    again = cluster_from_dict(tomllib.loads(dump_cluster_toml(ours)))
    assert again.fitted_runs == ours.fitted_runs
    with pytest.raises(ValueError, match="fitted_runs.num_runs must be a positive integer"):
        FittedRuns(0, -0.1, 0.1)
