"""Each engine's overlap as data (`contracts.overlap`) and the rules that read it
(`costing.overlap`, `costing.context_parallel`, `costing.state_memory.grad_sync_mode`), against
values derived by hand."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ENGINES, ParallelConfig
from meshplan.planner.contracts.config import NO_PIPELINE_ENGINES
from meshplan.planner.contracts.overlap import ENGINE_OVERLAPS, EngineOverlap, engine_overlap
from meshplan.planner.costing import context_parallel, sp_layout
from meshplan.planner.costing.collectives import collective_time_s, send_recv_time_s
from meshplan.planner.costing.communication import dp_comm_s, tp_comm_parts_s
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.overlap import (exposed_ring_s, exposed_step_gather_s, exposed_tp_comm_s,
                                              gathers_in_a_forward, overlap_of, overlap_under)
from meshplan.planner.costing.state_memory import grad_sync_mode
from meshplan.planner.profiling.profiler import profile


def config(**kw) -> ParallelConfig:
    base = dict(gpus=8, global_batch=1, tp=8, pp=1, dp=1, microbatch_size=1, sp=True)
    return ParallelConfig(**{**base, **kw})


def test_readme_overlap_table_has_one_row_per_engine():
    """README's "What each engine overlaps" table names every engine `--engine` takes, once each."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    table = text.split("### What each engine overlaps", 1)[1].split("| engine (version) |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1].strip().split(" ")[0] for line in table.splitlines()[2:] if line.startswith("|")]
    assert sorted(rows) == sorted(ENGINES)


def test_one_overlap_per_engine_each_with_version_and_sources():
    assert sorted(ENGINE_OVERLAPS) == sorted(ENGINES)
    for name in ENGINES:
        overlap = engine_overlap(name)
        assert overlap.engine == name and overlap.version and overlap.sources
        assert overlap.to_json()["engine"] == name
    assert engine_overlap("megatron").tp_comm_overlap and not engine_overlap("meshplan").tp_comm_overlap
    with pytest.raises(ValueError, match="cp_exchange must be one of"):
        replace(engine_overlap("meshplan"), cp_exchange="ulysses")
    with pytest.raises(ValueError, match=r"ep_a2a_hidden_fraction must be in \[0, 1\], got 1.5"):
        replace(engine_overlap("meshplan"), ep_a2a_hidden_fraction=1.5)
    with pytest.raises(ValueError, match="engine must be one of"):
        engine_overlap("nemo")


def test_tp_collective_hidden_under_megatron_exposed_under_meshplan():
    # 10 ms of collectives beside 1 s of GEMMs: Megatron's pipelined overlap exposes one of the
    # 8 pieces (1.25 ms), meshplan's blocking collectives all 10 ms
    assert exposed_tp_comm_s(0.010, 1.0, "block", config(engine="megatron")) == pytest.approx(0.010 / 8)
    assert exposed_tp_comm_s(0.010, 1.0, "block", config()) == 0.010
    # GEMMs shorter than the collective: what they cannot cover stays exposed (10 - 4 ms)
    assert exposed_tp_comm_s(0.010, 0.004, "block", config(engine="megatron")) == pytest.approx(0.006)
    # Transformer Engine's overlap needs sequence parallelism and acts on the blocks' Linears only
    assert exposed_tp_comm_s(0.010, 1.0, "block", config(engine="megatron", sp=False)) == 0.010
    assert exposed_tp_comm_s(0.010, 1.0, "head", config(engine="megatron")) == 0.010


def test_a_configuration_sets_its_own_tp_overlap():
    """`tp_comm_overlap`: Megatron-LM without --tp-comm-overlap blocks on its TP collectives (all
    10 ms exposed), torchtitan with async TP pipelines them as Transformer Engine does (one of 8
    pieces); the engine's record where none is set."""
    off = config(engine="megatron", tp_comm_overlap=False)
    assert exposed_tp_comm_s(0.010, 1.0, "block", off) == 0.010
    assert overlap_of(off).summary().startswith("megatron") and "TP comm blocking" in overlap_of(off).summary()
    on = config(engine="torchtitan", tp_comm_overlap=True)
    assert exposed_tp_comm_s(0.010, 1.0, "block", on) == pytest.approx(0.010 / 8)
    assert overlap_of(config(engine="megatron", tp_comm_overlap=True)) == overlap_of(config(engine="megatron"))
    assert overlap_of(config(engine="torchtitan", tp_comm_overlap=False)) == overlap_of(config(engine="torchtitan"))
    assert overlap_under(off, "torchtitan").tp_comm_overlap is False
    assert overlap_under(config(), "megatron").tp_comm_overlap is True  # the plan sets none: the record's


@pytest.mark.parametrize("kw,message", [
    (dict(tp_comm_overlap=True), "meshplan runs its TP collectives on the compute stream"),
    (dict(engine="deepspeed", tp_comm_overlap=True), "deepspeed runs its TP collectives"),
    (dict(engine="megatron", tp_comm_overlap=True, sp=False), r"needs tp > 1 and sequence parallelism \(got tp=8, "
                                                                r"sp=False\)"),
    (dict(engine="megatron", tp_comm_overlap="yes"), "tp_comm_overlap must be true, false or null")])
def test_a_tp_overlap_the_engine_cannot_run_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        config(**kw)


def test_a_megatron_layer_without_tp_overlap_pays_its_forward_tp_traffic_and_part_of_its_backward():
    """Its forward collectives block; in backward each column Linear's two run beside its own GEMMs
    (`costing.tp_backward`, worked by hand in test_tp_backward.py), which at Llama 3 70B's TP 8
    shapes hide all but the row Linears' output-gradient gathers and attention's regather excess."""
    graph = profile("llama3-70b", 8192)
    cluster = load_cluster("h100-sxm")
    block = next(layer for layer in graph.layers if layer.kind == "block")
    blocking = layer_cost(block, config(engine="megatron", tp_comm_overlap=False), cluster, graph.info)
    (gathers, scatters), (bwd_gathers, bwd_scatters) = tp_comm_parts_s(block, config(), cluster, 1.0)
    assert blocking.tp_fwd_comm_s == pytest.approx(gathers + scatters)
    assert gathers <= blocking.tp_bwd_comm_s < bwd_gathers + bwd_scatters


def test_a_block_under_megatron_pays_one_eighth_of_its_tp_traffic(without_eager_count):
    """Megatron's userbuffers pipeline each TP collective with its GEMM over tp pieces; meshplan's
    executor blocks on them. Their compute is the same once meshplan's eager kernels' count
    (`eager_kernels`, its own test) is set aside, but for the copies the executor's batch-first
    sequence parallelism makes around its collectives (`sp_layout`, its own test; Megatron-LM's
    sequence-first layout makes none): at micro-batch 1 its reduce-scatters' regrouping."""
    graph = profile("llama3-70b", 8192)
    cluster = load_cluster("h100-sxm")
    block = next(layer for layer in graph.layers if layer.kind == "block")
    own = layer_cost(block, config(), cluster, graph.info)
    megatron = layer_cost(block, config(engine="megatron"), cluster, graph.info)
    raw_fwd, raw_bwd = (sum(part) for part in tp_comm_parts_s(block, config(), cluster, 1.0))
    assert raw_fwd > 0 and own.fwd_compute_s > raw_fwd  # the GEMMs cover all but the first piece
    assert own.tp_fwd_comm_s - megatron.tp_fwd_comm_s == pytest.approx(raw_fwd * 7 / 8)
    assert own.tp_bwd_comm_s - megatron.tp_bwd_comm_s == pytest.approx(raw_bwd * 7 / 8)
    copies_fwd_s = sp_layout.copy_times_s(block, config(), cluster, 1.0)[0]
    assert copies_fwd_s > 0 and sp_layout.copy_times_s(block, config(engine="megatron"), cluster, 1.0)[0] == 0
    assert own.fwd_compute_s == pytest.approx(megatron.fwd_compute_s + copies_fwd_s, rel=1e-12)


def test_a_ring_step_exposes_what_its_transfer_takes_beyond_its_attention():
    assert exposed_ring_s(0.003, 0.002, 3) == pytest.approx(0.003)  # 3 steps x (3 - 2 ms)
    assert exposed_ring_s(0.001, 0.002, 3) == 0.0  # every transfer hidden
    cluster = load_cluster("h100-sxm")
    cfg = config(tp=1, cp=8, sp=False, engine="megatron")
    link = cluster.link_for_group(8, 1)
    chunk = 8e9 / 8
    step_s = 0.001
    fwd, bwd = context_parallel.ring_p2p_comm_s(8e9, step_s, cfg, cluster)
    assert fwd == pytest.approx(7 * (send_recv_time_s(chunk, link) - step_s))
    assert bwd == pytest.approx(7 * (send_recv_time_s(2 * chunk, link) - 2 * step_s))
    assert context_parallel.ring_p2p_comm_s(8e6, step_s, cfg, cluster) == (0.0, 0.0)  # 1 MB per step: hidden


def test_torch_ring_all_gather_hidden_behind_the_first_step_and_fp32_merges_paid():
    cluster = load_cluster("h100-sxm")
    cfg = config(gpus=4, tp=1, cp=4, sp=False, engine="torchtitan")
    gather = 4 * 2 * 8192 * 4096 * 2  # K and V of 4 x 8192 tokens at 32 heads x 128, bf16
    elements = gather / 4 / 4  # the rank's output elements: its K (or V) at the query heads
    step_s = 1.0  # long enough to hide the gather and every rotation
    fwd, bwd = context_parallel.torch_ring_comm_s(gather, step_s, cfg, cluster, "bf16")
    assert fwd == pytest.approx(memory_time_s(elements * (3 * 38 + 6), cluster))
    rotate_s = send_recv_time_s(2 * gather / 4, cluster.link_for_group(4, 1))
    assert bwd == pytest.approx(rotate_s + memory_time_s(elements * (4 * 46 + 30), cluster))
    short_fwd, _ = context_parallel.torch_ring_comm_s(gather, 0.0, cfg, cluster, "bf16")
    assert short_fwd - fwd == pytest.approx(collective_time_s("all_gather", gather, 4, cluster, 1))


def test_cp_exchange_follows_the_engine():
    graph = profile("llama3-8b", 32768)
    cluster = load_cluster("h100-sxm")
    block = next(layer for layer in graph.layers if layer.kind == "block")
    costs = {engine: layer_cost(block, config(gpus=8, tp=1, cp=8, sp=False, engine=engine), cluster, graph.info)
             for engine in ENGINES if engine not in NO_PIPELINE_ENGINES}  # llm-foundry has no CP
    # meshplan's executor and DeepSpeed: the blocking K/V all-gather (reduce-scatter of dK/dV)
    gathered = 2 * 32768 * 8 * 128 * 2
    assert costs["meshplan"].cp_fwd_comm_s == pytest.approx(collective_time_s("all_gather", gathered, 8, cluster, 1))
    assert costs["deepspeed"].cp_fwd_comm_s == costs["meshplan"].cp_fwd_comm_s
    # Transformer Engine's ring: 8 MB of K/V per step behind ~10 ms of attention: nothing exposed
    assert costs["megatron"].cp_fwd_comm_s == 0.0 and costs["megatron"].cp_bwd_comm_s == 0.0
    # torch's ring: the fp32 merges of the rank's output are paid, the gather hidden
    assert costs["torchtitan"].cp_fwd_comm_s > 0.0


def test_deepspeed_reduces_gradients_after_the_backward_below_zero3():
    dp = dict(gpus=8, tp=1, dp=8, sp=False, global_batch=16)
    assert grad_sync_mode(config(**dp, zero=1, engine="deepspeed")) == "after_chunk"
    assert grad_sync_mode(config(**dp, zero=0, engine="deepspeed")) == "after_chunk"
    assert grad_sync_mode(config(**dp, zero=3, engine="deepspeed")) == "overlap_every_microbatch"
    assert grad_sync_mode(config(**dp, zero=1)) == "overlap"
    assert grad_sync_mode(config(**dp, zero=1, engine="megatron")) == "overlap"
    assert not engine_overlap("deepspeed").grad_reduce_overlaps(2) and engine_overlap("deepspeed").grad_reduce_overlaps(3)


def test_an_overlap_meshplan_cannot_price_is_refused():
    unpriced = replace(engine_overlap("meshplan"), pp_p2p_async=False)
    assert isinstance(unpriced, EngineOverlap)
    from meshplan.planner.costing import overlap as rules

    original = dict(ENGINE_OVERLAPS)
    try:
        ENGINE_OVERLAPS["meshplan"] = unpriced
        with pytest.raises(ValueError, match="prices parameter gathers as prefetched"):
            rules.overlap_of(config())
    finally:
        ENGINE_OVERLAPS.clear()
        ENGINE_OVERLAPS.update(original)


def test_megatron_reduces_pipelined_gradients_during_the_last_backward():
    # Megatron-Core's --overlap-grad-reduce launches each chunk's buckets in its last backward
    # under every schedule; torch pipelining (meshplan, torchtitan) reduces a chunk after it
    piped = dict(gpus=16, tp=1, pp=2, dp=8, sp=False, global_batch=64, zero=1)
    assert grad_sync_mode(config(**piped, engine="megatron")) == "overlap"
    assert grad_sync_mode(config(**piped)) == "after_chunk"
    assert grad_sync_mode(config(**piped, engine="torchtitan")) == "after_chunk"
    assert grad_sync_mode(config(**{**piped, "zero": 0}, engine="megatron")) == "overlap"
    with pytest.raises(ValueError, match="pp_grad_reduce must be one of"):
        replace(engine_overlap("megatron"), pp_grad_reduce="never")
    with pytest.raises(ValueError, match="param_gather must be one of"):
        replace(engine_overlap("megatron"), param_gather="per_layer")


def test_a_step_gather_behind_the_next_forward_exposes_what_the_forward_cannot_cover():
    dp = dict(gpus=16, tp=1, dp=16, sp=False, global_batch=64, zero=1)
    # Megatron's distributed optimizer: 10 ms of gather behind a 4 ms forward exposes 6 ms; behind
    # a 12 ms forward nothing; so does meshplan's executor (FSDP2 kept gathered, prefetched in the
    # first forward); engines that reshard after every backward expose all 10 ms; ZeRO-0 and
    # ZeRO-3 never gather so
    for engine in ("megatron", "meshplan"):
        assert exposed_step_gather_s(0.010, 0.004, config(**dp, engine=engine)) == pytest.approx(0.006)
        assert exposed_step_gather_s(0.010, 0.012, config(**dp, engine=engine)) == 0.0
    assert exposed_step_gather_s(0.010, 0.004, config(**dp, engine="torchtitan")) == 0.010
    assert not gathers_in_a_forward(config(**{**dp, "zero": 3}, engine="megatron"))
    assert gathers_in_a_forward(config(**{**dp, "zero": 2}, engine="megatron"))


def test_megatron_and_meshplan_gather_zero1_parameters_once_per_step_torchtitan_before_every_forward():
    cluster = load_cluster("h100-sxm")
    dp = dict(gpus=16, tp=1, dp=16, sp=False, global_batch=64, zero=1)  # 4 micro-batches per replica
    params = 200e6
    gather = collective_time_s("all_gather", params * 2, 16, cluster, 1)  # bf16 parameters
    reduce = collective_time_s("reduce_scatter", params * 4, 16, cluster, 1)  # fp32 gradients
    assert dp_comm_s(params, config(**dp, engine="megatron"), cluster) == pytest.approx((reduce, gather, 0.0, 0.0))
    assert dp_comm_s(params, config(**dp, engine="torchtitan"), cluster) == pytest.approx((reduce, 0.0, gather, 0.0))
    # meshplan's executor keeps ZeRO-1/2 parameters gathered across micro-batches: once per step
    assert dp_comm_s(params, config(**dp), cluster) == pytest.approx((reduce, gather, 0.0, 0.0))
    # a block's cost: the step's gather less the one micro-batch forward it hides behind
    graph = profile("gpt:layers=2,hidden=2048,heads=16,vocab=32000", 2048)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    megatron = layer_cost(block, config(**dp, engine="megatron"), cluster, graph.info)
    titan = layer_cost(block, config(**dp, engine="torchtitan"), cluster, graph.info)
    own = layer_cost(block, config(**dp), cluster, graph.info)
    raw = collective_time_s("all_gather", block.num_params * 2, 16, cluster, 1)
    assert megatron.fwd_gather_s == own.fwd_gather_s == 0.0 and titan.fwd_gather_s == pytest.approx(raw)
    for cost in (megatron, own):
        assert cost.dp_param_gather_s == pytest.approx(max(0.0, raw - cost.fwd_busy_s))
    assert megatron.dp_grad_comm_s == pytest.approx(titan.dp_grad_comm_s) == pytest.approx(own.dp_grad_comm_s)


def test_the_exposed_reduce_scatter_of_a_data_parallel_megatron_step_is_the_hand_worked_figure():
    # pp 1, 4 micro-batches, 16 ranks one per node (tp 8 apart). Every layer's fp32 reduce-scatter
    # is its own bucket (each over 25 MB), launched in the last micro-batch's backward, and lasts
    # longer than the next layer's backward, so the reduction runs back to back from the end of
    # the head's last backward: it exposes sum(reduce-scatters) - (last backward - head's).
    from meshplan.planner.simulation.estimator import make_config
    from meshplan.planner.simulation.simulator import simulate_config, step_costs

    cluster = load_cluster("h100-sxm")
    graph = profile("gpt:layers=4,hidden=4096,heads=32,vocab=32000,tied=false", 2048)
    cfg = make_config(graph, cluster, gpus=128, global_batch=64, tp=8, pp=1, zero=1, sp=True, engine="megatron")
    assert cfg.num_microbatches == 4
    costs = step_costs(graph, cluster, cfg).layer_costs
    backward = costs[::-1]
    assert all(c.grad_bytes > 25 * 2**20 for c in costs)
    assert all(c.dp_grad_comm_s > after.bwd_busy_s for c, after in zip(backward, backward[1:]))
    last_backward = sum(c.bwd_busy_s for c in costs)
    exposed_reduce = sum(c.dp_grad_comm_s for c in costs) - (last_backward - costs[-1].bwd_busy_s)
    exposed_gather = sum(c.dp_param_gather_s for c in costs)  # each step gather beyond its forward
    assert exposed_reduce > 0 and exposed_gather > 0
    prediction = simulate_config(graph, cluster, cfg)
    assert prediction.breakdown["dp_comm"] == pytest.approx(exposed_reduce + exposed_gather, rel=1e-6)
    compute = 4 * sum(c.fwd_busy_s + c.bwd_busy_s for c in costs)
    optimizer = sum(c.optimizer_step_s for c in costs)
    assert prediction.step_time_s == pytest.approx(compute + exposed_reduce + exposed_gather + optimizer, rel=1e-6)
