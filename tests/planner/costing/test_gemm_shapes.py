"""GEMMs priced by shape (planner.costing.gemm) and attention kernels by name
(planner.costing.attention_kernels): wave quantisation, the roofline, thin shards, the kernels'
published ratios and ramps."""
from dataclasses import replace

import pytest

from meshplan.planner.contracts.attention import ATTENTION_CHOICES, canonical_attention, check_attention, is_fused
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing import gemm
from meshplan.planner.costing.attention_kernels import attention_efficiency
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.profiling.profiler import profile


def test_wave_quantisation_counts_the_partly_filled_last_wave():
    # 132 SMs: 264 tiles of 128x256 fill two waves exactly
    assert gemm.wave_efficiency(128 * 12, 256 * 22, 132) == pytest.approx(1.0)
    # one more tile row: 286 such tiles need a third wave (286/396); 572 tiles of 128x128 fill 5 of
    # 660 slots better, and the best tile is taken
    assert gemm.wave_efficiency(128 * 13, 256 * 22, 132) == pytest.approx(572 / 660)
    # a 100 x 100 output: one tile shrunk to 112 x 112 (MMA granularity 16), K split over the SMs
    assert gemm.wave_efficiency(100, 100, 132) == pytest.approx(100 * 100 / (112 * 112))
    assert gemm.wave_efficiency(100, 100, 0) == 1.0  # no SMs (the CPU profile): no quantisation


def test_large_gemm_reaches_the_fitted_ceiling_and_a_thin_one_is_memory_bound(h100):
    device = h100.device
    m = n = k = 16384
    seconds = gemm.gemm_time_s(m, n, k, h100, "bf16")
    achieved = 2 * m * n * k / seconds / device.peak_flops("bf16")
    assert device.matmul_efficiency * 0.99 < achieved <= device.matmul_efficiency
    # a GEMV-like shape (m = 8 tokens) is bound by reading the 8192 x 8192 weight
    thin = gemm.gemm_time_s(8, 8192, 8192, h100, "bf16")
    weight_s = 8192 * 8192 * 2 / (device.memory_bw_bytes_per_s * device.memory_efficiency)
    assert thin == pytest.approx(weight_s, rel=0.01)


def test_fitted_ceilings_stay_below_the_measured_maximum_achievable_matmul():
    assert load_cluster("a100-80g").device.matmul_efficiency < gemm.MAX_ACHIEVABLE_MATMUL_FRACTION["A100 SXM"]
    assert load_cluster("h100-sxm").device.matmul_efficiency < gemm.MAX_ACHIEVABLE_MATMUL_FRACTION["H100 SXM"]


def test_thin_tensor_parallel_shards_run_below_the_whole_layers_efficiency(h100):
    """A 2048-hidden block's Linears on 2048 tokens: split 8 ways each GEMM is smaller and less
    efficient, so the rank's time is more than 1/8 of the unsplit time."""
    graph = profile("llama:layers=2,hidden=2048,heads=16,kv_heads=8,ffn=5632,vocab=32000", 2048)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    shapes = gemm.block_linear_shapes(block, graph.info, 2048)
    assert len(shapes) == 7
    whole_fwd, whole_bwd = gemm.linear_times_s(shapes, 2048, 1, h100, "bf16")
    split_fwd, split_bwd = gemm.linear_times_s(shapes, 2048, 8, h100, "bf16")
    assert split_fwd > 1.15 * whole_fwd / 8 and split_bwd > 1.15 * whole_bwd / 8
    assert gemm.linear_flops(shapes, 2048, 1) == pytest.approx(block.fwd_flops - block.attn_fwd_flops)


def test_kernel_names_aliases_and_refusals(h100):
    assert "flash3" in ATTENTION_CHOICES and "flash" in ATTENTION_CHOICES
    assert canonical_attention("flash") == "sdpa-flash" and is_fused("triton-alibi") and not is_fused("math")
    with pytest.raises(MeshplanError, match="flash2, flash3, cudnn"):
        check_attention("xformers")
    with pytest.raises(MeshplanError, match="Hopper GPUs only"):
        attention_efficiency("flash3", load_cluster("a100-80g"), 4096, 128)


def test_kernel_efficiency_follows_the_published_benchmarks(h100):
    base = h100.device.attention_efficiency
    assert attention_efficiency("flash2", h100, 16384, 128) == pytest.approx(base)
    # torch SDPA's flash backend as measured on an H200 (benchmarks/data/h200_gpu_check.json):
    # 268.8 TFLOP/s at 16K, head dim 128, 145 at 1K, and 238 at head dim 64
    assert attention_efficiency("flash", h100, 16384, 128) == pytest.approx(base * 268.8 / 278.9)
    assert attention_efficiency("sdpa-flash", h100, 1024, 128) * 989 == pytest.approx(145, rel=0.05)
    assert attention_efficiency("sdpa-flash", h100, 16384, 64) * 989 == pytest.approx(238, rel=0.01)
    assert attention_efficiency("sdpa-mem-efficient", h100, 16384, 128) * 989 == pytest.approx(119.9, rel=0.01)
    # FlashAttention-3 and cuDNN over FlashAttention-2 on H100: 576 and 522 against 326 TFLOP/s
    assert attention_efficiency("flash3", h100, 16384, 128) == pytest.approx(base * 576 / 326)
    assert attention_efficiency("cudnn", h100, 16384, 128) == pytest.approx(base * 522 / 326)
    assert attention_efficiency("triton-alibi", h100, 16384, 128) == pytest.approx(base / 2)
    # the ramp: FlashAttention-2 at 512 tokens is 0.62 of its 16K speed (published: 191/335 = 0.57
    # forward, 214/322 = 0.66 backward); head dim 64 runs at 0.89 of 128's
    assert attention_efficiency("flash2", h100, 512, 128) / base == pytest.approx(0.62, abs=0.01)
    assert attention_efficiency("flash2", h100, 16384, 64) / base == pytest.approx(0.89)
    assert attention_efficiency("math", h100, 4096, 128) == 0.0
    # on A100 cuDNN and torch's flash backend are costed as FlashAttention-2 (no separate figure)
    a100 = load_cluster("a100-80g")
    assert attention_efficiency("cudnn", a100, 4096, 128) == attention_efficiency("flash2", a100, 4096, 128)
    assert attention_efficiency("sdpa-flash", a100, 4096, 128) == attention_efficiency("flash2", a100, 4096, 128)


def test_estimate_prices_the_named_kernel(h100):
    """The same run is slower on llm-foundry's Triton kernel and faster on FlashAttention-3 than
    on torch SDPA's flash backend; `flash` and `sdpa-flash` are the same kernel. Priced with fused
    elementwise kernels (`generic`), whose share of the step leaves the attention kernel's visible
    (meshplan's executor adds its eager kernels' traffic: `eager_kernels`)."""
    from meshplan.planner.simulation.estimator import estimate

    def step(attention: str) -> float:
        return estimate("llama:layers=2,hidden=1024,heads=8,kv_heads=8,ffn=2816,vocab=32000", h100, gpus=1,
                        global_batch=1, seq=8192, attention=attention, engine="generic").step_time_s

    flash, named = step("flash"), step("sdpa-flash")
    assert flash == pytest.approx(named)
    assert step("triton-alibi") > 1.15 * flash and step("flash3") < 0.9 * flash
    assert step("math") > flash


def test_cpu_profile_has_no_tiles_or_roofline():
    cpu = load_cluster("cpu")
    assert cpu.device.num_sms == 0
    device = cpu.device
    m = n = k = 256
    expected = 2 * m * n * k / (device.peak_flops("fp32") * device.matmul_efficiency
                                * (2 * m * n * k) / (2 * m * n * k + device.matmul_half_efficiency_flops))
    assert gemm.gemm_time_s(m, n, k, cpu, "fp32") == pytest.approx(expected)
    faster = replace(cpu, device=replace(device, matmul_efficiency=device.matmul_efficiency / 2))
    assert gemm.gemm_time_s(m, n, k, faster, "fp32") == pytest.approx(2 * expected)


def test_estimate_help_and_errors_list_the_kernels(capsys):
    from meshplan.cli import main

    def run(args) -> int:
        try:
            return main(args)
        except SystemExit as exc:
            return exc.code

    assert run(["estimate", "--help"]) == 0
    out = capsys.readouterr().out
    for name in ("flash2", "flash3", "cudnn", "sdpa-flash", "sdpa-mem-efficient", "triton-alibi", "math"):
        assert name in out
    assert run(["estimate", "--model", "gpt2", "--cluster", "h100-sxm", "--gpus", "1", "--gbs", "1",
                "--attention", "xformers"]) == 2
    assert "triton-alibi" in capsys.readouterr().err


def test_an_engine_config_is_priced_on_the_engines_own_kernel():
    """Megatron-Core's default is cuDNN fused attention (faster on H100 than torch SDPA's flash
    kernel); the estimate says which kernel it took, and --attention overrides it."""
    from pathlib import Path

    from meshplan.planner.engines.bridge import predict_job, read_engine_file

    job = read_engine_file(Path(__file__).parents[1] / "engines" / "fixtures" / "megatron_llama3_8b.sh")
    default = predict_job(job, None, "h100-sxm")
    assert any(note.startswith("attention: cudnn, megatron's default") for note in default.notes)
    flash = predict_job(job, None, "h100-sxm", attention="flash")
    assert default.prediction.step_time_s < flash.prediction.step_time_s
