"""The cost model's kernel level against published kernel benchmarks (benchmarks/published_kernel_runs.py).

Nothing there is fitted; these tests hold what `benchmarks/bench_kernels.py` prints, so a change to
a GEMM or FP8 price shows here as a moved check, not only as moved end-to-end figures.
"""
import sys

import pytest

from meshplan.planner.costing import fp8, gemm
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.hardware import load_cluster
from tests.benchmark_modules import BENCHMARKS, benchmark_module



@pytest.fixture(scope="module")
def kernels():
    return benchmark_module("published_kernel_runs")


@pytest.fixture(scope="module")
def bench():
    """bench_kernels.py, whose printed figures these tests hold."""
    return benchmark_module("bench_kernels")


def _tflops(row) -> float:
    return 2.0 * row.m * row.n * row.k / gemm.gemm_time_s(row.m, row.n, row.k, load_cluster(row.profile),
                                                         row.dtype) / 1e12


def test_the_benchmark_prints_the_rates_and_seconds_held_here(kernels, bench):
    """bench_kernels.py's figures are the cost model's, computed here apart: a GEMM's rate is its
    2 m n k FLOPs over `gemm.gemm_time_s`, a Linear's seconds `fp8.linear_seconds`."""
    for row in kernels.gemm_rows():
        assert bench.predicted_tflops(row) == pytest.approx(_tflops(row), rel=1e-12)
    for row in kernels.linear_rows():
        assert bench.predicted_linear(row) == pytest.approx(
            fp8.linear_seconds(row.m, row.k, row.n, load_cluster(row.profile), row.recipe, row.compiled), rel=1e-12)


def test_bf16_gemms_on_the_500w_part_run_at_the_rate_fbgemm_measured(kernels):
    """h100-96g-500w's bf16 peak is a datasheet midpoint (its sustained clock under the cap is
    unpublished); FBGEMM's H100 500 W GEMMs (546-585 TFLOP/s over three shapes) are the kernel
    figure it answers to. meshplan reads 546, 562 and 561. Tolerance 8%: the three published
    rates spread 7% among themselves, a shape effect (wave and tile fit) the model prices only in part."""
    rows = [row for row in kernels.gemm_rows() if row.dtype == "bf16"]
    assert len(rows) == 3
    for row in rows:
        assert _tflops(row) == pytest.approx(row.published_tflops, rel=0.08), (row.m, row.n, row.k)


def test_fp8_gemms_read_below_fbgemms_rowwise_kernel(kernels):
    """`fp8_matmul_efficiency` carries the bf16 fit over by the FP8/BF16 ratio of the largest GEMMs'
    measured rates (ml-engineering's MAMF, 70.9% / 80.3% of peak): at these three large training
    shapes FBGEMM's rowwise fp8 kernel does better than that ratio, and meshplan reads 8-15% slower
    (963-993 against 1083-1141 TFLOP/s). The check holds the size of that cautious side, so a
    change to the fp8 efficiency is seen here."""
    rows = [row for row in kernels.gemm_rows() if row.dtype == "fp8"]
    assert len(rows) == 3
    for row in rows:
        assert 0.80 * row.published_tflops < _tflops(row) < row.published_tflops, (row.m, row.n, row.k)


def test_rowwise_linears_at_llama3_70b_tp8_shapes(kernels):
    """torchao's compiled rowwise Float8Linear at the TP 8 shards of Llama 3 70B: meshplan's fp8
    seconds (GEMMs by shape, casts with their first read fused, the gradient rescales) within 15%
    of each published time (it reads -11%, -2%, +13%, +11%: the part is named only as H100 and
    priced as the 700 W SXM). Over the four, meshplan's speed-up (1.40x) is below the published
    1.60x: it does not overstate what fp8 gains in these Linears. torchtitan's runs of that model
    at TP 8 under this recipe are predicted faster than published (blocking TP: 1.11x against
    1.00x over bf16), so that gap lies outside the Linears."""
    rows = kernels.linear_rows()
    cluster = load_cluster("h100-sxm")
    seconds = [fp8.linear_seconds(r.m, r.k, r.n, cluster, r.recipe, r.compiled) for r in rows]
    for row, (_, fp8_s) in zip(rows, seconds):
        assert fp8_s == pytest.approx(row.fp8_s, rel=0.15), row.name
    predicted = sum(b for b, _ in seconds) / sum(f for _, f in seconds)
    published = sum(r.bf16_s for r in rows) / sum(r.fp8_s for r in rows)
    assert predicted == pytest.approx(1.40, abs=0.01)
    assert published == pytest.approx(1.60, abs=0.01)
    assert predicted < published


def test_linear_seconds_compiled_drops_the_first_read_of_input_and_gradient_casts():
    """`compiled` removes one bf16 read of each input and output-gradient value from the casts
    (`fp8.cast_times_s`), nothing else: the difference is 2 bytes per value of both at the achieved
    bandwidth."""
    cluster = load_cluster("h100-sxm")
    m, k, n = 16384, 8192, 7168
    _, eager_s = fp8.linear_seconds(m, k, n, cluster, "rowwise")
    bf16_s, compiled_s = fp8.linear_seconds(m, k, n, cluster, "rowwise", compiled=True)
    bandwidth = cluster.device.memory_bw_bytes_per_s * cluster.device.memory_efficiency
    assert eager_s - compiled_s == pytest.approx(2 * (m * k + m * n) / bandwidth, rel=1e-9)
    assert fp8.linear_speedup(m, k, n, cluster, "rowwise", compiled=True) == pytest.approx(bf16_s / compiled_s)


def test_the_prepared_gpu_rowwise_check_runs_its_kernels_and_sums_each_recipe():
    """benchmarks/gpu_check.py's rowwise section (for a machine with an fp8 GPU) on CPU at tiny
    shapes, timed by a counter: every Linear's three GEMMs on its TP shard, four kernels each, and
    per model the recipes as torchao runs them (forward with fast accumulation, gradients without,
    rowwise's on the tensorwise kernel) beside meshplan's prices."""
    import torch

    gpu_check = benchmark_module("gpu_check")
    shapes = gpu_check.fp8_tp8_gemms()
    assert len(shapes) == 2 * 7 * 3
    assert ("llama3-70b tp8", "wk", "forward", 16 * 8192, 128, 8192) in shapes
    assert ("llama3-8b tp8", "w2", "weight gradient", 14336 // 8, 4096, 12 * 8192) in shapes
    calls = iter(range(1, 10_000))
    cluster = load_cluster("h100-sxm")
    tiny = gpu_check.fp8_tp8_gemms(models=(("tiny tp8", 32, 128, 32, 256),))
    out = gpu_check.check_fp8_rowwise(torch, {"h100-sxm": cluster}, device="cpu", gemms=tiny,
                                      timed=lambda fn: (fn(), float(next(calls)))[1])
    rows = out["rows"]
    assert [(r["linear"], r["gemm"]) for r in rows[:3]] == [("wq", "forward"), ("wq", "input gradient"),
                                                            ("wq", "weight gradient")]
    forward = [r for r in rows if r["gemm"] == "forward"]
    grads = [r for r in rows if r["gemm"] != "forward"]
    summary = out["tiny tp8"]
    assert summary["rowwise_recipe_s"] == sum(r["rowwise_s"] for r in forward) + sum(
        r["tensorwise_slow_accum_s"] for r in grads)
    assert summary["tensorwise_recipe_s"] == sum(r["tensorwise_s"] for r in forward) + sum(
        r["tensorwise_slow_accum_s"] for r in grads)
    assert summary["predicted_fp8_s[h100-sxm]"] == pytest.approx(
        sum(gemm.gemm_time_s(r["m"], r["n"], r["k"], cluster, "fp8") for r in rows))


def test_the_prepared_gpu_fp8_block_check_times_each_variant_beside_its_price():
    """benchmarks/fp8_block_check.py (gpu_check's fp8_block section) eagerly on CPU at a tiny shard,
    timed by a counter: per model of torchtitan's async-TP table (70B, 8B), the three variants run
    through torchao's Float8 (every Linear, or wk and wv left alone), and each row carries
    meshplan's price of that model's shard at the table's micro-batch: bf16 its seven Linears'
    GEMMs by shape; rowwise more where k and v are cast too, eagerly (`fp8_eager`)."""
    import torch

    pytest.importorskip("torchao.float8")
    block_check = benchmark_module("fp8_block_check")
    cluster = load_cluster("h100-sxm")
    calls = iter(range(1, 10_000))
    out = block_check.check_fp8_block(torch, {"h100-sxm": cluster}, lambda fn: (fn(), float(next(calls)))[1],
                                      device="cpu", modes=(False,), rows=64, dims=(512, 128, 1024))
    assert [(r["model"], r["variant"], r["measured_s"]) for r in out["rows"]] == [
        (model, variant, float(3 * m + v + 1)) for m, model in enumerate(("llama3-70b", "llama3-8b"))
        for v, variant in enumerate(("bf16", "rowwise", "rowwise k,v bf16"))]
    for model, local_batch in (("llama3-70b", 16), ("llama3-8b", 12)):
        bf16, whole, kept = (r["predicted_s[h100-sxm]"] for r in out["rows"] if r["model"] == model)
        assert bf16 == pytest.approx(block_check.predicted_s(None, (), False, cluster, local_batch, model))
        assert whole > kept > 0 and bf16 > 0
        ratios = out[f"{model} eager"]
        assert ratios["rowwise over k,v bf16, predicted [h100-sxm]"] == whole / kept
        assert ratios["bf16 over rowwise, predicted [h100-sxm]"] == bf16 / whole
    assert out["llama3-70b eager"]["rowwise over k,v bf16, measured"] == 2.0 / 3.0


def test_the_prepared_gpu_loss_memory_check_runs_every_mode():
    """benchmarks/loss_memory_check.py (gpu_check's loss_memory section) on CPU at a tiny vocabulary,
    in a process of its own (loss_parallel's one-rank group): every mode runs torchtitan's loss
    (eager, under loss_parallel, compiled) and carries meshplan's peak in fp32 copies of the logits
    (3, 4 and 1: `loss_kernels.ce_backward_fp32_copies` and the compiled loss's bf16 halves), and
    its loss's seconds as a timer gives them beside each profile's (its kernels' bytes a logit at
    the achieved bandwidth, exact); the CPU has no memory statistics, so no memory is measured."""
    import json
    import subprocess

    script = ("import json, sys, torch; sys.path.insert(0, sys.argv[1]); import loss_memory_check as c; "
              "from meshplan.planner.costing.hardware import load_cluster; "
              "print(json.dumps(c.check_loss_memory(torch, {'h100-sxm': load_cluster('h100-sxm')}, device='cpu', "
              "tokens=64, hidden=32, vocab=256, timer=lambda fn: (fn(), 1.0)[1])))")
    done = subprocess.run([sys.executable, "-c", script, str(BENCHMARKS)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    assert [(r["mode"], r["predicted_copies"], r["measured_allocated_copies"]) for r in rows] == [
        ("eager", 3.0, None), ("loss_parallel", 4.0, None), ("compiled", 1.0, None)]
    cluster = load_cluster("h100-sxm")  # each mode's loss timed (here a stand-in timer), beside its kernels' bytes
    for row, (fwd, bwd) in zip(rows, ((22, 26), (38, 38), (4, 4))):
        assert row["measured_s"] == 1.0
        assert row["predicted_s[h100-sxm]"] == pytest.approx(
            memory_time_s(fwd * 64 * 256, cluster) + memory_time_s(bwd * 64 * 256, cluster), rel=1e-12)
