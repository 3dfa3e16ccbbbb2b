"""The fp8 precision recipe (planner.costing.fp8) against its written rules: GEMM time at the fp8
peak x fp8_matmul_efficiency plus bf16 attention plus casts at memory bandwidth; saved Linear
inputs halved; fp8 weight copies and scales in the buffers; float8 all-gather halving the Linear
weights' gather bytes; the refusals (no fp8 peak, the executor)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.cli import main
from meshplan.executor.checks import check_plan_runnable, check_precision_runnable
from meshplan.executor.plans import uniform_plan
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing import fp8, fp8_memory, gemm
from meshplan.planner.costing.compute_time import kernel_efficiency
from meshplan.planner.costing.collectives import collective_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.device_time import attention_time_s, causal_skipped_flops, compute_time_s, memory_time_s
from meshplan.planner.costing.layer_cost import layer_cost
from tests.planner.costing.meshes import mesh
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.simulation.estimator import estimate

SEQ = 4096


@pytest.fixture(scope="module")
def graph():
    return profile("llama3-8b", SEQ)


def _block(graph):
    return next(layer for layer in graph.layers if layer.kind == "block")


def test_hopper_profiles_have_fp8_peaks_and_a100_has_none():
    for name in ("h100-sxm", "h200"):
        device = load_cluster(name).device
        assert device.peak_flops_per_s["fp8"] == 1979e12 and 0 < device.fp8_matmul_efficiency <= 1
    for name in ("a100-80g", "a100-40g"):
        with pytest.raises(MeshplanError, match="no FP8 tensor cores"):
            fp8.check_fp8_supported(load_cluster(name), "fp8")


def _fp8_gemm_s(m, n, k, cluster, scale_block=0):
    """One fp8 GEMM by hand: the longer of its compute at the fp8 peak x fp8_matmul_efficiency on
    the size curve (f_half scaled by the peak ratio) x wave efficiency, and its bytes (fp8
    operands plus any block scales, a bf16 output) at the achieved bandwidth."""
    device = cluster.device
    flops = 2.0 * m * n * k
    peak = device.peak_flops_per_s["fp8"]
    half = device.matmul_half_efficiency_flops * peak / device.peak_flops_per_s["bf16"]
    compute_s = flops / (peak * device.fp8_matmul_efficiency * flops / (flops + half)
                         * gemm.wave_efficiency(m, n, device.num_sms))
    operand = 1 + (1 / scale_block if scale_block else 0)
    bytes_s = ((m * k + k * n) * operand + 2 * m * n) / (device.memory_bw_bytes_per_s * device.memory_efficiency)
    return max(compute_s, bytes_s)


def _bandwidth(cluster):
    return cluster.device.memory_bw_bytes_per_s * cluster.device.memory_efficiency


def test_efficiency_carries_the_bf16_fit_over_by_the_measured_fp8_to_bf16_ceiling(h100):
    """fp8_matmul_efficiency is the fitted bf16 matmul_efficiency times FP8's over BF16's share of
    peak in one mamf-finder sweep on H100 SXM (70.9% / 80.3%), to the profile's three digits, and
    stays below FP8's own ceiling."""
    device = h100.device
    bf16_share, fp8_share = gemm.MAMF_BF16_FP8["H100 SXM"]
    assert (bf16_share, fp8_share) == (pytest.approx(794.5 / 989, abs=5e-4), pytest.approx(1402.6 / 1979, abs=5e-4))
    assert device.fp8_matmul_efficiency == pytest.approx(device.matmul_efficiency * fp8_share / bf16_share, abs=5e-4)
    assert device.fp8_matmul_efficiency < fp8_share


def test_torchaos_published_linear_speedup_is_a_check_not_a_target(h100):
    """torchao's float8 README: M, K, N = 4096, 8192, 16384 on H100, a tensorwise Float8Linear
    1.39x a bf16 Linear (forward + backward, casts included). meshplan's Linear by hand: its three
    GEMMs each way plus the tensorwise casts; it reads faster than torchao's figure (1.47x), whose
    casts ran through torch.compile kernels its README calls short of the traffic counted here,
    and within 10% of it."""
    m, k, n = 4096, 8192, 16384
    bf16_s = sum(gemm.gemm_time_s(*shape, h100, "bf16") for shape in ((m, n, k), (m, k, n), (k, n, m)))
    fp8_s = sum(_fp8_gemm_s(*shape, h100) for shape in ((m, n, k), (m, k, n), (k, n, m)))
    # tensorwise: input and output gradient 6 bytes per value (amax read, read, two fp8 layouts),
    # the weight 8 (amax read, then a bf16 read and an fp8 write per layout)
    cast_s = (6 * (m * k + m * n) + 8 * k * n) / _bandwidth(h100)
    assert fp8.linear_speedup(m, k, n, h100) == pytest.approx(bf16_s / (fp8_s + cast_s), rel=1e-12)
    assert 1.39 < bf16_s / (fp8_s + cast_s) < 1.39 * 1.10


@pytest.mark.parametrize("recipe, activation_bytes, weight_bytes", [
    ("tensorwise", 6, 8), ("rowwise", 8, 10), ("delayed", 4, 4), ("mxfp8", 2 + 2 * 33 / 32, 2 + 2 * 33 / 32)])
def test_a_worked_linear_under_each_recipe(recipe, activation_bytes, weight_bytes):
    """One Linear (8192 tokens, 4096 -> 14336) forward and backward: its three GEMMs at the fp8
    peak by shape, each max(compute, bytes), plus the recipe's cast traffic per value of input,
    weight and output gradient. MXFP8 (Blackwell) reads a 1-byte scale per 32 values beside each
    operand. Rowwise rescales its two gradient GEMMs' bf16 outputs (input m x k, weight k x n)
    in one more read and write each, 4 bytes per value."""
    cluster = load_cluster("b200" if recipe == "mxfp8" else "h100-sxm")
    m, k, n = 8192, 4096, 14336
    block = 32 if recipe == "mxfp8" else 0
    gemms_s = sum(_fp8_gemm_s(*shape, cluster, block) for shape in ((m, n, k), (m, k, n), (k, n, m)))
    cast_s = (activation_bytes * (m * k + m * n) + weight_bytes * k * n) / _bandwidth(cluster)
    if recipe == "rowwise":
        cast_s += 4 * (m * k + k * n) / _bandwidth(cluster)
    assert fp8.RECIPES[recipe].activation_cast_bytes == pytest.approx(activation_bytes)
    assert fp8.RECIPES[recipe].weight_cast_bytes == pytest.approx(weight_bytes)
    bf16_s = sum(gemm.gemm_time_s(*shape, cluster, "bf16") for shape in ((m, n, k), (m, k, n), (k, n, m)))
    assert fp8.linear_speedup(m, k, n, cluster, recipe) == pytest.approx(bf16_s / (gemms_s + cast_s), rel=1e-12)
    assert 1.2 < fp8.linear_speedup(m, k, n, cluster, recipe) < 2.0


def test_block_compute_is_fp8_linears_by_shape_plus_bf16_attention_plus_casts(h100, graph):
    block, info = _block(graph), graph.info
    # under `generic` (fused elementwise kernels: meshplan's executor counts its own eagerly,
    # `eager_kernels`, and pays FSDP2's gradient copies under bf16-mixed)
    strategy = mesh(precision="fp8", microbatch_size=2, engine="generic")
    assert strategy.fp8_recipe == "tensorwise"  # generic's default, and meshplan's
    bf16 = layer_cost(block, replace(strategy, precision="bf16-mixed", fp8_recipe=None), h100, info)
    got = layer_cost(block, strategy, h100, info)
    delayed = layer_cost(block, replace(strategy, fp8_recipe="delayed"), h100, info)
    mbs, hidden, ffn, tokens = 2, info.hidden, info.ffn, 2 * SEQ
    kv = info.num_kv_heads * hidden // info.num_heads
    shapes = gemm.block_linear_shapes(block, info, SEQ)
    assert len(shapes) == 7  # q, k, v, o, gate, up, down
    linear_fwd = gemm.linear_flops(shapes, tokens, 1)
    fp8_fwd_s = sum(_fp8_gemm_s(tokens, o, i, h100) for i, o, _ in shapes)
    fp8_bwd_s = sum(_fp8_gemm_s(tokens, i, o, h100) + _fp8_gemm_s(i, o, tokens, h100) for i, o, _ in shapes)
    # casts: inputs (2 norm outputs, o's input: s x h each; down's input: s x ffn), the weights,
    # and backward the output gradients (q, k, v, o, gate, up, down outputs)
    inputs = (3 * SEQ * hidden + SEQ * ffn) * mbs
    weights = block.num_params - 2 * hidden
    grads = tokens * (hidden + 2 * kv + hidden + 2 * ffn + hidden)
    local_fwd = (block.fwd_flops - causal_skipped_flops(block, "flash")) * mbs
    kernel = kernel_efficiency(block, info, h100, "flash", "bf16")
    attention_s = attention_time_s(local_fwd - linear_fwd, h100, "bf16", kernel)
    launch_s = compute_time_s(0.0, 2, h100, "bf16")  # the bf16 remainder's launch (nothing else is left in it)
    elementwise_s = (bf16.fwd_compute_s - gemm.linear_times_s(shapes, tokens, 1, h100, "bf16")[0]
                     - launch_s - attention_s)
    for cost, act, wgt in ((got, 6, 8), (delayed, 4, 4)):
        cast_fwd_s = (act * inputs + wgt * weights) / _bandwidth(h100)
        assert cost.fwd_compute_s == pytest.approx(attention_s + launch_s + fp8_fwd_s + cast_fwd_s + elementwise_s,
                                                   rel=1e-9)
    bwd_rest_s = bf16.bwd_compute_s - gemm.linear_times_s(shapes, tokens, 1, h100, "bf16")[1]
    assert got.bwd_compute_s - delayed.bwd_compute_s == pytest.approx((6 - 4) * grads / _bandwidth(h100), rel=1e-9)
    assert delayed.bwd_compute_s == pytest.approx(bwd_rest_s + fp8_bwd_s + 4 * grads / _bandwidth(h100), rel=1e-9)
    assert got.fwd_compute_s < 0.9 * bf16.fwd_compute_s and got.bwd_compute_s < 0.8 * bf16.bwd_compute_s


def test_megatron_casts_each_weight_once_per_step(h100, graph):
    """Megatron-Core passes Transformer Engine `is_first_microbatch`: a weight is quantised on a
    step's first micro-batch and reused, so each micro-batch pays 1 / micro-batches of its cast."""
    block, info = _block(graph), graph.info
    generic = ParallelConfig(gpus=1, global_batch=8, precision="fp8", fp8_recipe="delayed", engine="generic")
    megatron = replace(generic, engine="megatron")  # against `generic`: the same fused elementwise kernels
    assert megatron.num_microbatches == 8 and fp8.weight_cast_share(megatron) == 1 / 8
    weights = block.num_params - 2 * info.hidden
    saved_s = (1 - 1 / 8) * 4 * weights / _bandwidth(h100)
    difference_s = (layer_cost(block, generic, h100, info).fwd_compute_s
                    - layer_cost(block, megatron, h100, info).fwd_compute_s)
    assert difference_s == pytest.approx(saved_s, rel=1e-9)


def test_saved_linear_inputs_halve_and_weight_copies_are_buffered(h100, graph):
    block, info = _block(graph), graph.info
    config = mesh(precision="fp8", microbatch_size=2)  # priced under the ZeRO paper's recipe
    bf16 = layer_cost(block, replace(config, precision="bf16-mixed", fp8_recipe=None), h100, info,
                      state_recipe="zero-paper")
    got = layer_cost(block, config, h100, info, state_recipe="zero-paper")
    linear_inputs = 2 * (3 * SEQ * info.hidden + SEQ * info.ffn) * 2  # bf16 bytes x mbs 2
    # the two norm outputs the bf16 block rebuilds (keeps nothing of) are kept as fp8 casts
    rebuilt = 2 * SEQ * info.hidden * 2 * 2
    assert block.act_rebuilt_bytes * 2 == rebuilt
    assert bf16.activation_bytes - got.activation_bytes == pytest.approx(linear_inputs / 2 - rebuilt)
    copies = (block.num_params - 2 * info.hidden) * 1.0 + 7 * fp8.FP8_SCALE_BYTES_PER_LINEAR
    assert got.buffer_bytes - bf16.buffer_bytes == pytest.approx(copies)
    assert (got.param_bytes, got.grad_bytes, got.optimizer_bytes) == (bf16.param_bytes, bf16.grad_bytes,
                                                                      bf16.optimizer_bytes)
    full = layer_cost(block, replace(config, recompute="full"), h100, info, state_recipe="zero-paper")
    bf16_full = replace(config, recompute="full", precision="bf16-mixed", fp8_recipe=None)
    assert full.activation_bytes == layer_cost(block, bf16_full, h100, info).activation_bytes  # only the input kept


def test_zero3_float8_all_gather_halves_the_linear_weights_gather(h100, graph):
    block, info = _block(graph), graph.info
    strategy = mesh(precision="fp8", dp=8, zero=3)
    # bf16-mixed under `generic`: the same compute, without FSDP2's gradient copies, which
    # meshplan's executor pays under bf16-mixed alone (`state_memory.grad_copy_bytes_per_param`)
    bf16 = layer_cost(block, replace(strategy, precision="bf16-mixed", fp8_recipe=None, engine="generic"), h100, info)
    got = layer_cost(block, strategy, h100, info)
    linear = block.num_params - 2 * info.hidden
    wire_bytes = 2.0 * block.num_params - linear  # Linear weights 1 byte, norms 2
    assert fp8_memory.gather_bytes_per_param(block, info, strategy, 3, 8, 2.0) * block.num_params == pytest.approx(wire_bytes)
    # torchao gathers rowwise weights in bf16; Megatron's --fp8-param-gather gathers delayed ones in fp8
    rowwise, delayed = replace(strategy, fp8_recipe="rowwise"), replace(strategy, fp8_recipe="delayed")
    assert fp8_memory.gather_bytes_per_param(block, info, rowwise, 3, 8, 2.0) == 2.0
    assert fp8_memory.gather_bytes_per_param(block, info, delayed, 3, 8, 2.0) == 2.0
    megatron = replace(delayed, engine="megatron")
    assert fp8_memory.gather_bytes_per_param(block, info, megatron, 3, 8, 2.0) * block.num_params == pytest.approx(wire_bytes)
    assert got.fwd_gather_s == pytest.approx(collective_time_s("all_gather", wire_bytes, 8, h100, 1))
    assert bf16.fwd_gather_s == pytest.approx(collective_time_s("all_gather", 2.0 * block.num_params, 8, h100, 1))
    # the gathered copy (and FSDP2's next-unit copy) in fp8; no separate cast copy
    transient = 7 * fp8.FP8_SCALE_BYTES_PER_LINEAR
    assert bf16.buffer_bytes - got.buffer_bytes == pytest.approx(2 * linear - transient)


def test_estimate_fp8_is_faster_and_smaller_on_hopper_and_refused_on_a100():
    kwargs = dict(spec="llama3-8b", gpus=8, global_batch=16, seq=SEQ, mbs=2, zero=1)
    bf16 = estimate(cluster="h100-sxm", precision="bf16-mixed", **kwargs)
    got = estimate(cluster="h100-sxm", precision="fp8", **kwargs)
    assert got.step_time_s < 0.9 * bf16.step_time_s
    assert got.peak_memory_bytes < bf16.peak_memory_bytes
    with pytest.raises(MeshplanError, match="A100.*no FP8 tensor cores"):
        estimate(cluster="a100-80g", precision="fp8", **kwargs)


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_cli_refuses_fp8_on_a100_in_one_line(command, capsys):
    rc = main([command, "--model", "llama3-8b", "--cluster", "a100-80g", "--gpus", "8", "--gbs", "8",
               "--precision", "fp8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "no FP8 tensor cores (Hopper and newer" in err


def test_train_refuses_fp8_plans_naming_the_device():
    message = ("FP8 plans need a GPU with FP8 tensor cores (compute capability >= 8.9) and torchao; "
               "this device is cpu")
    with pytest.raises(MeshplanError) as refused:
        check_precision_runnable("fp8", "cpu")
    assert str(refused.value) == message
    with pytest.raises(MeshplanError, match="compute capability >= 8.9.*A100"):
        check_precision_runnable("fp8", "NVIDIA A100-SXM4-80GB (compute capability 8.0)")
    with pytest.raises(MeshplanError, match="does not run FP8 plans yet.*H100"):
        check_precision_runnable("fp8", "NVIDIA H100 80GB HBM3 (compute capability 9.0)")
    check_precision_runnable("bf16-mixed", "cpu")


def test_check_plan_runnable_refuses_an_fp8_plan_here():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the cpu message is checked above")
    plan = uniform_plan("gpt:layers=2,hidden=64,heads=4,vocab=256", 16, 4, load_cluster("cpu"), dp=2,
                        microbatch_size=2, precision="fp8")
    with pytest.raises(MeshplanError, match="this device is cpu$"):
        check_plan_runnable(plan, 2)


def test_report_of_an_fp8_plan_names_the_recipe():
    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.simulation.simulator import simulate
    from meshplan.reports import build_report

    plan = uniform_plan("llama:layers=2,hidden=512,heads=8,kv_heads=4,ffn=1024,vocab=1024", 512, 8,
                        load_cluster("h100-sxm"), dp=8, zero=1, precision="fp8")
    html = build_report(plan.with_prediction(simulate(plan, timeline=False).to_json()))
    assert "GEMMs in fp8" in html and "the executor does not run fp8" in html


def test_each_engine_has_its_default_recipe_and_other_precisions_take_none():
    def config(**kwargs):
        return ParallelConfig(gpus=1, global_batch=1, **kwargs)
    assert [config(precision="fp8", engine=e).fp8_recipe for e in ("meshplan", "megatron", "torchtitan", "deepspeed")] \
        == ["tensorwise", "delayed", "tensorwise", "delayed"]
    assert config(precision="fp8", engine="megatron", fp8_recipe="mxfp8").fp8_recipe == "mxfp8"
    assert config().fp8_recipe is None
    with pytest.raises(ValueError, match="fp8_recipe 'rowwise' needs precision fp8, got 'bf16-mixed'"):
        config(fp8_recipe="rowwise")
    with pytest.raises(ValueError, match="fp8_recipe must be one of tensorwise, rowwise, delayed, mxfp8, got 'x'"):
        config(precision="fp8", fp8_recipe="x")


def test_cli_refuses_mxfp8_off_blackwell_in_one_line(capsys):
    args = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--gbs", "8", "--precision", "fp8"]
    rc = main(args + ["--cluster", "h100-sxm", "--fp8-recipe", "mxfp8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.endswith("--fp8-recipe mxfp8: H100 SXM5 80GB (profile 'h100-sxm', architecture hopper) has no "
                        "block-scaled FP8 tensor cores (MXFP8 needs blackwell); use --fp8-recipe tensorwise, "
                        "rowwise or delayed")
    rc = main(["estimate", "--model", "llama3-8b", "--gpus", "8", "--gbs", "8", "--cluster", "h100-sxm",
               "--fp8-recipe", "delayed"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.endswith("--fp8-recipe delayed needs --precision fp8 (got bf16-mixed)")


def test_estimate_prices_each_recipe_and_mxfp8_on_blackwell():
    kwargs = dict(spec="llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=1024", gpus=8,
                  global_batch=16, seq=SEQ, mbs=2, zero=1, precision="fp8")
    steps = {recipe: estimate(cluster="h100-sxm", fp8_recipe=recipe, **kwargs).step_time_s
             for recipe in ("tensorwise", "rowwise", "delayed")}
    # fewer cast bytes, faster: delayed (4 per value) < tensorwise (6, 8) < rowwise (8, 10, bf16 gather)
    assert steps["delayed"] < steps["tensorwise"] < steps["rowwise"]
    b200 = estimate(cluster="b200", fp8_recipe="mxfp8", **kwargs)
    assert 0 < b200.step_time_s < steps["delayed"]


def test_plan_json_records_the_recipe_next_to_precision_and_round_trips(tmp_path):
    from meshplan.planner.contracts.plan import load_plan, plan_from_json, save_plan

    plan = uniform_plan("llama:layers=2,hidden=512,heads=8,kv_heads=4,ffn=1024,vocab=1024", 512, 8,
                        load_cluster("h100-sxm"), dp=8, zero=1, precision="fp8")
    plan = replace(plan, config=replace(plan.config, fp8_recipe="rowwise"))
    data = plan.to_json()
    keys = list(data)
    assert data["fp8_recipe"] == "rowwise" and keys.index("fp8_recipe") == keys.index("precision") + 1
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").config.fp8_recipe == "rowwise"
    older = {k: v for k, v in data.items() if k != "fp8_recipe"}  # a plan written before the key
    assert plan_from_json(older).config.fp8_recipe == "tensorwise"  # meshplan's default
    bf16 = uniform_plan("llama:layers=2,hidden=512,heads=8,kv_heads=4,ffn=1024,vocab=1024", 512, 8,
                        load_cluster("h100-sxm"), dp=8, zero=1)
    assert "fp8_recipe" not in bf16.to_json()


def test_plan_cli_records_the_asked_recipe_and_simulate_refuses_mxfp8_on_hopper(tmp_path, capsys):
    import json

    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "llama:layers=2,hidden=512,heads=8,kv_heads=4,ffn=1024,vocab=1024", "--seq", "512",
               "--cluster", "h100-sxm", "--gpus", "2", "--gbs", "4", "--pp", "1", "--tp", "1", "--precision", "fp8",
               "--fp8-recipe", "rowwise", "--out", str(out)])
    assert rc == 0 and json.loads(out.read_text())["fp8_recipe"] == "rowwise"
    capsys.readouterr()
    assert main(["simulate", "--plan", str(out), "--fp8-recipe", "mxfp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "MXFP8 needs blackwell" in err
