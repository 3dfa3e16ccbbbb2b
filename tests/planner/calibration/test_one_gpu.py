"""`calibrate --nproc 1` on a GPU: the measurement of one device becomes a profile whose GEMM curve,
priced with tiles and waves by `costing.gemm`, gives back the timed square GEMMs, and whose links
are the base profile's (nothing measured them). Built from synthetic measurements: no GPU needed."""
from dataclasses import replace

import pytest

from meshplan.planner.calibration.compute_bench import GPU_SHAPES, block_figures
from meshplan.planner.calibration.runner import build_profile, calibrate
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing.gemm import gemm_time_s, wave_efficiency
from meshplan.planner.costing.hardware import load_cluster


def _measured(truth) -> dict:
    """What rank 0 would report on `truth`'s device: square GEMMs timed as `gemm_time_s` prices them."""
    matmul = [(2.0 * n**3, gemm_time_s(n, n, n, truth, "bf16")) for n in GPU_SHAPES.matmul_n]
    return {"dtype": "bf16", "threads": 1, "matmul": matmul, "copy_bw_bytes_per_s": 4.3e12,
            "block_overhead_s": 2e-5, "collectives": [], "link_spread": 0.0,
            "block": [{**figures, "fwd_bwd_s": 5e-3 * (i + 1)} for i, figures in enumerate(block_figures(cuda=True))],
            "device_name": "NVIDIA H200", "memory_bytes": 150754820096}


def test_one_gpu_profile_recovers_the_gemm_curve_and_keeps_the_base_links():
    h200 = load_cluster("h200")
    truth = replace(h200, device=replace(h200.device, matmul_efficiency=0.79, matmul_half_efficiency_flops=3e9))
    # the sizes span both sides of a wave boundary, so the waves matter to the fit
    assert min(wave_efficiency(n, n, h200.device.num_sms) for n in GPU_SHAPES.matmul_n) < 0.99
    profile = build_profile(_measured(truth), 1, "nccl", "one-h200")
    assert profile.device.matmul_efficiency == pytest.approx(0.79, rel=1e-6)
    assert profile.device.matmul_half_efficiency_flops == pytest.approx(3e9, rel=1e-4)
    for n in (1024, 3000, 8192):  # so every square GEMM is priced as it was timed
        assert gemm_time_s(n, n, n, profile, "bf16") == pytest.approx(gemm_time_s(n, n, n, truth, "bf16"), rel=1e-4)
    assert profile.intra_node.bw_bytes_per_s == h200.intra_node.bw_bytes_per_s
    assert profile.inter_node == h200.inter_node and "no link" in profile.intra_node.source
    assert profile.gpus_per_node == 1 and profile.device.memory_bytes == 150754820096


def test_one_process_is_refused_on_cpu_in_one_line():
    with pytest.raises(MeshplanError, match="--nproc must be at least 2 with --backend gloo, got 1"):
        calibrate(nproc=1, backend="gloo")
