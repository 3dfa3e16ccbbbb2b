"""The CPU's GEMMs by width (`costing.gemm.width_factor`, `calibration.fits.fit_width_efficiency`):
a synthetic sweep fitted back, the interpolation between widths, the profile field through
`build_profile` and TOML, and small models priced by it."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.calibration.fits import fit_width_efficiency
from meshplan.planner.calibration.gemm_sweep import SWEEP_WIDTHS, sweep_shapes
from meshplan.planner.calibration.runner import build_profile
from meshplan.planner.contracts.cluster import cluster_from_dict, dump_cluster_toml
from meshplan.planner.costing.gemm import gemm_time_s, width_factor, width_table
from meshplan.planner.costing.hardware import load_cluster

# a CPU whose narrow GEMMs run well below the size curve, recovering towards wide ones
TRUE_TABLE = {"16": 0.25, "64": 0.55, "512": 0.95}


def _with_table(table: dict[str, float]):
    cpu = load_cluster("cpu")
    return replace(cpu, device=replace(cpu.device, matmul_width_efficiency=table))


def test_the_fit_reproduces_a_synthetic_sweep():
    truth = _with_table(TRUE_TABLE)
    samples = [(m, n, k, gemm_time_s(m, n, k, truth, "fp32")) for m, n, k in sweep_shapes()]
    fitted = fit_width_efficiency(samples, load_cluster("cpu").device, "fp32")
    assert list(fitted) == [str(width) for width in SWEEP_WIDTHS]
    # the swept widths between the true table's points read its log-linear interpolation: 32 is
    # halfway from 16 to 64, 128 a third of the way from 64 to 512
    assert fitted["16"] == pytest.approx(0.25) and fitted["64"] == pytest.approx(0.55)
    assert fitted["32"] == pytest.approx(0.40) and fitted["128"] == pytest.approx(0.55 + 0.4 / 3)
    refit = _with_table(fitted)
    for m, n, k, seconds in samples:
        assert gemm_time_s(m, n, k, refit, "fp32") == pytest.approx(seconds, rel=1e-9)


def test_the_factor_interpolates_in_log_width_and_clamps():
    table = width_table(_with_table(TRUE_TABLE).device)
    assert table == ((16, 0.25), (64, 0.55), (512, 0.95))
    assert width_factor(8, table) == 0.25 and width_factor(4096, table) == 0.95
    assert width_factor(256, table) == pytest.approx(0.55 + 0.4 * 2 / 3)
    assert width_factor(100, ()) == 1.0  # no table: the size curve alone


def test_a_narrow_gemm_costs_what_the_table_says_and_wide_profiles_are_unchanged():
    cpu, truth = load_cluster("cpu"), _with_table(TRUE_TABLE)
    assert gemm_time_s(1024, 64, 64, truth, "fp32") == pytest.approx(gemm_time_s(1024, 64, 64, cpu, "fp32") / 0.55)
    from meshplan.planner.simulation.estimator import estimate

    small = "gpt:layers=2,hidden=64,heads=4,vocab=256"
    plain = estimate(small, cpu, gpus=1, global_batch=4, seq=128, precision="fp32")
    narrow = estimate(small, truth, gpus=1, global_batch=4, seq=128, precision="fp32")
    assert narrow.breakdown["compute"] > plain.breakdown["compute"]


def test_build_profile_fits_the_sweep_and_the_table_survives_toml():
    truth = _with_table(TRUE_TABLE)
    measured = {"dtype": "fp32", "threads": 1, "matmul": [[2e6, 1e-4], [2e8, 3e-3]],
                "copy_bw_bytes_per_s": 2e10, "block_overhead_s": 1.5e-4,
                "block": [{"fwd_bwd_s": 3e-2, "fwd_flops": 4e8, "bwd_flops": 8e8, "saved_bytes": 7e6}],
                "collectives": [["all_reduce", 4096, 1e-4], ["all_reduce", 2**22, 5e-3], ["send_recv", 2**20, 1e-3]]}
    plain = build_profile(measured, 2, "gloo", "here")
    # the sweep as this profile's own size curve with the true table would time it
    probe = replace(plain, device=replace(plain.device, matmul_width_efficiency=TRUE_TABLE))
    measured["gemm_widths"] = [[m, n, k, gemm_time_s(m, n, k, probe, "fp32")] for m, n, k in sweep_shapes()]
    profile = build_profile(measured, 2, "gloo", "here")
    table = profile.device.matmul_width_efficiency
    assert table["16"] == pytest.approx(0.25) and table["512"] == pytest.approx(0.95)
    assert "matmul_width_efficiency: 18 fp32 GEMMs of 512 rows at widths 16-512" in profile.device.source
    loaded = cluster_from_dict(__import__("tomllib").loads(dump_cluster_toml(profile)))
    assert loaded.device.matmul_width_efficiency == pytest.approx(table)


def test_the_table_is_validated():
    with pytest.raises(ValueError, match="widths are positive integers"):
        _with_table({"wide": 1.0})
    with pytest.raises(ValueError, match="matmul_width_efficiency.64 must be a finite number > 0"):
        _with_table({"64": 0.0})
