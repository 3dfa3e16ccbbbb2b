"""Megatron-Core's combined 1F1B (`costing.moe_overlap`, `--moe-a2a-overlap`): its warm-up counts
against Megatron-Core's own formula, the paired layer's critical path on hand-worked timings,
the hidden share at its limits, what the engines refuse, the cost a MoE block carries, and the
flag's way through the plan file and Megatron-LM's arguments."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import expert_parallel
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.moe_overlap import (compute_slowdown, hidden_a2a_share, paired_layer_s, paired_share,
                                                  warmup_passes)
from meshplan.planner.engines.bridge import export_plan, read_engine_text
from meshplan.planner.profiling.profiler import profile

from tests.planner.engines.helpers import MOE_SPEC, make_plan


@pytest.mark.parametrize("pp,v,m", [(1, 1, 8), (4, 2, 8), (4, 3, 4), (8, 4, 128), (2, 2, 1)])
def test_warmup_is_megatron_core_s_count_plus_the_overlap_s_one(pp, v, m):
    """schedules.py: (p - r - 1) * 2 + (v - 1) * p micro-batch chunks, capped at all m v of them,
    plus one for the overlap (never more than there are); without pipelining the first forward."""
    for rank in range(pp):
        expected = 1 if pp == 1 else min(min((pp - rank - 1) * 2 + (v - 1) * pp, m * v) + 1, m * v)
        assert warmup_passes(pp, v, m, rank) == expected
    total = m * v
    assert paired_share(pp, v, m) == pytest.approx(
        sum(total - warmup_passes(pp, v, m, r) for r in range(pp)) / (pp * total))


def test_paired_layer_on_hand_worked_timings():
    # attention F 1, experts F 2, attention B 2, experts B 4 (ms); all-to-alls 1 a pass (0.5 each)
    # compute: F.attn 0-1, B.expert 1-5, F.expert 5-7, B.attn 7-9; comm: B.combine 0-0.5,
    # F.dispatch 1-1.5, B.dispatch 5-5.5, F.combine 7-7.5: every transfer under compute
    assert paired_layer_s(1, 2, 2, 4, 1, 1) == pytest.approx(9)
    # all-to-alls of 10 a pass: B.combine 0-5, F.dispatch 5-10, B.expert 5-9, B.dispatch 10-15,
    # F.expert 10-12, F.combine 15-20, B.attn 15-17 (after B.dispatch)
    assert paired_layer_s(1, 2, 2, 4, 10, 10) == pytest.approx(20)
    assert paired_layer_s(1, 2, 2, 4, 0, 0) == pytest.approx(9)  # nothing to wait for: compute alone


def test_hidden_share_at_its_limits():
    assert hidden_a2a_share(1, 2, 2, 4, 1, 1, share=1.0) == pytest.approx(1.0)  # all paired, all hidden
    assert hidden_a2a_share(1, 2, 2, 4, 1, 1, share=0.0) == pytest.approx(0.0)  # nothing paired
    # paired, the 20 ms path over 9 ms of compute exposes 11 of the 20 ms of transfers
    assert hidden_a2a_share(1, 2, 2, 4, 10, 10, share=1.0) == pytest.approx(9 / 20)
    # compute a quarter slower beside the transfers (a dispatcher holding a fifth of the SMs) stretches
    # the 2 ms it runs beside them by 0.5 ms: exposed
    assert hidden_a2a_share(1, 2, 2, 4, 1, 1, share=1.0, slowdown=0.25) == pytest.approx(1 - 0.5 / 2)
    assert hidden_a2a_share(1, 2, 2, 4, 0, 0, share=1.0) == 0.0
    with pytest.raises(ValueError, match="slowdown"):
        hidden_a2a_share(1, 2, 2, 4, 1, 1, share=1.0, slowdown=-0.1)


def test_compute_beside_each_dispatcher():
    """DeepEP holds its 20 SMs: on H100's 132 the compute beside it takes 132/112 as long; NCCL's
    all-to-all is charged the measured 18.9% (Lee et al. 2025); no SMs (CPU), no slowdown."""
    assert compute_slowdown("deepep", 132) == pytest.approx(20 / 112)
    assert compute_slowdown("alltoall", 132) == pytest.approx(0.189)
    assert compute_slowdown("alltoall", 0) == 0.0
    with pytest.raises(ValueError, match="leave none"):
        compute_slowdown("deepep", 20)


def _config(**changes) -> ParallelConfig:
    base = dict(gpus=8, global_batch=32, tp=1, pp=2, dp=4, ep=4, virtual_stages=2, schedule="interleaved",
                microbatch_size=1, zero=1, engine="megatron", moe_a2a_overlap=True)
    return ParallelConfig(**{**base, **changes})


@pytest.mark.parametrize("changes,message", [
    (dict(engine="meshplan"), "no combined 1F1B"),
    (dict(virtual_stages=1, schedule="1f1b"), "needs virtual stages > 1"),
])
def test_refused_where_megatron_has_no_such_schedule(changes, message):
    with pytest.raises(ValueError, match=message):
        _config(**changes)
    _config(pp=1, dp=8, virtual_stages=1, schedule="1f1b")  # no pipelining: plain 1F1B pairs
    assert _config(ep=1).moe_a2a_overlap is False  # nothing to hide: stored off, as equal layouts compare


def test_a_moe_block_carries_the_unhidden_share_of_its_all_to_alls():
    """With expert TP 1 the block's EP time is its all-to-alls alone: with the overlap it is that
    times 1 - the hidden share `combined_1f1b_share` derives from the block's own times."""
    cluster = load_cluster("h100-sxm")
    graph = profile(MOE_SPEC, 256)
    block = next(layer for layer in graph.layers if layer.expert_params)
    on, off = _config(), _config(moe_a2a_overlap=False)
    cost_on, cost_off = layer_cost(block, on, cluster, graph.info), layer_cost(block, off, cluster, graph.info)
    dense = expert_parallel.dense_part(block, graph.info)
    hidden = expert_parallel.combined_1f1b_share(layer_cost(dense, on, cluster, graph.info), block, on, cluster,
                                                 graph.info, None, None)
    assert 0 < hidden < 1
    assert cost_on.ep_fwd_comm_s == pytest.approx(cost_off.ep_fwd_comm_s * (1 - hidden), rel=1e-9)
    assert cost_on.ep_bwd_comm_s == pytest.approx(cost_off.ep_bwd_comm_s * (1 - hidden), rel=1e-9)
    assert cost_on.fwd_compute_s == cost_off.fwd_compute_s  # compute is what it was
    memo: dict = {}  # the experts' compute is priced once for both: only their exchange differs
    assert layer_cost(block, on, cluster, graph.info, memo=memo) == cost_on
    assert layer_cost(block, off, cluster, graph.info, memo=memo) == cost_off
    assert sum(key[0] == "expert_times" for key in memo) == 1
    assert sum(key[0] == "expert_exchange" for key in memo) == 2


def test_the_flag_travels_through_the_plan_file_and_megatron_s_arguments():
    from meshplan.planner.contracts.plan import plan_from_json

    base = make_plan(zero=1, pp=1, dp=4, tp=1, sp=False, ep=2, spec=MOE_SPEC)
    plan = replace(base, config=replace(base.config, engine="megatron", moe_a2a_overlap=True))
    data = plan.to_json()
    assert data["moe_a2a_overlap"] is True and "moe_a2a_overlap" not in base.to_json()
    assert plan_from_json(data).config.moe_a2a_overlap is True
    assert plan.digest != replace(plan, config=replace(plan.config, moe_a2a_overlap=False)).digest
    exported = export_plan(plan, "megatron")
    assert "--overlap-moe-expert-parallel-comm" in exported.text
    assert read_engine_text(exported.text, "megatron").moe_a2a_overlap is True
    plain = export_plan(replace(plan, config=replace(plan.config, moe_a2a_overlap=False)), "megatron")
    assert "--overlap-moe-expert-parallel-comm" not in plain.text


def test_megatron_refuses_a_mixture_of_experts_under_tp_without_sp():
    """Megatron-LM asserts SP with TP for a mixture of experts (Megatron-Core's TransformerConfig
    refuses ep > 1 with tp > 1 without it): the config refuses it with EP, `estimate` for any MoE
    model, and the other engines keep their choice."""
    from meshplan.planner.contracts.config import moe_sp_problem
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.simulation.estimator import make_config

    assert "add --sp" in moe_sp_problem("megatron", 2, False, True)
    assert moe_sp_problem("megatron", 2, True, True) is None and moe_sp_problem("megatron", 1, False, True) is None
    assert moe_sp_problem("megatron", 2, False, False) is None and moe_sp_problem("torchtitan", 2, False, True) is None
    with pytest.raises(ValueError, match="only with sequence parallelism"):
        _config(tp=2, dp=2, ep=2, sp=False)
    assert _config(tp=2, dp=2, ep=2, sp=True).sp
    graph = profile(MOE_SPEC, 256)
    with pytest.raises(MeshplanError, match="add --sp"):  # ep 1: the model, not the mesh, makes it a MoE
        make_config(graph, load_cluster("h100-sxm"), gpus=8, global_batch=32, tp=2, engine="megatron")
    make_config(graph, load_cluster("h100-sxm"), gpus=8, global_batch=32, tp=2, sp=True, engine="megatron")
