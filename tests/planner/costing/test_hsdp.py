"""HSDP (ZeRO sharded over a shard group, replicated across groups): memory, communication,
configuration, plan files and the search.

Memory and communication are checked against the formulas written out here; the search check
uses a cluster whose inter-node fabric is slow, where keeping the parameter gathers inside a node
must win over sharding across nodes.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.plan import plan_from_json
from meshplan.planner.costing.collectives import collective_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from tests.planner.costing.meshes import mesh
from meshplan.planner.costing.state_memory import executor_state_bytes, paper_state_bytes
from meshplan.planner.search.candidates import Pins, shard_groups

P = 1_000_000.0


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hsdp_state_bytes_divide_by_the_shard_group_not_dp(zero):
    dp, group = 16, 4
    paper = paper_state_bytes(P, dp, zero, "bf16-mixed", shard=group)
    # Rajbhandari et al.'s 2 + 2 + 12 bytes, each sharded from its stage on, over the group only
    assert paper["optimizer"] == 12 * P / group
    assert paper["grads"] == 2 * P / (group if zero >= 2 else 1)
    assert paper["params"] == 2 * P / (group if zero >= 3 else 1)
    executor = executor_state_bytes(P, dp, zero, "bf16-mixed", shard=group)
    # FSDP2: fp32 shards (4/N), fp32 gradients (4/N; ZeRO-1 accumulates them whole), moments 8/N,
    # plus the bf16 unsharded copy ZeRO-1/2 keep during the step
    assert executor["params"] == P * (4 / group + (2 if zero <= 2 else 0))
    assert executor["grads"] == P * (4 if zero == 1 else 4 / group)
    assert executor["optimizer"] == 8 * P / group
    assert executor_state_bytes(P, dp, zero, "bf16-mixed", shard=dp) == executor_state_bytes(P, dp, zero, "bf16-mixed")


def test_hsdp_gradient_sync_is_a_shard_reduce_scatter_plus_a_replica_all_reduce():
    from meshplan.planner.profiling.profiler import profile

    cluster = load_cluster("h100-sxm")
    graph = profile("llama:layers=2,hidden=1024,heads=8,kv_heads=8,ffn=4096,vocab=1024", 512, dtype="bf16",
                    cache=False)
    block = graph.layer("blocks.0")
    dp, tp, group = 32, 2, 4  # shard groups of 4 ranks x tp 2 = one node; 8 replicas across nodes
    hsdp = layer_cost(block, mesh(tp=tp, dp=dp, zero=3, shard_group=group), cluster, graph.info,
                      profile_dtype="bf16")
    params = block.num_params / tp
    grad_bytes = 4 * params  # the executor reduces fp32 gradients
    expected = (collective_time_s("reduce_scatter", grad_bytes, group, cluster, tp)
                + collective_time_s("all_reduce", grad_bytes / group, dp // group, cluster, tp * group))
    assert hsdp.dp_grad_comm_s == pytest.approx(expected, rel=1e-12)
    gather = collective_time_s("all_gather", 2 * params, group, cluster, tp)  # bf16, inside the group
    assert hsdp.fwd_gather_s == pytest.approx(gather, rel=1e-12)
    assert hsdp.bwd_gather_s == pytest.approx(gather, rel=1e-12)
    flat = layer_cost(block, mesh(tp=tp, dp=dp, zero=3), cluster, graph.info, profile_dtype="bf16")
    assert flat.fwd_gather_s == pytest.approx(collective_time_s("all_gather", 2 * params, dp, cluster, tp))
    # HSDP keeps more state: 16/N bytes per parameter against 16/dp
    assert hsdp.param_bytes + hsdp.grad_bytes + hsdp.optimizer_bytes == pytest.approx(16 * params / group)
    assert flat.param_bytes + flat.grad_bytes + flat.optimizer_bytes == pytest.approx(16 * params / dp)


@pytest.mark.parametrize("kwargs,message", [
    (dict(zero=0, shard_group=2), "needs --zero 1, 2 or 3"),
    (dict(zero=3, shard_group=3), "must divide dp=8"),
    (dict(zero=3, shard_group=1), "must divide dp=8 and be > 1"),
])
def test_bad_shard_groups_are_refused_with_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(gpus=8, global_batch=8, dp=8, **kwargs)


def test_shard_group_options_are_whole_nodes_and_honour_pins():
    assert shard_groups(64, 1, 3, 8, None) == [None, 8, 16, 32]
    assert shard_groups(64, 2, 3, 8, None) == [None, 4, 8, 16]
    assert shard_groups(8, 1, 3, 8, None) == [None]  # one node: plain ZeRO already shards inside it
    assert shard_groups(64, 1, 0, 8, None) == [None]  # ZeRO-0 has nothing to shard
    assert shard_groups(64, 1, 3, 8, 4) == [4]
    assert shard_groups(64, 1, 3, 8, 64) == [None]
    with pytest.raises(Exception, match="pin --zero 1, 2 or 3"):
        Pins(zero=0, shard_group=8)


def test_plan_json_round_trips_shard_group_and_old_plans_load_without_it():
    from meshplan.executor.plans import uniform_plan

    cluster = load_cluster("cpu")
    plan = uniform_plan("gpt:layers=2,hidden=32,heads=2,vocab=64", 16, 8, cluster, dp=4, zero=3, shard_group=2,
                        microbatch_size=2)
    data = plan.to_json()
    assert data["shard_group"] == 2
    assert plan_from_json(data).config.shard_group == 2
    old = dict(data)
    del old["shard_group"]
    assert plan_from_json(old).config.shard_group is None
    assert plan_from_json(old).digest != plan.digest  # what runs differs, so does the digest


def test_the_search_picks_hsdp_where_cross_node_gathers_are_slow():
    """With one slow NIC per node (a 50 Gb/s-class fabric), ZeRO-3 over 8 nodes pays two
    parameter all-gathers per micro-batch across nodes; HSDP over one node keeps them on NVLink
    and sends only 1/8 of the gradient across nodes once per step. The planner must pick HSDP,
    and its step must beat plain ZeRO-3's by the simulator."""
    from meshplan.planner.search.driver import search_plan
    from meshplan.planner.simulation.estimator import estimate

    h100 = load_cluster("h100-sxm")
    slow = replace(h100, nics_per_node=1, inter_node=replace(h100.inter_node, bw_bytes_per_s=6.25e9))
    spec = "llama:layers=8,hidden=2048,heads=16,kv_heads=8,ffn=5632,vocab=32000"
    plan = search_plan(spec, slow, 64, 64, 2048, tp=1, pp=1, zero=3, mbs=1, top_k=3)
    assert plan.config.shard_group == 8
    flat = estimate(spec, slow, 64, 64, 2048, zero=3)
    assert plan.prediction["step_time_s"] < 0.9 * flat.step_time_s
