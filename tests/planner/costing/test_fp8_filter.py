"""The fp8 filter (`ParallelConfig.fp8_filter`, `costing.fp8_filter`): which block Linears stay in
bf16, and what that changes in the prices. Against torchao's auto-filter thresholds, the bf16
price of the same Linears, hand-written cast traffic, and the engine refusals."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from meshplan.cli import main
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.fp8_choice import parse_fp8_filter
from meshplan.planner.costing import compute_time, fp8, fp8_memory
from meshplan.planner.costing.compute_time import kernel_efficiency
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.fp8_advice import slower_in_fp8
from meshplan.planner.costing.fp8_advice import filter_problem
from meshplan.planner.costing.fp8_filter import _choices, fp8_linears, linear_roles
from meshplan.planner.engines.bridge import read_engine_text
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.simulation.estimator import estimate

SEQ = 4096
ALL = ("q", "k", "v", "o", "gate", "up", "down")


def _config(engine="torchtitan", recipe="rowwise", names=(), tp=1, **more):
    return ParallelConfig(gpus=8, global_batch=8, tp=tp, dp=8 // tp, sp=tp > 1, precision="fp8", engine=engine,
                          fp8_recipe=recipe, fp8_filter=names, **more)


def _block(graph):
    return next(layer for layer in graph.layers if layer.kind == "block")


def _filtered(spec, recipe):
    graph = profile(spec, 1024 if spec == "gpt2" else SEQ)
    linears = fp8_linears(_block(graph), graph.info, _config(recipe=recipe, names=("auto",)), graph.dtype)
    return tuple(role for role, fp8_on in zip(linear_roles(linears.shapes), linears.in_fp8) if not fp8_on)


def test_auto_filter_follows_torchaos_thresholds():
    """torchao's `_auto_filter_for_rowwise` keeps N <= 2048, K <= 1024, or N <= 4096 and K <= 2048 in
    bf16, `_auto_filter_for_tensorwise` K <= 4096 and N <= 1024 (weight N x K before TP): Llama 3
    8B's k and v (1024 x 4096) under both; 70B's k and v (1024 x 8192) under rowwise only; GPT-2's
    768-wide Linears: every one under rowwise, all but the up projection (N 3072) under tensorwise."""
    assert _filtered("llama3-8b", "rowwise") == ("k", "v")
    assert _filtered("llama3-8b", "tensorwise") == ("k", "v")
    assert _filtered("llama3-70b", "rowwise") == ("k", "v")
    assert _filtered("llama3-70b", "tensorwise") == ()
    assert _filtered("gpt2", "rowwise") == ("q", "k", "v", "o", "up", "down")
    assert _filtered("gpt2", "tensorwise") == ("q", "k", "v", "o", "down")


def test_a_dimension_not_a_multiple_of_16_stays_bf16():
    """fp8 tensor cores need every dimension a multiple of 16 (torchao's and torchtitan's filters)."""
    shapes = ((1000, 1024, True), (1024, 1024, True), (1024, 1024, True), (1024, 1000, False))
    assert _choices(shapes, (), "rowwise") == (False, True, True, False)


def test_no_linear_filtered_prices_as_no_filter(h100):
    """70B's auto filter under tensorwise keeps every Linear in fp8: the step is the unfiltered one."""
    kwargs = dict(seq=SEQ, mbs=1, zero=3, precision="fp8", engine="torchtitan", fp8_recipe="tensorwise")
    plain = estimate("llama3-70b", h100, 8, 8, **kwargs)
    auto = estimate("llama3-70b", h100, 8, 8, fp8_filter=("auto",), **kwargs)
    assert auto.step_time_s == plain.step_time_s and auto.peak_memory_bytes == plain.peak_memory_bytes


@pytest.mark.parametrize("tp", [1, 2])
def test_every_linear_filtered_prices_the_block_as_bf16(h100, tp):
    """With all seven Linears left in bf16 the fp8 block's matmul seconds are bf16's (no casts, no
    rescales), and its saved and transient bytes are bf16-mixed's."""
    graph = profile("llama3-8b", SEQ)
    block, info = _block(graph), graph.info
    config = _config(recipe="rowwise", names=ALL, tp=tp)
    mbs, shard = config.rank_microbatch, tp
    fwd, bwd = block.fwd_flops * mbs / shard, block.bwd_flops * mbs / shard
    attention = compute_time.flash_attention_flops(block, graph.attention, h100) * mbs / shard
    kernel = kernel_efficiency(block, info, h100, graph.attention, graph.dtype)
    skipped = compute_time.causal_skipped_flops(block, graph.attention) * mbs / shard
    got = fp8.gemm_times_s(block, info, h100, config, fwd - skipped, bwd - 2 * skipped, shard, graph.dtype,
                           attention, kernel)
    want = compute_time._bf16_gemm_times_s(block, info, h100, fwd - skipped, bwd - 2 * skipped, mbs, shard,
                                           graph.dtype, "bf16", attention, kernel)
    assert got == pytest.approx(want, rel=1e-12)
    assert fp8_memory.adjust_memory(block, info, config, tp > 1, False, 0, 1.0, 1e9, 1e8, graph.dtype) == (1e9, 1e8)


def test_filtering_k_and_v_saves_their_gemms_and_their_own_casts(h100):
    """Leaving k and v in bf16 (q keeps the region's input cast): the block's matmul time changes by
    their three GEMMs' bf16 minus fp8 seconds, less their weight and output-gradient casts at
    tensorwise's bytes per value (weight 2 + 2 x (2 + 1): a bf16 read per layout cast; gradient
    2 + (2 + 2 x 1): an amax read, then one read writing both layouts), uncompiled."""
    from meshplan.planner.costing import gemm

    graph = profile("llama3-8b", SEQ)
    block, info = _block(graph), graph.info
    times = {}
    for names in ((), ("k", "v")):
        config = _config(engine="generic", recipe="tensorwise", names=names)
        times[names] = sum(fp8.gemm_times_s(block, info, h100, config, block.fwd_flops, block.bwd_flops, 1,
                                            graph.dtype))
    kv = ((info.hidden, info.num_kv_heads * info.attention_head_dim, True),) * 2
    fp8_s, bf16_s = (sum(gemm.linear_times_s(kv, SEQ, 1, h100, dtype)) for dtype in ("fp8", "bf16"))
    weight_values = 2 * info.hidden * info.num_kv_heads * info.attention_head_dim
    grad_values = SEQ * 2 * info.num_kv_heads * info.attention_head_dim
    casts_s = memory_time_s(weight_values * 8.0 + grad_values * 6.0, h100)
    assert times[("k", "v")] - times[()] == pytest.approx(bf16_s - fp8_s - casts_s, rel=1e-9)


def test_float8_all_gather_moves_only_the_fp8_linears_in_fp8(h100):
    """torchtitan's float8 all-gather (tensorwise, ZeRO-3): with q, k, v, o in bf16 only the MLP's
    parameters move at 1 byte; the attention's at 2."""
    graph = profile("llama3-8b", SEQ)
    block, info = _block(graph), graph.info
    config = _config(recipe="tensorwise", names=("q", "k", "v", "o"), zero=3)
    mlp = 3 * info.hidden * info.ffn
    fp8_params = fp8.linear_params(block, info) * mlp / (mlp + 2 * info.hidden ** 2
                                                          + 2 * info.hidden * info.num_kv_heads * info.attention_head_dim)
    got = fp8_memory.gather_bytes_per_param(block, info, config, 3, 8, 2.0, graph.dtype)
    assert got * block.num_params == pytest.approx(2.0 * block.num_params - fp8_params)


def test_refusals_name_the_problem():
    graph = profile("llama3-8b", SEQ)
    problem = filter_problem(graph, _config(recipe="tensorwise", names=("auto",), tp=2))
    assert "Float8ColwiseParallel" in problem and "attention.wk, attention.wv" in problem
    assert filter_problem(graph, _config(recipe="rowwise", names=("auto",), tp=2)) is None
    assert filter_problem(graph, _config(recipe="tensorwise", names=(), tp=2)) is None
    with pytest.raises(ValueError, match="Transformer Engine"):
        _config(engine="megatron", recipe="delayed", names=("k",))
    with pytest.raises(ValueError, match="auto filter"):
        _config(engine="generic", recipe="delayed", names=("auto",))
    with pytest.raises(ValueError, match="needs precision fp8"):
        ParallelConfig(gpus=1, global_batch=1, fp8_filter=("k",))
    assert _config(names=("v", "auto", "k", "k")).fp8_filter == ("auto", "k", "v")
    assert parse_fp8_filter("attention.wk, wv,auto") == ("k", "v", "auto")
    with pytest.raises(ValueError, match="unknown fp8 filter"):
        parse_fp8_filter("w4")


def test_torchtitan_filter_fqns_read_as_torchtitan_matches_them():
    """filter_fqns entries filter every Linear whose module name contains them (torchtitan's
    `module_filter_fn`): "attention" all four, "w1" the gate; per-block names and unknown ones noted."""
    text = ('[model]\nname = "llama3"\nflavor = "8B"\nconverters = ["float8"]\n'
            '[float8]\nrecipe_name = "rowwise"\nfilter_fqns = ["output", "attention", "w1", "layers.3.attention.wq", '
            '"router.gate"]\n')
    job = read_engine_text(text, "torchtitan")
    assert job.fp8_filter == ("q", "k", "v", "o", "gate")
    assert any("names blocks by index" in note for note in job.notes)
    assert any("'router.gate'" in note for note in job.notes)
    bare = read_engine_text(text.replace('"output", ', ""), "torchtitan")
    assert any("lacks 'output'" in note for note in bare.notes)


def test_the_advice_names_what_the_cost_model_finds_slower(h100):
    """`slower_in_fp8` names a Linear exactly when leaving it alone in bf16 lowers the block's time:
    at Llama 3 8B on TP 8 under rowwise (each rank's k and v 128 columns wide) k and v, never the
    MLP's wide Linears; each saving is the block's own difference."""
    graph = profile("llama3-8b", 8192)
    config = _config(recipe="rowwise", tp=8, torch_compile=True)
    slower = dict(slower_in_fp8(graph, h100, config))
    assert {"k", "v"} <= set(slower) and not {"gate", "up", "down"} & set(slower)
    assert all(saved > 0 for saved in slower.values())
    assert slower_in_fp8(graph, h100, replace(config, precision="bf16-mixed", fp8_recipe=None)) == ()


def test_cli_filter_travels_into_the_plan_and_its_heading(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "4096",
                 "--precision", "fp8", "--engine", "torchtitan", "--fp8-recipe", "tensorwise", "--fp8-filter",
                 "auto", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["fp8_filter"] == ["auto"] and data["mesh"]["tp"] == 1  # tensorwise TP cannot run a filter
    capsys.readouterr()
    assert main(["simulate", "--plan", str(out)]) == 0
    assert "fp8 filter auto" in capsys.readouterr().out
    assert main(["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8", "--seq",
                 "4096", "--zero", "1", "--precision", "fp8", "--fp8-filter", "wk,wv"]) == 0
    assert "fp8_filter=k,v" in capsys.readouterr().out
    assert main(["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8",
                 "--precision", "fp8", "--fp8-filter", "w9"]) == 2
    assert "unknown fp8 filter name(s) w9" in capsys.readouterr().err


def test_a_filter_the_engine_cannot_run_is_refused_in_one_line(capsys):
    code = main(["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8", "--tp", "8",
                 "--sp", "--precision", "fp8", "--engine", "torchtitan", "--fp8-recipe", "tensorwise",
                 "--fp8-filter", "k"])
    err = capsys.readouterr().err
    assert code == 2 and "Float8ColwiseParallel" in err and err.count("\n") == 1
    with pytest.raises(MeshplanError, match="Transformer Engine"):
        estimate("llama3-8b", "h100-sxm", 8, 8, precision="fp8", engine="megatron", fp8_filter=("k",))


def test_plan_names_the_linears_worth_filtering_and_the_report_shows_the_filter(tmp_path, capsys):
    """A rowwise plan at TP 8 (Llama 3 8B: k and v 128 columns a rank, q and o 512) says which
    Linears run faster in bf16 and what the plan then takes, simulated (the fastest filter on
    `filter_path`); the plan's facts name recipe and filter."""
    from meshplan.commands.plan import fp8_filter_lines
    from meshplan.planner.contracts.plan import load_plan
    from meshplan.planner.simulation.simulator import simulate
    from meshplan.reports.plans import plan_facts

    out = tmp_path / "plan.json"
    args = ["plan", "--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8", "--seq", "8192",
            "--tp", "8", "--precision", "fp8", "--engine", "torchtitan", "--fp8-recipe", "rowwise", "--compile",
            "--out", str(out)]
    assert main(args) == 0
    plan = load_plan(out)
    step_s = simulate(plan, timeline=False).step_time_s
    (line,) = fp8_filter_lines(plan, step_s)
    assert line.startswith("fp8: q, k, v, o run faster") and "--fp8-filter q,k,v,o:" in line
    assert line in capsys.readouterr().out
    filtered = replace(plan, config=replace(plan.config, fp8_filter=("q", "k", "v", "o")))
    shown = f"{simulate(filtered, timeline=False).step_time_s * 1e3:.1f} ms per step"
    assert shown in line
    assert plan_facts(filtered)["precision"] == "fp8 rowwise (q,k,v,o in bf16)"
    assert plan_facts(plan)["precision"] == "fp8 rowwise"


def test_the_filter_path_ends_at_the_cost_models_fixed_point(h100):
    """`filter_path` adds the Linears found slower in fp8 until none is: at Llama 3 8B's TP 8
    shards under rowwise, k, v and o first, then q (alone it then pays its region's input cast);
    at its end no Linear left in fp8 is slower, and the block is faster than unfiltered."""
    from meshplan.planner.costing.fp8_advice import filter_path

    graph = profile("llama3-8b", 8192)
    config = _config(recipe="rowwise", tp=8, torch_compile=True)
    path = filter_path(graph, h100, config)
    assert path[0] == () and path[1] == ("k", "v", "o") and path[-1] == ("q", "k", "v", "o")
    picked = path[-1]
    assert {"k", "v"} <= set(picked) and not {"gate", "up", "down"} & set(picked)
    assert slower_in_fp8(graph, h100, replace(config, fp8_filter=picked)) == ()
    block = _block(graph)
    times = [sum(compute_time.compute_times_s(block, cfg, h100, graph.info, 1.0, 1.0, graph.dtype, graph.attention)[:2])
             for cfg in (config, replace(config, fp8_filter=picked))]
    assert times[1] < times[0]
    with pytest.raises(ValueError, match="asks plan to pick"):
        _config(names=("fastest",))


def test_plan_fastest_stores_the_linears_it_picked(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8", "--seq", "8192",
                 "--tp", "8", "--precision", "fp8", "--engine", "torchtitan", "--fp8-recipe", "rowwise", "--compile",
                 "--fp8-filter", "fastest", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"k", "v"} <= set(data["fp8_filter"]) and "fastest" not in data["fp8_filter"]


def test_a_moe_models_filter_applies_to_its_dense_part(h100):
    """A mixture of experts' blocks price their attention (and shared experts) by shape through
    their dense part, so a filter applies there rather than being refused: Mixtral at TP 8 under
    rowwise, k and v left in bf16, changes the step."""
    kwargs = dict(seq=4096, tp=8, sp=True, zero=1, precision="fp8", engine="torchtitan", fp8_recipe="rowwise",
                  torch_compile=True)
    graph = profile("mixtral-8x7b", 4096)
    assert filter_problem(graph, _config(recipe="rowwise", names=("k", "v"), tp=8)) is None
    filtered = estimate("mixtral-8x7b", h100, 8, 8, fp8_filter=("k", "v"), **kwargs)
    assert filtered.step_time_s != estimate("mixtral-8x7b", h100, 8, 8, **kwargs).step_time_s


def test_the_best_filter_is_judged_over_the_step_not_the_block(h100):
    """Llama 3 70B on 512 H100 at TP 8, ZeRO-3 over 64 data ranks, rowwise, compiled: the block's
    path goes on to q, but over the whole step leaving q in bf16 too is slower than k and v alone
    (a shorter backward hides less of ZeRO-3's traffic), so `best_on_path` stops at k and v."""
    from meshplan.planner.costing.fp8_advice import best_on_path, filter_path

    kwargs = dict(seq=8192, tp=8, sp=True, zero=3, precision="fp8", engine="torchtitan", fp8_recipe="rowwise",
                  torch_compile=True)
    graph = profile("llama3-70b", 8192)
    config = ParallelConfig(gpus=512, global_batch=512, tp=8, dp=64, sp=True, zero=3, precision="fp8",
                            engine="torchtitan", fp8_recipe="rowwise", torch_compile=True)
    path = filter_path(graph, h100, config)
    assert path == ((), ("k", "v"), ("q", "k", "v"))
    steps = {names: estimate("llama3-70b", h100, 512, 512, fp8_filter=names, **kwargs) for names in path}
    assert steps[("q", "k", "v")].step_time_s > steps[("k", "v")].step_time_s
    best = best_on_path(graph, h100, config, lambda names: steps[names])
    assert best == (("k", "v"), steps[("k", "v")].step_time_s)


def test_estimates_hint_prints_the_step_of_the_filter_it_names(h100, capsys):
    """The hint's step is `estimate`'s own with that filter, computed apart."""
    flags = ["--model", "llama3-70b", "--cluster", "h100-sxm", "--gpus", "512", "--gbs", "512", "--seq", "8192",
             "--tp", "8", "--sp", "--zero", "3", "--precision", "fp8", "--engine", "torchtitan", "--fp8-recipe",
             "rowwise", "--compile"]
    assert main(["estimate", *flags]) == 0
    hint = capsys.readouterr().out.strip().splitlines()[-1]
    filtered = estimate("llama3-70b", h100, 512, 512, seq=8192, tp=8, sp=True, zero=3, precision="fp8",
                        engine="torchtitan", fp8_recipe="rowwise", torch_compile=True, fp8_filter=("k", "v"))
    assert hint.startswith("hint: k, v run faster in bf16")
    assert f"--fp8-filter k,v gives {filtered.step_time_s * 1e3:.1f} ms per step" in hint


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_auto_filter_and_fqn_filter_decide_as_torchao_does(recipe):
    """meshplan's copy of torchao's auto filter (`AUTO_FILTER_RULES`, dims multiple of 16) and of
    filter_fqns' substring rule (torchtitan's job reader, `TORCHTITAN_LINEAR_FQNS`) against
    torchao's own `_auto_filter_for_recipe` on nn.Linears of every (N, K) on a grid around its
    thresholds (meta device): the same Linears convert."""
    utils = pytest.importorskip("torchao.float8.float8_linear_utils")
    from torchao.float8.config import Float8LinearRecipeName

    from meshplan.planner.contracts.fp8_choice import TORCHTITAN_LINEAR_FQNS
    from meshplan.planner.costing.fp8_filter import AUTO_FILTER_RULES, FP8_DIM_MULTIPLE
    from meshplan.planner.engines.torchtitan import _float8_filter

    torchao_filter = utils._auto_filter_for_recipe(Float8LinearRecipeName(recipe), [])
    dims = (8, 1000, 1024, 1040, 2048, 2064, 4096, 4112, 8192)
    for n in dims:
        for k in dims:
            linear = torch.nn.Linear(k, n, bias=False, device="meta")
            mine = k % FP8_DIM_MULTIPLE == 0 and n % FP8_DIM_MULTIPLE == 0 and not AUTO_FILTER_RULES[recipe](n, k)
            assert mine == torchao_filter(linear, "layers.0.feed_forward.w1"), (n, k)
    linear = torch.nn.Linear(8192, 8192, bias=False, device="meta")  # converted by the auto filter alone
    for entry in ("attention", "wk", "attention.wv", "feed_forward", "w2"):
        named = utils._auto_filter_for_recipe(Float8LinearRecipeName(recipe), [entry])
        torchao_kept = {role for role, fqn in TORCHTITAN_LINEAR_FQNS.items() if not named(linear, f"layers.3.{fqn}")}
        assert set(_float8_filter({"float8": {"filter_fqns": ["output", entry]}}, [])) == torchao_kept, entry
