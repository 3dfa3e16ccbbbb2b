"""The MoE token dispatchers (planner.costing.moe_dispatch): each priced by its traffic, recorded in
plan.json, read from and written to Megatron-LM arguments.

alltoall sends every routed copy; allgather gathers every token over the EP group; deepep sends
a token once per destination node over the rails (N (1 - C(E - E/N, k) / C(E, k)) distinct nodes
per token under uniform routing) and once per destination GPU over NVLink inside the node.
"""
from __future__ import annotations

import json
from dataclasses import replace
from itertools import combinations
from math import comb

import pytest

from meshplan.planner.contracts.graph import ModelInfo
from meshplan.planner.contracts.plan import ModelRef, plan_from_json
from meshplan.planner.costing import expert_parallel as epm
from meshplan.planner.costing.collectives import collective_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.moe_dispatch import (deepep_dispatch_s, dispatch_combine_s, expected_distinct_bins,
                                                  expected_distinct_nodes, per_gpu_share)
from meshplan.planner.engines.bridge import export_plan
from meshplan.planner.engines.launch_script import parse_arguments
from meshplan.planner.engines.megatron import read_megatron

H100 = load_cluster("h100-sxm")  # 8 GPUs and 8 rails per node
SPEC = "moe:layers=2,hidden=256,heads=8,kv_heads=4,experts=32,top_k=4,expert_ffn=256,vocab=1024"


def _brute_force_distinct_nodes(experts: int, top_k: int, nodes: int) -> float:
    per_node = experts // nodes
    choices = list(combinations(range(experts), top_k))
    return sum(len({expert // per_node for expert in choice}) for choice in choices) / len(choices)


@pytest.mark.parametrize("experts,top_k,nodes", [(8, 3, 2), (12, 4, 3), (6, 2, 6), (16, 5, 4), (10, 10, 5),
                                                 (9, 1, 3)])
def test_expected_distinct_nodes_is_the_enumerated_mean(experts, top_k, nodes):
    assert expected_distinct_nodes(experts, top_k, nodes) == pytest.approx(
        _brute_force_distinct_nodes(experts, top_k, nodes), rel=1e-12)


def test_expected_distinct_nodes_worked_example():
    """Top-8 of 128 experts over 4 nodes: 3.629 nodes per token, 2.72 of them remote (of the
    plain all-to-all's 6 remote copies); 2 of 8 experts on 2 nodes: 1 + 2 * 4 * 4 / 28 = 1.571."""
    assert expected_distinct_nodes(128, 8, 4) == pytest.approx(3.62901, abs=1e-5)
    assert expected_distinct_nodes(128, 8, 4) * 3 / 4 == pytest.approx(2.72, abs=5e-3)
    assert expected_distinct_nodes(8, 2, 2) == pytest.approx(2 * (1 - 6 / 28))
    assert expected_distinct_nodes(8, 2, 1) == 1.0
    with pytest.raises(ValueError, match="experts=10, nodes=4"):
        expected_distinct_nodes(10, 2, 4)


def _brute_force_group_limited(experts: int, top_k: int, bins: int, groups: int, group_topk: int) -> float:
    """Every choice of group_topk groups, then every top-k of their experts, equally likely: the
    mean distinct bins (E / bins contiguous experts each) hit."""
    per_group, per_bin, means = experts // groups, experts // bins, []
    for chosen in combinations(range(groups), group_topk):
        pool = [g * per_group + i for g in chosen for i in range(per_group)]
        picks = list(combinations(pool, top_k))
        means.append(sum(len({e // per_bin for e in pick}) for pick in picks) / len(picks))
    return sum(means) / len(means)


@pytest.mark.parametrize("experts,top_k,bins,groups,group_topk", [
    (16, 3, 4, 4, 2),    # one group a bin (DeepSeek-V3's group a node)
    (16, 3, 2, 4, 2),    # two groups a bin
    (16, 2, 8, 4, 2),    # a group over two bins (GPUs inside a node's group)
    (12, 4, 3, 6, 3),
    (16, 3, 4, 4, 4),    # every group allowed: the unlimited count
])
def test_group_limited_distinct_bins_is_the_enumerated_mean(experts, top_k, bins, groups, group_topk):
    assert expected_distinct_bins(experts, top_k, bins, groups, group_topk) == pytest.approx(
        _brute_force_group_limited(experts, top_k, bins, groups, group_topk), rel=1e-12)


def test_deepseek_v3_node_limit():
    """Top-8 of 256 experts in 4 of 8 groups, one group a node: 3.63 nodes a token instead of the
    unlimited 5.29 (the report's 'at most 4 nodes'); groups that nest in no bins keep the unlimited count."""
    assert expected_distinct_bins(256, 8, 8, 8, 4) == pytest.approx(4 * (1 - comb(96, 8) / comb(128, 8)))
    assert expected_distinct_bins(256, 8, 8, 8, 4) <= 4 < expected_distinct_nodes(256, 8, 8)
    assert expected_distinct_bins(24, 2, 4, 6, 3) == expected_distinct_nodes(24, 2, 4)
    assert expected_distinct_bins(256, 8, 8) == expected_distinct_nodes(256, 8, 8)


def _brute_force_per_gpu_share(experts: int, top_k: int, ep: int) -> float:
    """Mean over every top-k choice of the distinct GPUs (E / ep experts each) hit, over k."""
    return _brute_force_distinct_nodes(experts, top_k, ep) / top_k


@pytest.mark.parametrize("experts,top_k,ep", [(32, 4, 8), (16, 4, 4), (8, 2, 2), (12, 3, 6), (6, 6, 3)])
def test_per_gpu_share_is_the_enumerated_mean(experts, top_k, ep):
    assert per_gpu_share(experts, top_k, ep) == pytest.approx(_brute_force_per_gpu_share(experts, top_k, ep),
                                                              rel=1e-12)


def test_per_gpu_share_worked_example():
    """Qwen3-235B's top-8 of 128 experts over EP 8: 16 experts a GPU, a token lands on
    8 (1 - C(112, 8) / C(128, 8)) = 5.34 distinct GPUs, 2/3 of its 8 copies; over EP 32 on 7.36;
    one expert per GPU (E = ep) sends every copy; top-1 always one."""
    missed = comb(112, 8) / comb(128, 8)
    assert per_gpu_share(128, 8, 8) == pytest.approx((1 - missed), rel=1e-12)
    assert per_gpu_share(128, 8, 8) == pytest.approx(0.6674, abs=1e-4)
    assert per_gpu_share(128, 8, 32) * 8 == pytest.approx(7.36, abs=5e-3)
    assert per_gpu_share(8, 4, 8) == 1.0 and per_gpu_share(128, 1, 8) == 1.0


def test_deepep_on_one_node_is_the_nvlink_all_to_all_of_one_copy_per_gpu():
    """32 experts, top-4, EP 8 (4 experts a GPU): a token reaches 8 (1 - C(28, 4) / C(32, 4)) = 3.44
    distinct GPUs, 0.861 of its 4 copies; the plain all-to-all sends every copy."""
    copies = 64e6
    for ep, stride in ((8, 1), (4, 2), (2, 1)):
        share = per_gpu_share(32, 4, ep)
        one_node = collective_time_s("all_to_all", copies * share, ep, H100, stride)
        assert deepep_dispatch_s(copies, ep, stride, H100, 32, 4) == one_node
        assert dispatch_combine_s("deepep", copies, copies / 4, ep, stride, H100, 32, 4) == 2 * one_node
        plain = collective_time_s("all_to_all", copies, ep, H100, stride)
        assert dispatch_combine_s("alltoall", copies, copies / 4, ep, stride, H100, 32, 4) == 2 * plain > 2 * one_node
    assert per_gpu_share(32, 4, 8) == pytest.approx(8 * (1 - comb(28, 4) / comb(32, 4)) / 4) == pytest.approx(
        0.8612, abs=1e-4)


def test_deepep_across_nodes_sends_each_token_once_per_node_over_the_rails():
    """EP 32 over 4 nodes of 8, top-8 of 128: the fullest node's rails carry 8 ranks' tokens to
    2.72 remote nodes each (D / 8 bytes a token), NVLink the local copies and the forwarding."""
    copies = 256e6  # F D: one rank's routed copies
    nic = H100.inter_node.bw_for("all_to_all")
    nvlink = H100.intra_node.bw_for("all_to_all")
    rail_s = 8 * copies / 8 * expected_distinct_nodes(128, 8, 4) * 3 / 4 / (8 * nic)
    nvlink_s = copies * per_gpu_share(128, 8, 32) * (7 / 32 + 24 / 32 * 7 / 8) / nvlink
    assert rail_s > nvlink_s  # the rails bound it: one copy per node there, one per GPU on NVLink
    expected = max(rail_s, nvlink_s) + H100.inter_node.latency_s + H100.intra_node.latency_s
    assert deepep_dispatch_s(copies, 32, 1, H100, 128, 8) == pytest.approx(expected, rel=1e-12)
    plain = collective_time_s("all_to_all", copies, 32, H100, 1)  # 8 * 24 / 32 of D over the 8 rails
    assert plain == pytest.approx(8 * 24 / 32 * copies / (8 * nic) + H100.inter_node.latency_s
                                  + H100.intra_node.latency_s, rel=1e-12)
    assert expected < plain


def test_allgather_gathers_every_token_whatever_the_routing():
    tokens = 8e6
    expected = (collective_time_s("all_gather", 8 * tokens, 8, H100, 1)
                + collective_time_s("reduce_scatter", 8 * tokens, 8, H100, 1))
    assert dispatch_combine_s("allgather", 4 * tokens, tokens, 8, 1, H100, 32, 4) == expected
    assert dispatch_combine_s("allgather", 9 * tokens, tokens, 8, 1, H100, 32, 4) == expected  # skewed: the same
    assert dispatch_combine_s("allgather", 4 * tokens, tokens, 1, 1, H100, 32, 4) == 0.0  # no EP, no exchange
    with pytest.raises(ValueError, match="got 'nccl'"):
        dispatch_combine_s("nccl", 4 * tokens, tokens, 8, 1, H100, 32, 4)


def test_the_layer_cost_prices_the_dispatcher_it_is_given():
    """ep_comm_s under each dispatcher: the default is the two all-to-alls of F D it always was."""
    from meshplan.planner.profiling.profiler import profile
    from tests.planner.costing.meshes import mesh

    graph = profile(SPEC, 1024)
    block = next(layer for layer in graph.layers if layer.expert_params)
    config = mesh(dp=32, ep=32)
    send = epm.dispatch_send_bytes(block, config, 1.0)
    default = epm.ep_comm_s(send, config, H100, graph.info)[0]
    assert default == 2 * epm.all_to_all_s(send, config, H100, graph.info)
    deepep = epm.ep_comm_s(send, config, H100, replace(graph.info, moe_dispatcher="deepep"))[0]
    assert deepep == 2 * deepep_dispatch_s(send, 32, 1, H100, 32, 4) < default


def test_model_info_and_plan_refuse_an_unknown_dispatcher():
    with pytest.raises(ValueError, match="moe_dispatcher must be one of alltoall, allgather, deepep, got 'nccl'"):
        ModelInfo(family="moe", num_layers=2, hidden=8, num_heads=1, vocab=8, moe_dispatcher="nccl")
    with pytest.raises(ValueError, match="model.moe_dispatcher must be one of"):
        ModelRef(spec=SPEC, seq=128, moe_dispatcher="flex")


def uniform_plan_of(gpus: int, **kwargs):
    from meshplan.executor.plans import uniform_plan

    return uniform_plan(SPEC, 128, gpus, H100, **{"precision": "bf16-mixed", **kwargs})


def _plan(**kwargs):
    return uniform_plan_of(32, **{"dp": 32, "ep": 32, **kwargs})


def test_plan_json_records_the_dispatcher_only_when_not_the_default():
    plan = _plan()
    data = plan.to_json()
    assert "moe_dispatcher" not in data["model"]  # plans written before it read as alltoall, as costed
    assert plan_from_json(json.loads(json.dumps(data))).model.moe_dispatcher == "alltoall"
    deepep = replace(plan, model=replace(plan.model, moe_dispatcher="deepep"))
    data = deepep.to_json()
    assert data["model"]["moe_dispatcher"] == "deepep"
    loaded = plan_from_json(json.loads(json.dumps(data)))
    assert loaded.model.moe_dispatcher == "deepep" and loaded.digest == deepep.digest != plan.digest


def test_simulate_prices_the_plan_s_dispatcher():
    from meshplan.planner.simulation.simulator import simulate

    plan = _plan()
    deepep = replace(plan, model=replace(plan.model, moe_dispatcher="deepep"))
    allgather = replace(plan, model=replace(plan.model, moe_dispatcher="allgather"))
    steps = {name: simulate(p, timeline=False).step_time_s for name, p in
             (("alltoall", plan), ("deepep", deepep), ("allgather", allgather))}
    assert steps["deepep"] < steps["alltoall"] and len(set(steps.values())) == 3


def test_megatron_arguments_carry_the_dispatcher_both_ways():
    deepep = replace(_plan(), model=replace(_plan().model, moe_dispatcher="deepep"))
    text = export_plan(deepep, "megatron").text
    flags = parse_arguments(text)
    assert flags["--moe-token-dispatcher-type"] == "flex" and "--moe-enable-deepep" in flags
    assert read_megatron(text).moe_dispatcher == "deepep"
    default_text = export_plan(_plan(), "megatron").text
    assert parse_arguments(default_text)["--moe-token-dispatcher-type"] == "alltoall"
    assert read_megatron(default_text).moe_dispatcher == "alltoall"
    base = default_text.replace("--moe-token-dispatcher-type alltoall\n", "")
    job = read_megatron(base)  # Megatron-Core's default dispatcher, said in a note
    assert job.moe_dispatcher == "allgather" and any("default allgather" in note for note in job.notes)
    assert read_megatron(base + "--moe-token-dispatcher-type allgather\n").moe_dispatcher == "allgather"
    flex = read_megatron(base + "--moe-token-dispatcher-type flex\n")
    assert flex.moe_dispatcher == "deepep" and any("without --moe-enable-deepep" in note for note in flex.notes)
    from meshplan.planner.contracts.errors import MeshplanError

    with pytest.raises(MeshplanError, match="got 'ring'"):
        read_megatron(base + "--moe-token-dispatcher-type ring\n")
    dense = read_megatron("--tensor-model-parallel-size 2\n--num-layers 2\n")  # no experts: nothing dispatched
    assert dense.moe_dispatcher == "alltoall" and not any("dispatcher" in note for note in dense.notes)


def test_cli_takes_the_dispatcher_and_refuses_it_on_a_dense_model(run_cli, tmp_path):
    base = ("estimate", "--model", SPEC, "--cluster", "h100-sxm", "--gpus", "32", "--gbs", "32", "--seq", "1024",
            "--ep", "32", "--json")
    steps = {}
    for name in ("alltoall", "deepep"):
        code, out, _ = run_cli(*base, "--moe-dispatcher", name)
        assert code == 0
        steps[name] = json.loads(out)["step_time_s"]
    code, out, _ = run_cli(*base)
    assert code == 0 and json.loads(out)["step_time_s"] == steps["alltoall"] > steps["deepep"]
    code, _, err = run_cli("estimate", "--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8",
                           "--moe-dispatcher", "deepep")
    assert code == 2 and "needs a mixture-of-experts model" in err
    deepep = replace(_plan(), model=replace(_plan().model, moe_dispatcher="deepep"))
    args_file = tmp_path / "args.txt"
    args_file.write_text(export_plan(deepep, "megatron").text)
    code, out, _ = run_cli("estimate", "--from", str(args_file), "--cluster", "h100-sxm", "--seq", "1024",
                           "--engine", "megatron", "--json")
    from_deepep = json.loads(out)["step_time_s"]
    code2, out2, _ = run_cli("estimate", "--from", str(args_file), "--cluster", "h100-sxm", "--seq", "1024",
                             "--engine", "megatron", "--moe-dispatcher", "alltoall", "--json")
    assert code == code2 == 0 and from_deepep < json.loads(out2)["step_time_s"]


def test_a_plan_under_another_dispatcher_is_planned_not_executed(run_cli, tmp_path):
    from meshplan.executor.checks import check_plan_runnable
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.costing.executable import dispatcher_problem

    plan = _plan()
    assert dispatcher_problem(plan.config, "alltoall") is None
    assert dispatcher_problem(_plan(ep=1).config, "deepep") is None  # no EP: no exchange to run otherwise
    assert "re-plan with --moe-dispatcher alltoall" in dispatcher_problem(plan.config, "deepep")
    deepep = replace(plan, model=replace(plan.model, moe_dispatcher="deepep"))
    with pytest.raises(MeshplanError, match="the deepep token dispatcher is planned, not executed"):
        check_plan_runnable(deepep, 32)
    # plan --like Megatron-LM arguments that run the allgather dispatcher: every candidate priced under it
    allgather = uniform_plan_of(8, dp=8, ep=8)
    args_file, out_file = tmp_path / "args.txt", tmp_path / "plan.json"
    args_file.write_text(export_plan(replace(allgather, model=replace(allgather.model, moe_dispatcher="allgather")),
                                     "megatron").text)
    code, _, err = run_cli("plan", "--model", SPEC, "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq",
                           "512", "--like", str(args_file), "--time-limit", "2", "--out", str(out_file), "--json")
    assert code == 0, err
    data = json.loads(out_file.read_text())
    assert data["model"]["moe_dispatcher"] == "allgather" and data["mesh"]["ep"] == 8
    assert data["executable"] is False and "allgather token dispatcher" in data["not_executable_reason"]


def test_the_group_limit_comes_from_the_hf_config_and_is_checked():
    from types import SimpleNamespace

    from meshplan.planner.models.hf import _router_groups

    assert _router_groups(SimpleNamespace(n_group=8, topk_group=4)) == dict(moe_router_groups=8, moe_router_group_topk=4)
    assert _router_groups(SimpleNamespace(n_group=1, topk_group=1)) == {}  # DeepSeek-V2-Lite: no limit
    assert _router_groups(SimpleNamespace()) == {}
    with pytest.raises(ValueError, match="8 groups, top-9"):
        ModelInfo(family="moe", num_layers=1, hidden=8, num_heads=1, num_kv_heads=1, ffn=8, vocab=8,
                  moe_router_groups=8, moe_router_group_topk=9)
