"""The MoE capacity factor in the cost model, the plan file, the search and the CLI.

Rules (planner.costing.expert_parallel): with capacity C each expert takes at most C T k / E
copies; the busiest rank's load factor is min(F, C) (F = --moe-imbalance), or C when expert
inputs are padded to capacity; the busiest expert drops 1 - C/F of its copies when F > C, at
least (F - C) / E of all routed copies in a step. Each is checked against its formula.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from meshplan.planner.contracts.plan import ModelRef, plan_from_json
from meshplan.planner.costing import expert_parallel as epm
from meshplan.planner.costing.collectives import collective_time_s
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.models.config import check_capacity
# the small MoE model and its profile, shared with the EP cost tests
from tests.planner.costing.meshes import EXPERTS, HIDDEN, SEQ, TOP_K, expert_block, mesh, small_moe_graph
from tests.planner.costing.meshes import SMALL_MOE as SPEC

H100 = load_cluster("h100-sxm")


@pytest.fixture(scope="module")
def graph():
    return small_moe_graph()


def _info(graph, imbalance, capacity, pad=False):
    return replace(graph.info, moe_imbalance=imbalance, moe_capacity_factor=capacity, moe_pad_to_capacity=pad)


def _cost(graph, info, **kwargs):
    return layer_cost(expert_block(graph), mesh(**kwargs), H100, info, profile_dtype="bf16")


@pytest.mark.parametrize("imbalance,capacity,pad,load,dropped", [
    (1.5, 0.0, False, 1.5, 0.0),       # no capacity: F, nothing dropped
    (1.5, 1.25, False, 1.25, 1 - 1.25 / 1.5),  # min(F, C), 1 - C/F dropped
    (1.2, 2.0, False, 1.2, 0.0),       # capacity above the load: nothing dropped
    (1.5, 1.25, True, 1.25, 1 - 1.25 / 1.5),   # padded: C
    (1.2, 2.0, True, 2.0, 0.0),        # padded above the load: the padding rows cost as real ones
])
def test_load_factor_and_dropped_share(graph, imbalance, capacity, pad, load, dropped):
    info = _info(graph, imbalance, capacity, pad)
    assert epm.load_factor(info) == pytest.approx(load)
    assert epm.dropped_share(info) == pytest.approx(dropped)
    assert epm.dropped_share_lower_bound(info) == pytest.approx(max(0.0, imbalance - capacity) / EXPERTS
                                                                if capacity else 0.0)


def test_all_to_all_bytes_with_and_without_padding(graph):
    send = 2 * SEQ * TOP_K * HIDDEN * 2  # mbs 2, bf16
    for pad, load in ((False, 1.25), (True, 1.25)):
        cost = _cost(graph, _info(graph, 1.5, 1.25, pad), dp=8, ep=4, microbatch_size=2)
        assert cost.ep_fwd_comm_s == pytest.approx(2 * collective_time_s("all_to_all", load * send, 4, H100, 1))
    # capacity 2 with the busiest expert at 1.2: 1.2 D without padding, 2 D padded
    unpadded = _cost(graph, _info(graph, 1.2, 2.0), dp=8, ep=4, microbatch_size=2)
    padded = _cost(graph, _info(graph, 1.2, 2.0, True), dp=8, ep=4, microbatch_size=2)
    assert unpadded.ep_fwd_comm_s == pytest.approx(2 * collective_time_s("all_to_all", 1.2 * send, 4, H100, 1))
    assert padded.ep_fwd_comm_s == pytest.approx(2 * collective_time_s("all_to_all", 2.0 * send, 4, H100, 1))
    assert padded.expert_fwd_s > unpadded.expert_fwd_s
    # capping at C costs less than the uncapped imbalance
    capped = _cost(graph, _info(graph, 1.5, 1.25), dp=8, ep=4, microbatch_size=2)
    uncapped = _cost(graph, _info(graph, 1.5, 0.0), dp=8, ep=4, microbatch_size=2)
    assert capped.expert_fwd_s < uncapped.expert_fwd_s and capped.ep_fwd_comm_s < uncapped.ep_fwd_comm_s


def test_capacity_is_validated():
    for bad in (-1.0, float("inf"), True):
        with pytest.raises(ValueError, match="capacity factor"):
            check_capacity(bad)
    with pytest.raises(ValueError, match="needs a capacity factor"):
        check_capacity(None, pad=True)
    check_capacity(None)
    check_capacity(1.25, pad=True)


def test_plan_json_records_the_capacity_only_when_set(graph):
    from meshplan.executor.plans import uniform_plan

    plan = uniform_plan(SPEC, SEQ, 8, H100, dp=8, ep=4, precision="bf16-mixed")
    data = plan.to_json()
    assert "moe_capacity_factor" not in data["model"]  # older plans: no such field, and they load
    assert plan_from_json(json.loads(json.dumps(data))).model.moe_capacity_factor == 0.0
    moe = replace(plan, model=ModelRef(spec=SPEC, seq=SEQ, moe_capacity_factor=1.25, moe_pad_to_capacity=True))
    loaded = plan_from_json(json.loads(json.dumps(moe.to_json())))
    assert (loaded.model.moe_capacity_factor, loaded.model.moe_pad_to_capacity) == (1.25, True)
    with pytest.raises(ValueError, match="needs a model.moe_capacity_factor"):
        ModelRef(spec=SPEC, seq=SEQ, moe_pad_to_capacity=True)


def test_estimate_cli_prints_the_dropped_share_and_rejects_bad_capacities(run_cli):
    base = ("estimate", "--model", SPEC, "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8", "--seq", "1024",
            "--ep", "4", "--json")
    code, out, err = run_cli(*base, "--moe-imbalance", "1.5", "--moe-capacity-factor", "1.25")
    assert code == 0 and "dropped: 16.7%" in err
    capped = json.loads(out)["step_time_s"]
    code, out, _ = run_cli(*base, "--moe-imbalance", "1.5")
    assert code == 0 and json.loads(out)["step_time_s"] > capped
    for argv, match in ((("--moe-capacity-factor", "0"), "> 0"), (("--moe-capacity-factor", "-1"), "> 0"),
                        (("--moe-pad-expert-input-to-capacity",), "needs --moe-capacity-factor")):
        code, _, err = run_cli(*base, *argv)
        assert code == 2 and match in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("estimate", "--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8",
                           "--moe-capacity-factor", "1.25")
    assert code == 2 and "needs a mixture-of-experts model" in err


def test_plan_cli_records_the_capacity_factor(run_cli, tmp_path):
    out_file = tmp_path / "plan.json"
    code, _, _ = run_cli("plan", "--model", SPEC, "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq",
                         "1024", "--moe-imbalance", "1.3", "--moe-capacity-factor", "1.1", "--time-limit", "2",
                         "--out", str(out_file), "--json")
    assert code == 0
    model = json.loads(out_file.read_text())["model"]
    assert model["moe_capacity_factor"] == 1.1 and "moe_pad_to_capacity" not in model


@pytest.mark.timeout(600)
def test_ilp_objective_equals_the_simulator_with_a_capacity_factor(monkeypatch):
    """The moe-ep-1f1b case of test_ilp_vs_simulator, skewed and capped: the search (the ILP and its
    exact re-scoring) reads the same load factor the simulator does."""
    from meshplan.planner.profiling.profiler import profile
    from tests.planner.search import test_ilp_vs_simulator as agreement

    spec, seq, cluster, gpus, global_batch, pins, sample = agreement.CASES["moe-ep-1f1b"]
    graph = profile(spec, seq, moe_imbalance=1.5, moe_capacity_factor=1.2)
    monkeypatch.setattr(agreement, "profile", lambda *args, **kwargs: graph)
    checked = 0
    for candidate, _, _, solution, predicted in agreement._refined(spec, seq, cluster, gpus, global_batch, pins,
                                                                   sample):
        assert solution.objective_s == pytest.approx(predicted.step_time_s, rel=agreement.TIME_TOL), candidate.label()
        for ilp_bytes, simulated in zip(solution.rank_mem_bytes, predicted.memory):
            assert ilp_bytes == pytest.approx(simulated.total, rel=agreement.MEMORY_TOL), candidate.label()
        checked += 1
    assert checked >= 2


def test_simulate_profiles_with_the_plans_capacity_factor():
    """A plan recording padding to capacity 2 is simulated at 2x the balanced expert work."""
    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.simulation.simulator import simulate

    plan = uniform_plan(SPEC, SEQ, 8, H100, dp=8, ep=4, precision="bf16-mixed")
    padded = replace(plan, model=replace(plan.model, moe_capacity_factor=2.0, moe_pad_to_capacity=True))
    capped = replace(plan, model=replace(plan.model, moe_capacity_factor=2.0))  # balanced: min(1, 2) = 1
    base_s = simulate(plan, timeline=False).step_time_s
    assert simulate(capped, timeline=False).step_time_s == pytest.approx(base_s)
    assert simulate(padded, timeline=False).step_time_s > base_s
