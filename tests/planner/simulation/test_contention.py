"""Fair-share contention of concurrent traffic on one link (planner.simulation.contention),
hand-worked on small steps."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.simulation.contention import link_kind
from meshplan.planner.simulation.event_engine import simulate_step
from meshplan.planner.simulation.step_costs import StepCosts
from tests.planner.simulation.test_simulate import layer

REL = 1e-9


def _dp_over_tp_step(dp_link: str) -> StepCosts:
    """One rank, one micro-batch, two layers: each layer's backward is 1.5 s of compute and 0.5 s
    of TP collectives (2 s); its gradient is its own bucket, reduced in 1 s. The forward runs
    0..1 s and the backward 1..5 s, so layer 1's bucket is reduced at 3..4 s, inside the
    backward, and layer 0's at 5..6 s, after it."""
    cfg = ParallelConfig(gpus=4, global_batch=2, tp=2, dp=2)
    costs = tuple(layer(fwd=0.5, bwd=1.5, tp_bwd_comm_s=0.5, dp_grad_comm_s=1.0, grad_bytes=1.0) for _ in range(2))
    return StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=(0, 0), grad_bucket_bytes=1.0, dp_link=dp_link)


def test_reduction_sharing_nvlink_with_tp_collectives_pays_the_overlap_half_each():
    alone = simulate_step(_dp_over_tp_step("nic"))  # the reduction leaves on a NIC: no sharing
    assert alone.step_time_s == pytest.approx(1.0 + 4.0 + 1.0, rel=REL)
    shared = simulate_step(_dp_over_tp_step("nvlink"))
    # The first bucket (3..4 s) overlaps the backward action (1..5 s, a quarter of it TP traffic)
    # for 1 s: o_tp = 0.25 s. Compute ends 0.125 s later (TP at half rate), the reduction 0.125 s
    # later too; the step ends with the reduction: 6 + 0.125.
    assert shared.step_time_s == pytest.approx(6.0 + 0.125, rel=REL)
    assert shared.breakdown["tp_comm"] == pytest.approx(alone.breakdown["tp_comm"] + 0.125, rel=REL)
    assert sum(shared.breakdown.values()) == pytest.approx(shared.step_time_s, rel=REL)


def test_reduction_sharing_a_nic_with_pipeline_transfers():
    """Two stages, two micro-batches, ZeRO-0 over dp 2 reducing after each chunk's last backward
    ("after_chunk"), transfers of 2 s: the last stage's long reduction (4.5 s) starts when its
    last backward ends and overlaps its own outgoing gradient transfer on the same NIC. The
    overlap o is read from the uncontended timeline; the step (ended by that reduction) grows
    by o/2, and not at all when the reduction leaves on another link."""
    cfg = ParallelConfig(gpus=4, global_batch=4, pp=2, dp=2)
    costs = (layer(fwd=1.0, bwd=1.0, dp_grad_comm_s=1.0, grad_bytes=1.0),
             layer(fwd=1.0, bwd=1.0, dp_grad_comm_s=4.5, grad_bytes=1.0))
    base = StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=(0, 1), p2p_time_s=(2.0,),
                     grad_sync="after_chunk")
    alone = simulate_step(base, timeline=True)
    reductions = [(i.start_s, i.end_s) for i in alone.timeline if i.rank == 1 and i.kind == "dp_comm"]
    transfers = [(i.start_s, i.end_s) for i in alone.timeline if i.rank == 1 and i.kind in ("send", "recv")]
    overlap = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in reductions for s2, e2 in transfers)
    assert overlap == pytest.approx(2.0, rel=REL)  # the last gradient leaves as the reduction starts
    assert alone.step_time_s == pytest.approx(reductions[-1][1], rel=REL)
    shared = simulate_step(replace(base, dp_link="nic", pp_link="nic"))
    assert shared.step_time_s == pytest.approx(alone.step_time_s + overlap / 2, rel=REL)
    apart = simulate_step(replace(base, dp_link="nic", pp_link="nvlink"))
    assert apart.step_time_s == pytest.approx(alone.step_time_s, rel=REL)


def test_link_kind_follows_the_node_boundary():
    assert link_kind(1, 1, 8) == ""
    assert link_kind(4, 2, 8) == "nvlink"  # ranks 0, 2, 4, 6
    assert link_kind(2, 8, 8) == "nic"  # pipeline neighbours a node apart
    assert link_kind(16, 1, 8) == "nic"


def test_overlap_by_binary_search_equals_the_pairwise_sum():
    """`_coverage` (prefix sums over the stream's disjoint intervals) gives the summed pairwise
    overlap exactly, for disjoint and for overlapping interval sets."""
    import random

    from meshplan.planner.simulation.contention import _coverage, _overlap_s

    rng = random.Random(7)
    for trial in range(200):
        t, intervals = 0.0, []
        for _ in range(rng.randint(1, 12)):
            t += rng.uniform(0.0, 2.0)
            length = rng.uniform(0.0, 3.0)
            intervals.append((t, t + length))
            t += length if trial % 5 else -rng.uniform(0.0, length)  # every 5th set overlaps
        covered = _coverage(intervals)
        for _ in range(20):
            a = rng.uniform(-1.0, t + 1.0)
            b = a + rng.uniform(0.0, 4.0)
            assert covered(a, b) == pytest.approx(sum(_overlap_s(s, e, a, b) for s, e in intervals), abs=1e-9)
