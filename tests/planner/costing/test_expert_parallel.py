"""Expert parallelism in the cost model, the simulator, the plan file, the search and the CLI.

Rules (planner.costing.expert_parallel): dispatch and combine all-to-alls of tokens * top_k *
hidden bytes over ep ranks tp apart (two each pass), expert states / ep with ZeRO over the
dp / ep expert-data ranks (tp * ep apart), expert GEMMs priced at the per-expert size, and the
imbalance factor F on the busiest rank's expert work and received tokens. Each is checked
against its formula.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.plan import mesh_json, plan_from_json
from meshplan.planner.costing import expert_parallel as epm
from meshplan.planner.costing import moe_compute
from meshplan.planner.costing.collectives import collective_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.state_memory import state_bytes
from tests.planner.costing.meshes import (EXPERTS, HIDDEN, SEQ, SMALL_MOE, TOP_K, expert_block,
                                          expert_block_cost, mesh, small_moe_graph)
from meshplan.planner.costing.state_memory import grad_wire_bytes_per_param

H100 = load_cluster("h100-sxm")


@pytest.fixture(scope="module")
def graph():
    return small_moe_graph()


_block, _cost = expert_block, expert_block_cost


def test_dispatch_bytes_are_tokens_times_top_k_times_hidden(graph):
    assert _block(graph).dispatch_bytes == SEQ * TOP_K * HIDDEN * 2


@pytest.mark.parametrize("ep,tp", [(2, 1), (4, 2), (16, 1)])
def test_all_to_alls_are_two_per_pass_over_ep_ranks_tp_apart(graph, ep, tp):
    """etp = tp without SP: the tp ranks dispatch the same copies and all-reduce the experts'
    partial outputs (forward) and the input's partial gradients (backward) over the tp group."""
    mbs = 2
    cost = _cost(graph, tp=tp, dp=16, ep=ep, microbatch_size=mbs)
    send = mbs * SEQ * TOP_K * HIDDEN * 2
    one = collective_time_s("all_to_all", send, ep, H100, tp)
    partial = collective_time_s("all_reduce", send, tp, H100) if tp > 1 else 0.0
    assert cost.ep_fwd_comm_s == pytest.approx(2 * one + partial, rel=1e-12)
    assert cost.ep_bwd_comm_s == pytest.approx(2 * one + partial, rel=1e-12)
    full = _cost(graph, tp=tp, dp=16, ep=ep, microbatch_size=mbs, recompute="full")
    assert full.ep_bwd_comm_s == pytest.approx(4 * one + 2 * partial, rel=1e-12)  # the recomputed forward's again
    assert _cost(graph, dp=16).ep_fwd_comm_s == 0.0


def test_expert_states_divide_by_ep_and_zero_shards_over_expert_data_ranks(graph):
    block = _block(graph)
    plain = _cost(graph, dp=8, zero=0)
    for ep in (2, 4):  # (ep = dp leaves one expert-data rank: no DDP bucket copy of those gradients)
        assert _cost(graph, dp=8, ep=ep, zero=0).expert_state_bytes == pytest.approx(
            plain.expert_state_bytes / ep, rel=1e-12)
    sharded = _cost(graph, dp=8, ep=4, zero=1)
    states = state_bytes(block.expert_params / 4, 2, 1, "bf16-mixed", "executor", 1, 1)
    assert sharded.expert_state_bytes == pytest.approx(sum(states.values()), rel=1e-12)
    # the non-expert parameters are untouched by ep
    dense = plain.param_bytes + plain.grad_bytes + plain.optimizer_bytes - plain.expert_state_bytes
    with_ep = _cost(graph, dp=8, ep=4, zero=0)
    assert with_ep.param_bytes + with_ep.grad_bytes + with_ep.optimizer_bytes - with_ep.expert_state_bytes == \
        pytest.approx(dense, rel=1e-12)


def test_expert_gradients_reduce_over_the_expert_data_group(graph):
    block, dp, ep, tp = _block(graph), 16, 4, 2
    dense = layer_cost(epm.dense_part(block), mesh(tp=tp, dp=dp, ep=ep), H100, graph.info, profile_dtype="bf16")
    cost = _cost(graph, tp=tp, dp=dp, ep=ep)
    expert_bytes = block.expert_params / ep / tp * grad_wire_bytes_per_param("bf16-mixed", "executor")
    expected = collective_time_s("all_reduce", expert_bytes, dp // ep, H100, tp * ep)
    assert cost.dp_grad_comm_s - dense.dp_grad_comm_s == pytest.approx(expected, rel=1e-9)
    config = mesh(tp=tp, dp=dp, ep=ep)
    assert (config.expert_data_ranks, config.expert_data_stride) == (dp // ep, tp * ep)


def test_expert_gemms_run_at_the_per_expert_size(graph):
    """Grouped GEMMs by shape at the per-expert rows (`moe_compute`, tested there in detail)."""
    block = _block(graph)
    assert epm.expert_gemms(block) == 3  # SwiGLU: gate, up, down
    for ep in (1, 4):
        config = mesh(dp=8, ep=ep)
        grouped_fwd, _ = moe_compute.grouped_gemm_times_s(block, config, H100, graph.info, "bf16", 1.0)
        assert epm.expert_compute_s(block, config, H100, graph.info, "bf16", 1.0)[0] == grouped_fwd
        assert _cost(graph, dp=8, ep=ep).expert_fwd_s > grouped_fwd  # plus the memory-bound kernels
    # larger per-expert batches under EP run closer to peak: less time for the same FLOPs
    assert _cost(graph, dp=8, ep=8).expert_fwd_s < _cost(graph, dp=8, ep=1).expert_fwd_s


def test_imbalance_scales_the_busiest_ranks_expert_work_and_received_tokens(graph):
    factor = 1.5
    skewed_info = replace(graph.info, moe_imbalance=factor)
    base = _cost(graph, dp=8, ep=4, microbatch_size=2)
    skewed = _cost(graph, info=skewed_info, dp=8, ep=4, microbatch_size=2)
    send = 2 * SEQ * TOP_K * HIDDEN * 2
    assert skewed.ep_fwd_comm_s == pytest.approx(2 * collective_time_s("all_to_all", factor * send, 4, H100, 1))
    flops, _, gemms = epm.expert_gemm_flops(_block(graph), mesh(dp=8, ep=4, microbatch_size=2), skewed_info)
    assert flops == pytest.approx(factor * 2 * _block(graph).expert_fwd_flops)
    assert gemms == 3 * EXPERTS // 4
    assert skewed.expert_fwd_s > base.expert_fwd_s
    assert skewed.activation_bytes - base.activation_bytes == pytest.approx(
        (factor - 1) * 2 * _block(graph).expert_act_bytes, rel=1e-9)


def test_ep_must_divide_the_expert_ranks_and_needs_experts(graph):
    with pytest.raises(ValueError, match=r"ep=3 must divide the expert ranks dp\*cp\*tp/etp = 8\*1\*1/1 = 8"):
        ParallelConfig(gpus=8, global_batch=8, dp=8, ep=3)
    config = ParallelConfig(gpus=16, global_batch=16, dp=8, cp=2, ep=16)
    assert config.expert_data_ranks == 1 and "ep=16" in config.label()
    with pytest.raises(ValueError, match="mixture-of-experts"):
        epm.check_expert_parallel(replace(graph.info, num_experts=0, top_k=0), 2)
    with pytest.raises(ValueError, match=r"expert tensor parallelism \(etp=2\) needs a mixture-of-experts model"):
        epm.check_expert_parallel(replace(graph.info, num_experts=0, top_k=0), 1, 2)
    with pytest.raises(ValueError, match="divide the 16 routed experts"):
        epm.check_expert_parallel(graph.info, 32)
    with pytest.raises(ValueError, match="etp=3 must divide the routed experts' width 256"):
        epm.check_expert_parallel(graph.info, 2, 3)


def test_plan_json_writes_ep_only_when_on():
    from meshplan.executor.plans import uniform_plan

    assert "ep" not in mesh_json(ParallelConfig(gpus=8, global_batch=8, dp=8))
    plan = uniform_plan(SMALL_MOE, SEQ, 8, H100, dp=8, ep=4, precision="bf16-mixed")
    data = plan.to_json()
    assert data["mesh"]["ep"] == 4
    assert plan_from_json(data).config.ep == 4
    del data["mesh"]["ep"]
    assert plan_from_json(data).config.ep == 1  # older plans: no expert parallelism
    folded = uniform_plan(SMALL_MOE, SEQ, 8, H100, tp=2, dp=4, ep=8, etp=1, precision="bf16-mixed").to_json()
    assert folded["mesh"] == {"pp": 1, "dp": 4, "tp": 2, "etp": 1, "ep": 8}
    assert plan_from_json(folded).config.expert_tp == 1
    del folded["mesh"]["etp"], folded["mesh"]["ep"]
    assert plan_from_json(folded).config.etp is None  # older plans: experts split as the mesh's tp


# DeepSeek-V3's shape (61 layers, the first 3 dense, 256 routed experts of width 2048, top 8, one
# shared expert; its attention as full multi-head attention).
DEEPSEEK_V3 = ("moe:layers=61,hidden=7168,heads=128,kv_heads=128,experts=256,top_k=8,expert_ffn=2048,"
               "vocab=129280,shared_experts=1,dense_layers=3,ffn=18432")


@pytest.mark.parametrize("spec,gpus,gbs,degrees", [
    # Megatron-Core's Qwen3-235B layout with EP 32 over 16 data ranks: expert TP 1 folds EP over TP
    ("qwen3-235b-a22b", 256, 2048, dict(tp=2, pp=8, etp=1, ep=32, zero=1, sp=True)),
    # DeepSeek-V3 technical report: PP 16, EP 64, no TP, ZeRO-1 on 2048 GPUs
    (DEEPSEEK_V3, 2048, 15360, dict(pp=16, ep=64, zero=1)),
])
def test_published_folded_layouts_are_accepted_and_fit(spec, gpus, gbs, degrees):
    from meshplan.planner.simulation.estimator import estimate

    prediction = estimate(spec, H100, gpus, gbs, 4096, recompute="full", **degrees)
    assert prediction.fits and prediction.breakdown["ep_comm"] > 0
    assert prediction.peak_memory_bytes < H100.device.usable_memory_bytes


def test_simulator_plays_dispatch_and_combine_around_the_expert_gemms(graph):
    from meshplan.planner.simulation.simulator import simulate_config

    config = ParallelConfig(gpus=16, global_batch=32, dp=16, ep=8, precision="bf16-mixed")
    prediction = simulate_config(graph, H100, config, timeline=True)
    assert prediction.breakdown["ep_comm"] > 0
    assert prediction.memory[0].experts > 0
    first = [i for i in prediction.timeline if i.microbatch == 0 and i.stream in ("compute", "ep")
             and i.kind in ("forward", "ep_comm")]
    kinds = [i.kind for i in sorted(first, key=lambda i: i.start_s)][:4]
    assert kinds == ["forward", "ep_comm", "forward", "ep_comm"]  # dense, dispatch, experts, combine
    from meshplan.planner.simulation.simulator import chrome_trace

    trace = chrome_trace(prediction)
    names = json.dumps(trace)
    assert "ep_comm" in names


def _meshplan(*args):
    return subprocess.run([sys.executable, "-m", "meshplan.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_estimate_ep_and_bad_ep():
    job = ["--model", SMALL_MOE, "--cluster", "h100-sxm", "--gpus", "16", "--gbs", "32", "--seq", str(SEQ)]
    ok = _meshplan("estimate", *job, "--ep", "4", "--json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert data["breakdown"]["ep_comm"] > 0 and data["memory_bytes"][0]["experts"] > 0
    for bad, words in ((["--ep", "3"], "--ep 3"), (["--ep", "32"], "--ep 32"),
                       (["--tp", "2", "--etp", "3"], "--etp 3 must divide the stage ranks")):
        result = _meshplan("estimate", *job, *bad)
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1 and words in result.stderr, result.stderr
    dense = _meshplan("estimate", "--model", "gpt:layers=2,hidden=256,heads=4,vocab=1000", "--cluster", "h100-sxm",
                      "--gpus", "8", "--gbs", "8", "--seq", "128", "--ep", "2")
    assert dense.returncode == 2 and "mixture-of-experts" in dense.stderr
    assert len(dense.stderr.strip().splitlines()) == 1
    plan = _meshplan("plan", "--model", "gpt:layers=2,hidden=256,heads=4,vocab=1000", "--cluster", "h100-sxm",
                     "--gpus", "8", "--gbs", "8", "--seq", "128", "--ep", "2")
    assert plan.returncode == 2 and "mixture-of-experts" in plan.stderr.strip().splitlines()[-1]


def test_plan_picks_expert_parallelism_and_says_why(graph):
    from meshplan.planner.search.assembly import explain
    from meshplan.planner.search.driver import search_plan

    plan = search_plan(SMALL_MOE, H100, 16, 32, SEQ, graph=graph, pp=1, tp=1, top_k=3)
    assert plan.config.ep > 1
    text = explain(plan.to_json())
    assert f"Expert parallelism {plan.config.ep}" in text and "all-to-all" in text
    pinned = search_plan(SMALL_MOE, H100, 16, 32, SEQ, graph=graph, pp=1, tp=1, ep=2, top_k=2)
    assert pinned.config.ep == 2


def test_report_shows_the_all_to_all_time_and_expert_memory_per_rank():
    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.simulation.simulator import simulate
    from meshplan.reports import build_report

    plan = uniform_plan(SMALL_MOE, SEQ, 32, H100, dp=16, ep=8, precision="bf16-mixed")
    prediction = simulate(plan, timeline=False)
    html = build_report(plan.with_prediction(prediction.to_json()))
    assert "of which experts" in html and "expert parallelism ep=8" in html
    a2a_ms = prediction.breakdown["ep_comm"] * 1e3
    assert f"{a2a_ms:.2f}"[:4] in html  # the all-to-all time, as the breakdown gives it
    assert "ep_comm" in html


def test_folded_tp2_etp1_slices_the_tp_groups_tokens_and_gathers_them_back(graph):
    """No SP, etp 1 under tp 2: each tp rank dispatches half of the tokens its tp group holds alike
    over an EP group of consecutive ranks, and the combined halves are all-gathered back."""
    mbs, ep = 2, 8
    cost = _cost(graph, tp=2, dp=8, ep=ep, etp=1, microbatch_size=mbs)
    routed = mbs * SEQ * TOP_K * HIDDEN * 2
    one = collective_time_s("all_to_all", routed / 2, ep, H100, 1)
    gather_back = collective_time_s("all_gather", routed / TOP_K, 2, H100, 1)
    assert cost.ep_fwd_comm_s == pytest.approx(2 * one + gather_back, rel=1e-12)
    assert cost.ep_bwd_comm_s == pytest.approx(2 * one, rel=1e-12)
    # the expert work per rank is the tp group's tokens / tp whatever etp and ep are
    default = _cost(graph, tp=2, dp=8, ep=2, microbatch_size=mbs)
    flops = epm.expert_gemm_flops(_block(graph), mesh(tp=2, dp=8, ep=ep, etp=1, microbatch_size=mbs), graph.info)
    assert flops[0] == pytest.approx(mbs * _block(graph).expert_fwd_flops / 2)
    assert flops[2] == 3 * EXPERTS // ep
    # states: experts / (ep * etp) per rank, gradients over tp*dp/(etp*ep) = 2 ranks etp*ep = 8 apart
    block = _block(graph)
    assert cost.expert_state_bytes == pytest.approx(
        sum(state_bytes(block.expert_params / ep, 2, 0, "bf16-mixed", "executor", 2, 1).values()), rel=1e-12)
    dense = layer_cost(epm.dense_part(block), mesh(tp=2, dp=8, ep=ep, etp=1), H100, graph.info, profile_dtype="bf16")
    grads = block.expert_params / ep * grad_wire_bytes_per_param("bf16-mixed", "executor")
    assert cost.dp_grad_comm_s - dense.dp_grad_comm_s == pytest.approx(
        collective_time_s("all_reduce", grads, 2, H100, 8), rel=1e-9)
    assert default.expert_state_bytes > cost.expert_state_bytes  # experts / (2 tp) vs / 8


def test_sequence_parallel_expert_tp_gathers_the_received_tokens(graph):
    """SP holds T/tp tokens per rank: the expert-TP group all-gathers what its ranks received and
    reduce-scatters the experts' output (Megatron-Core's alltoall dispatcher)."""
    mbs, ep, tp = 2, 4, 2
    cost = _cost(graph, tp=tp, dp=8, ep=ep, sp=True, microbatch_size=mbs)
    send = mbs * SEQ * TOP_K * HIDDEN * 2 / tp
    one = collective_time_s("all_to_all", send, ep, H100, tp)
    gathers = (collective_time_s("all_gather", tp * send, tp, H100)
               + collective_time_s("reduce_scatter", tp * send, tp, H100))
    assert cost.ep_fwd_comm_s == pytest.approx(2 * one + gathers, rel=1e-12)
    assert cost.ep_bwd_comm_s == pytest.approx(2 * one + gathers, rel=1e-12)


def test_sequence_parallel_etp1_gathers_nothing_back(graph):
    """SP with etp 1 under tp 2: each rank dispatches its own T/tp shard and the combine returns
    that shard, which the sequence-parallel stream keeps: the all-to-alls alone, no slice gather."""
    mbs, ep = 2, 8
    cost = _cost(graph, tp=2, dp=8, ep=ep, etp=1, sp=True, microbatch_size=mbs)
    one = collective_time_s("all_to_all", mbs * SEQ * TOP_K * HIDDEN * 2 / 2, ep, H100, 1)
    assert epm.slice_gather_s(_block(graph), mesh(tp=2, dp=8, ep=ep, etp=1, sp=True, microbatch_size=mbs), H100,
                              graph.info, 1.0) == 0.0
    assert cost.ep_fwd_comm_s == pytest.approx(2 * one, rel=1e-12) == cost.ep_bwd_comm_s


def test_all_to_all_stays_inside_a_node_where_the_layout_fits(graph):
    """ep 8 over etp 1 spans 8 consecutive ranks (one node); at etp = tp = 2 it spans two nodes."""
    from meshplan.planner.costing.collectives import group_placement

    inside, across = mesh(tp=2, dp=8, ep=8, etp=1), mesh(tp=2, dp=8, ep=8)
    assert group_placement(inside.ep, inside.expert_tp, H100.gpus_per_node).num_nodes == 1
    assert group_placement(across.ep, across.expert_tp, H100.gpus_per_node).num_nodes == 2
    send = 2 * SEQ * TOP_K * HIDDEN * 2
    assert epm.all_to_all_s(send, inside, H100, graph.info) < epm.all_to_all_s(send, across, H100, graph.info)


@pytest.mark.parametrize("sp", [False, True])
def test_a_moe_block_pays_attention_s_tp_collectives_only_unless_it_has_shared_experts(graph, sp):
    """The routed experts' output takes no TP all-reduce (SP: all-gather + reduce-scatter) of the
    (b, s, h) stream: the dispatchers and the expert-TP group exchange the copies instead. A block
    without shared experts pays one region per pass (attention's); with shared experts, two."""
    from meshplan.planner.costing.collectives import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
    from meshplan.planner.profiling.profiler import profile

    tp, mbs = 2, 1
    stream = SEQ * HIDDEN * 2 * mbs
    link = H100.link_for_group(tp, 1)
    if sp:  # gather + reduce-scatter forward; backward again plus the kept shard's re-gather
        one_fwd = all_gather_time_s(stream, tp, link) + reduce_scatter_time_s(stream, tp, link)
        one_bwd = one_fwd + all_gather_time_s(stream, tp, link)
    else:
        one_fwd = one_bwd = all_reduce_time_s(stream, tp, link)
    block = _block(graph)
    assert block.tp_split.num_allreduce_per_pass == 2  # the graph's count: attention's and the MoE output's
    assert epm.moe_tp_regions(block.tp_split) == 1 and epm.dense_part(block).tp_split.num_allreduce_per_pass == 1
    config = mesh(tp=tp, dp=4, ep=4, sp=sp, microbatch_size=mbs)
    pass_s = layer_cost(epm.dense_part(replace(block, tp_split=replace(block.tp_split, num_allreduce_per_pass=0))),
                        config, H100, graph.info, profile_dtype="bf16").tp_fwd_comm_s  # DTensor's fixed cost alone
    cost = layer_cost(block, config, H100, graph.info, profile_dtype="bf16")
    assert cost.tp_fwd_comm_s == pytest.approx(one_fwd + pass_s, rel=1e-9)
    assert cost.tp_bwd_comm_s == pytest.approx(one_bwd + pass_s, rel=1e-9)
    shared = profile(SMALL_MOE + ",shared_experts=1", SEQ, dtype="bf16")
    shared_block = _block(shared)
    assert epm.moe_tp_regions(shared_block.tp_split) == 2
    with_shared = layer_cost(shared_block, config, H100, shared.info, profile_dtype="bf16")
    assert with_shared.tp_fwd_comm_s == pytest.approx(2 * one_fwd + pass_s, rel=1e-9)
