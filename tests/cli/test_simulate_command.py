"""The simulator over the cost model: the published pipeline step, plans, and `meshplan simulate`."""
from __future__ import annotations

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.simulation.simulator import simulate, simulate_config
from meshplan.planner.simulation.event_engine import simulate_step
from meshplan.planner.simulation.step_costs import StepCosts

# Float sums of a few hundred durations: relative error well under 1e-9.
REL = 1e-9


def config(pp, num_mb, dp=1, zero=0) -> ParallelConfig:
    return ParallelConfig(gpus=pp * dp, global_batch=num_mb * dp, pp=pp, dp=dp, zero=zero)


def synthetic_graph(num_blocks=8, hidden=1024, seq=512, heads=16, vocab=32000, with_ends=True):
    """A Llama-like layer graph written from the usual formulas (independent of the profiler)."""
    from meshplan.planner.contracts.graph import LayerProfile, ModelGraph, ModelInfo, TPSplit

    elem = 2  # bf16
    num_params = 4 * hidden * hidden + 3 * hidden * 4 * hidden
    fwd_flops = 2 * num_params * seq + 4 * seq * seq * hidden
    blocks = tuple(LayerProfile(
        name=f"block{i}", kind="block", fwd_flops=fwd_flops, bwd_flops=2 * fwd_flops, num_params=num_params,
        param_bytes=num_params * elem, act_tp_sharded_bytes=seq * hidden * elem * 10,
        act_tp_replicated_bytes=seq * hidden * elem * 4, act_attn_score_bytes=0, input_bytes=seq * hidden * elem,
        output_bytes=seq * hidden * elem, repeat_of="block0" if i else None,
        tp_split=TPSplit(kind="block", num_heads=heads, num_kv_heads=heads, num_allreduce_per_pass=2))
        for i in range(num_blocks))
    ends = ()
    if with_ends:
        vocab_split = TPSplit(kind="vocab", vocab_size=vocab)
        embed = LayerProfile(name="embed", kind="embedding", fwd_flops=0, bwd_flops=0, num_params=vocab * hidden,
                             param_bytes=vocab * hidden * elem, act_tp_sharded_bytes=0, act_tp_replicated_bytes=0,
                             act_attn_score_bytes=0, input_bytes=seq * 8, output_bytes=seq * hidden * elem,
                             tp_split=vocab_split)
        head = LayerProfile(name="head", kind="head", fwd_flops=2 * vocab * hidden * seq,
                            bwd_flops=4 * vocab * hidden * seq, num_params=vocab * hidden,
                            param_bytes=vocab * hidden * elem, act_tp_sharded_bytes=seq * vocab * 4,
                            act_tp_replicated_bytes=seq * hidden * elem, act_attn_score_bytes=0,
                            input_bytes=seq * hidden * elem, output_bytes=4, tp_split=vocab_split)
        ends = (embed, head)
    layers = ends[:1] + blocks + ends[1:]
    info = ModelInfo(family="llama", num_layers=num_blocks, hidden=hidden, num_heads=heads, num_kv_heads=heads,
                     ffn=4 * hidden, vocab=vocab, padded_vocab=vocab)
    return ModelGraph(spec="synthetic", seq=seq, dtype="bf16", attention="flash", layers=layers, info=info)


@pytest.fixture(scope="module")
def cluster():
    from meshplan.planner.costing.hardware import load_cluster

    return load_cluster("h100-sxm")


@pytest.mark.parametrize("schedule,vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_simulator_on_balanced_stages_takes_the_published_step(cluster, schedule, vpp):
    """Identical blocks, equal stages, no DP, transfers set to zero: GPipe and 1F1B take
    (m + p - 1) T, interleaved 1F1B (m + (p - 1)/v) T (Narayanan et al. 2021), T a rank's busy time
    per micro-batch summed here from the cost model's layer costs; then the optimizer tail."""
    from meshplan.planner.simulation.simulator import step_costs

    graph = synthetic_graph(num_blocks=16, with_ends=False)
    cfg = ParallelConfig(gpus=32, global_batch=16, tp=8, pp=4, schedule=schedule, virtual_stages=vpp,
                         recompute="selective", sp=True)
    costs = step_costs(graph, cluster, cfg)
    costs = StepCosts(**{**costs.__dict__, "p2p_time_s": ()})
    pred = simulate_step(costs)
    rank0 = [c for c, chunk in zip(costs.layer_costs, costs.chunk_of_layer) if cfg.rank_of_chunk(chunk) == 0]
    # TP collectives block the compute stream; no CP or EP here
    busy_s = sum(c.fwd_compute_s + c.bwd_compute_s + c.recompute_s + c.tp_fwd_comm_s + c.tp_bwd_comm_s
                 for c in rank0)
    tail_s = sum(c.optimizer_step_s for c in rank0)  # rank 0 ends last: its last backward closes the step
    fill = (cfg.pp - 1) / vpp
    # float sums of a few hundred durations
    assert pred.step_time_s == pytest.approx((cfg.num_microbatches + fill) * busy_s + tail_s, rel=1e-9)
    assert pred.bubble_fraction == pytest.approx(fill * busy_s / pred.step_time_s, rel=1e-9)


def test_simulate_config_on_a_model(cluster):
    graph = synthetic_graph()
    cfg = ParallelConfig(gpus=64, global_batch=64, tp=4, pp=4, dp=4, zero=1)
    pred = simulate_config(graph, cluster, cfg, timeline=True)
    keys = {"step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hw_tflops_per_gpu", "mfu", "peak_memory_bytes",
            "memory_bytes", "bubble_fraction", "fits"}
    out = pred.to_json()
    assert keys <= set(out) and len(out["memory_bytes"]) == 4
    model_flops = sum(l.fwd_flops + l.bwd_flops for l in graph.layers) * cfg.global_batch
    assert pred.model_tflops_per_gpu == pytest.approx(model_flops / pred.step_time_s / 64 / 1e12, rel=REL)
    assert pred.hw_tflops_per_gpu == pytest.approx(pred.model_tflops_per_gpu, rel=REL)  # no recomputation
    assert pred.mfu == pytest.approx(pred.model_tflops_per_gpu * 1e12 / cluster.device.peak_flops("bf16"), rel=REL)
    assert pred.tokens_per_s == pytest.approx(64 * 512 / pred.step_time_s, rel=REL)
    assert sum(pred.breakdown.values()) == pytest.approx(pred.step_time_s, rel=1e-9)
    assert pred.fits and pred.peak_memory_bytes < cluster.device.usable_memory_bytes
    assert {i.kind for i in pred.timeline} >= {"forward", "backward", "tp_comm", "send", "recv", "dp_comm"}
    # Full recomputation: more time, fewer activation bytes, hardware FLOPs above model FLOPs.
    full = simulate_config(graph, cluster, ParallelConfig(**{**cfg.to_json(), "recompute": "full"}))
    assert full.step_time_s > pred.step_time_s
    assert full.memory[0].activations < pred.memory[0].activations
    assert full.hw_tflops_per_gpu > full.model_tflops_per_gpu


def _plan_for(graph, cluster, cfg, recompute="none"):
    from meshplan.planner.costing import uniform
    from meshplan.planner.contracts.plan import LayerAssignment, ModelRef, Plan

    chunks = uniform.balanced_layer_chunks(graph, cluster, cfg)
    layers = tuple(LayerAssignment(name=l.name, stage=c % cfg.pp, virtual_stage=c // cfg.pp, tp=cfg.tp, dp=cfg.dp,
                                   recompute=recompute if l.kind == "block" else "none")
                   for l, c in zip(graph.layers, chunks))
    return Plan(model=ModelRef(spec=graph.spec, seq=graph.seq), cluster=cluster, config=cfg, layers=layers)


def test_simulate_plan_matches_simulate_config(cluster):
    graph = synthetic_graph()
    cfg = ParallelConfig(gpus=16, global_batch=16, tp=2, pp=4, dp=2, schedule="interleaved", virtual_stages=2)
    plan = _plan_for(graph, cluster, cfg)
    by_plan = simulate(plan, graph=graph, timeline=False)
    by_config = simulate_config(graph, cluster, cfg, chunk_of_layer=[plan.chunk_of(l) for l in plan.layers])
    assert by_plan.step_time_s == pytest.approx(by_config.step_time_s, rel=REL)
    bad = _plan_for(synthetic_graph(num_blocks=9), cluster, cfg)
    with pytest.raises(ValueError, match="block8"):
        simulate(bad, graph=graph)


@pytest.fixture
def plan_file(tmp_path, cluster, monkeypatch):
    """A plan on disk, simulated against the synthetic graph (the profiler is another module)."""
    import functools

    import meshplan.planner.simulation.simulator as simulate_module
    from meshplan.planner.contracts.plan import save_plan

    graph = synthetic_graph()
    cfg = ParallelConfig(gpus=32, global_batch=32, tp=4, pp=4, dp=2, zero=1, sp=True)
    path = tmp_path / "plan.json"
    save_plan(_plan_for(graph, cluster, cfg, recompute="selective"), path)
    monkeypatch.setattr(simulate_module, "simulate", functools.partial(simulate_module.simulate, graph=graph))
    return path


def test_command_json_and_trace(run_cli, plan_file, tmp_path):
    import json

    code, out, err = run_cli("simulate", "--plan", plan_file, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["fits"] is True and len(data["memory_bytes"]) == 4 and data["step_time_s"] > 0
    trace_path = tmp_path / "trace.json"
    code, out, err = run_cli("simulate", "--plan", plan_file, "--trace", trace_path)
    assert code == 0, err
    assert "step time" in out and "fits: yes" in out and "rank" in out
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"compute", "tp", "p2p", "dp"}
    last_end_us = max(e["ts"] + e["dur"] for e in spans)
    assert last_end_us == pytest.approx(data["step_time_s"] * 1e6, rel=1e-9)


def test_command_rejects_bad_input(run_cli, tmp_path):
    code, _, err = run_cli("simulate", "--plan", tmp_path / "missing.json")
    assert code == 2 and "not found" in err
    (tmp_path / "bad.json").write_text("{")
    code, _, err = run_cli("simulate", "--plan", tmp_path / "bad.json")
    assert code == 2 and "not valid JSON" in err


@pytest.mark.timeout(120)
def test_command_end_to_end_with_the_profiler(run_cli, tmp_path):
    """A real plan for a small GPT on the `cpu` profile: the command profiles the model itself."""
    import json

    pytest.importorskip("meshplan.planner.profiling.profiler")
    from meshplan.planner.costing import uniform
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.contracts.plan import LayerAssignment, ModelRef, Plan, save_plan
    from meshplan.planner.profiling.profiler import profile

    spec, seq = "gpt:layers=4,hidden=64,heads=4,vocab=512", 32
    graph = profile(spec, seq, dtype="fp32", attention="math")
    cluster = load_cluster("cpu")
    cfg = ParallelConfig(gpus=2, global_batch=8, pp=2, microbatch_size=2, precision="fp32")
    chunks = uniform.balanced_layer_chunks(graph, cluster, cfg)
    layers = tuple(LayerAssignment(name=l.name, stage=c, tp=1, dp=1) for l, c in zip(graph.layers, chunks))
    plan = Plan(model=ModelRef(spec=spec, seq=seq, dtype="fp32", attention="math"), cluster=cluster, config=cfg,
                layers=layers)
    save_plan(plan, tmp_path / "plan.json")
    code, out, err = run_cli("simulate", "--plan", tmp_path / "plan.json", "--json")
    assert code == 0, err
    data = json.loads(out)
    expected = simulate_config(graph, cluster, cfg, chunk_of_layer=chunks, recompute_of_layer=["none"] * len(chunks))
    assert data["step_time_s"] == pytest.approx(expected.step_time_s, rel=REL)
    assert data["mfu"] == pytest.approx(expected.mfu, rel=REL)


def test_executor_grad_sync_follows_the_mesh():
    from meshplan.planner.costing.state_memory import grad_sync_mode as executor_grad_sync

    assert executor_grad_sync(config(2, 4, dp=2)) == "after_chunk"
    assert executor_grad_sync(config(1, 4, dp=2)) == "overlap"
    assert executor_grad_sync(config(2, 4, dp=1)) == "overlap"
    assert executor_grad_sync(config(1, 4, dp=2, zero=2)) == "overlap_every_microbatch"
    assert executor_grad_sync(config(1, 4, dp=2, zero=1)) == "overlap"
