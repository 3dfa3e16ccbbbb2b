"""The step simulator against published formulas, a DAG longest path, and hand-worked cases."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import networkx as nx
import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.layer_cost import LayerCost
from meshplan.planner.simulation.schedules import schedule_actions
from meshplan.planner.simulation.event_engine import simulate_step
from meshplan.planner.simulation.step_costs import StepCosts, pass_end_times

# Float sums of a few hundred durations: relative error well under 1e-9.
REL = 1e-9


def layer(fwd=1.0, bwd=2.0, **kwargs) -> LayerCost:
    values = dict(fwd_compute_s=fwd, bwd_compute_s=bwd, recompute_s=0.0, tp_fwd_comm_s=0.0, tp_bwd_comm_s=0.0,
                  fwd_gather_s=0.0, bwd_gather_s=0.0, dp_grad_comm_s=0.0, dp_param_gather_s=0.0, optimizer_step_s=0.0,
                  param_bytes=0.0, grad_bytes=0.0, optimizer_bytes=0.0, activation_bytes=0.0,
                  buffer_bytes=0.0, output_bytes=0.0)
    values.update(kwargs)
    return LayerCost(**values)


def config(pp, num_mb, schedule="1f1b", vpp=1, dp=1, zero=0) -> ParallelConfig:
    return ParallelConfig(gpus=pp * dp, global_batch=num_mb * dp, pp=pp, dp=dp, schedule=schedule,
                          virtual_stages=vpp, zero=zero)


def uniform(cfg, layers_per_chunk=1, p2p_s=0.0, **layer_kwargs) -> StepCosts:
    num_chunks = cfg.num_model_chunks
    costs = tuple(layer(**layer_kwargs) for _ in range(num_chunks * layers_per_chunk))
    chunk_of = tuple(i // layers_per_chunk for i in range(len(costs)))
    return StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=chunk_of,
                     p2p_time_s=(p2p_s,) * (num_chunks - 1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,num_mb", [(1, 4), (2, 2), (4, 8), (4, 13), (8, 64)])
def test_balanced_pipeline_takes_m_plus_p_minus_1_stage_times(schedule, pp, num_mb):
    fwd, bwd = 1.5, 3.25
    pred = simulate_step(uniform(config(pp, num_mb, schedule), layers_per_chunk=2, fwd=fwd / 2, bwd=bwd / 2))
    assert pred.step_time_s == pytest.approx((num_mb + pp - 1) * (fwd + bwd), rel=REL)
    assert pred.bubble_fraction == pytest.approx((pp - 1) / (num_mb + pp - 1), rel=REL, abs=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_slowest_stage_sets_the_pace_and_each_rank_adds_its_own_tail(schedule):
    """Two stages, the last slower: T0 = f0 + b0 = 1/3 + 2/3, T1 = 2/3 + 4/3. Rank 1 never waits
    (T1 >= T0), so it runs from f0 to f0 + m T1, and rank 0's last backward follows: the pipeline
    is T0 + m T1 = (m - 1) max T + sum T = 9 for m = 4. Each rank's optimizer runs when its own
    compute ends: rank 0's 0.5 s after 9, rank 1's 1.0 s after 9 - b0; the step is the later."""
    cfg = config(2, 4, schedule)
    costs = (layer(fwd=1 / 3, bwd=2 / 3, optimizer_step_s=0.5), layer(fwd=2 / 3, bwd=4 / 3, optimizer_step_s=1.0))
    pred = simulate_step(StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=(0, 1), p2p_time_s=(0.0,)))
    assert pred.step_time_s == pytest.approx(max(9 + 0.5, 9 - 2 / 3 + 1.0), rel=REL)


@pytest.mark.parametrize("pp,num_mb,vpp", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 32, 2), (4, 4, 3)])
def test_interleaving_divides_the_bubble_by_v(pp, num_mb, vpp):
    fwd, bwd = 2.0, 4.0  # per rank per micro-batch, split over vpp chunks
    pred = simulate_step(uniform(config(pp, num_mb, "interleaved", vpp), fwd=fwd / vpp, bwd=bwd / vpp))
    assert pred.step_time_s == pytest.approx((num_mb + (pp - 1) / vpp) * (fwd + bwd), rel=REL)
    assert pred.bubble_fraction == pytest.approx((pp - 1) / (vpp * num_mb + pp - 1), rel=REL)


@pytest.mark.parametrize("pp,num_mb", [(4, 8), (4, 4), (6, 9)])
def test_1f1b_peak_in_flight_activations(pp, num_mb):
    act = 3.0e6
    pred = simulate_step(uniform(config(pp, num_mb), activation_bytes=act, param_bytes=10.0, buffer_bytes=7.0))
    for rank, mem in enumerate(pred.memory):
        assert mem.activations == pytest.approx(min(num_mb, pp - rank) * act, rel=REL)
        assert mem.total == pytest.approx(mem.activations + 10.0 + 7.0, rel=REL)
    # Each in-flight micro-batch also keeps its boundary output on every rank but the last (its
    # input, which its first layer saves, is among `act`); one receive buffer per boundary and
    # direction is in transit (the executor's stages free them after each backward).
    with_output = simulate_step(uniform(config(pp, num_mb), activation_bytes=act, output_bytes=5.0))
    for rank, mem in enumerate(with_output.memory):
        per_mb = act + (5.0 if rank < pp - 1 else 0.0)
        assert mem.activations == pytest.approx(min(num_mb, pp - rank) * per_mb, rel=REL)
        boundaries = (rank > 0) + (rank < pp - 1)
        assert mem.buffers == pytest.approx(boundaries * 5.0, rel=REL)
    gpipe = simulate_step(uniform(config(pp, num_mb, "gpipe"), activation_bytes=act))
    assert all(mem.activations == pytest.approx(num_mb * act) for mem in gpipe.memory)
    assert pred.peak_memory_bytes == pytest.approx(max(m.total for m in pred.memory))


def test_memory_fits_against_usable_bytes():
    base = uniform(config(2, 4), activation_bytes=100.0)  # rank 0 peaks at 2 * 100
    tight = StepCosts(**{**base.__dict__, "usable_memory_bytes": 199.0})
    loose = StepCosts(**{**base.__dict__, "usable_memory_bytes": 200.0})
    assert not simulate_step(tight).fits
    assert simulate_step(loose).fits


def test_dp_reduction_hidden_behind_backward_adds_only_last_bucket():
    # One stage, 8 layers; each layer's gradient is its own bucket (bucket size = 1 layer), and
    # its reduction (0.5 s) is shorter than one layer's backward (2 s), so every bucket but the
    # last (layer 0's, ready when the backward ends) hides behind the remaining backward.
    cfg = config(1, 4, dp=2)
    costs = tuple(layer(fwd=1.0, bwd=2.0, dp_grad_comm_s=0.5, grad_bytes=100.0) for _ in range(8))
    step = StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=(0,) * 8, grad_bucket_bytes=100.0)
    pred = simulate_step(step)
    assert pred.step_time_s == pytest.approx(4 * 8 * 3.0 + 0.5, rel=REL)
    assert pred.breakdown["dp_comm"] == pytest.approx(0.5, rel=REL)


def test_dp_reduction_slower_than_backward_queues_up():
    # Reductions (3 s) slower than a layer's backward (2 s): the dp stream is busy from the first
    # bucket's readiness on, so it ends L * 3 s after the last micro-batch's first layer is done.
    cfg = config(1, 2, dp=2)
    num_layers = 6
    costs = tuple(layer(fwd=1.0, bwd=2.0, dp_grad_comm_s=3.0, grad_bytes=1.0) for _ in range(num_layers))
    step = StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=(0,) * num_layers, grad_bucket_bytes=1.0)
    compute_end = 2 * num_layers * 3.0
    first_ready = compute_end - (num_layers - 1) * 2.0
    assert simulate_step(step).step_time_s == pytest.approx(first_ready + num_layers * 3.0, rel=REL)


def test_buckets_group_layers_by_bytes():
    # DDP (fp32, ZeRO-0, no TP or PP): 6 layers of 10 bytes with 25-byte buckets: buckets of 3, 3
    # layers (reverse order), and the whole reduction of a bucket starts when its earliest layer's
    # backward is done.
    costs = tuple(layer(fwd=0.0, bwd=1.0, dp_grad_comm_s=1.0, grad_bytes=10.0) for _ in range(6))

    def reductions(cfg):
        step = StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=(0,) * 6, grad_bucket_bytes=25.0)
        pred = simulate_step(step, timeline=True)
        return sorted((i.start_s, i.end_s) for i in pred.timeline if i.kind == "dp_comm"), pred.step_time_s

    assert reductions(replace(config(1, 1, dp=2), precision="fp32")) == ([(3.0, 6.0), (6.0, 9.0)], pytest.approx(9.0))
    # FSDP2 (bf16-mixed's replicate here) reduces each layer's gradients after its backward
    assert reductions(config(1, 1, dp=2)) == ([(float(i), i + 1.0) for i in range(1, 7)], pytest.approx(7.0))


def test_optimizer_and_zero12_param_gather_follow_the_reduction():
    cfg = config(1, 2, dp=4, zero=1)
    costs = (layer(dp_grad_comm_s=0.25, grad_bytes=1e9, optimizer_step_s=0.5, dp_param_gather_s=0.75),)
    pred = simulate_step(StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=(0,)))
    assert pred.step_time_s == pytest.approx(2 * 3.0 + 0.25 + 0.5 + 0.75, rel=REL)
    assert pred.breakdown["optimizer"] == pytest.approx(0.5)
    assert pred.breakdown["dp_comm"] == pytest.approx(1.0)


def test_zero3_prefetch_hides_all_but_the_first_gather():
    # Gathers shorter than compute: only the first layer's gather is exposed.
    assert pass_end_times([2.0] * 4, [0.5] * 4) == [2.5, 4.5, 6.5, 8.5]
    # Gathers longer than compute: the pass is gather-bound, one layer ahead: n*g + c.
    assert pass_end_times([1.0] * 4, [3.0] * 4)[-1] == pytest.approx(4 * 3.0 + 1.0)
    # No gathers: running sum.
    assert pass_end_times([1.0, 2.0, 3.0], [0.0] * 3) == [1.0, 3.0, 6.0]


def _longest_path_step(step: StepCosts) -> float:
    """Independent reference: the step is the longest path through the DAG of actions, whose edges
    are each rank's order (weight 0) and data dependencies (weight = p2p time, 0 between chunks on
    one rank). I and W take their share of the backward; W waits only for its rank's order; the
    output of the forward of an "F;B" pair leaves when the pair ends."""
    cfg = step.config
    shares = step.weight_grad_share or (0.5,) * len(step.layer_costs)
    chunk_time = {}
    for cost, chunk, share in zip(step.layer_costs, step.chunk_of_layer, shares):
        fwd, bwd, weight = chunk_time.get(chunk, (0.0, 0.0, 0.0))
        chunk_time[chunk] = (fwd + cost.fwd_compute_s + cost.tp_fwd_comm_s,
                             bwd + cost.bwd_compute_s + cost.recompute_s + cost.tp_bwd_comm_s,
                             weight + share * cost.bwd_compute_s)
    orders = schedule_actions(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
    dag = nx.DiGraph()
    output_of = {}  # (F or B, chunk, mb) -> node at which its output is available
    for order in orders:
        for prev, nxt in zip(order, order[1:]):
            dag.add_edge(("end", prev), ("start", nxt), weight=0.0)
        for index, action in enumerate(order):
            fwd, bwd, weight = chunk_time[action.chunk]
            duration = {"F": fwd, "B": bwd, "I": bwd - weight, "W": weight}[action.kind]
            dag.add_edge(("start", action), ("end", action), weight=duration)
            if action.kind != "W":
                sender = order[index + 1] if action.overlap else action
                output_of["F" if action.kind == "F" else "B", action.chunk, action.microbatch] = ("end", sender)
    for order in orders:
        for action in order:
            chunk, mb = action.chunk, action.microbatch
            producer = chunk - 1 if action.kind == "F" else chunk + 1
            if action.kind == "W" or not 0 <= producer < cfg.num_model_chunks:
                continue
            boundary = min(chunk, producer)
            link = 0.0 if cfg.rank_of_chunk(producer) == cfg.rank_of_chunk(chunk) else step.p2p_time_s[boundary]
            dag.add_edge(output_of["F" if action.kind == "F" else "B", producer, mb], ("start", action), weight=link)
    if step.grad_sync == "after_chunk":
        _add_reductions(dag, step, chunk_time)
    return nx.dag_longest_path_length(dag)


def _add_reductions(dag, step: StepCosts, chunk_time) -> None:
    """A chunk's reduction follows its last backward, runs serially on the rank's dp stream, and
    holds back the rank's next action."""
    cfg = step.config
    reduce_s = {}
    for cost, chunk in zip(step.layer_costs, step.chunk_of_layer):
        reduce_s[chunk] = reduce_s.get(chunk, 0.0) + cost.dp_grad_comm_s
    last_mb = cfg.num_microbatches - 1
    for order in schedule_actions(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages):
        previous = None
        for position, action in enumerate(order):
            if action.kind not in ("B", "W") or action.microbatch != last_mb:
                continue
            node = ("reduce", action.chunk)
            dag.add_edge(("end", action), ("rstart", node), weight=0.0)
            dag.add_edge(("rstart", node), ("rend", node), weight=reduce_s[action.chunk])
            if previous is not None:
                dag.add_edge(("rend", previous), ("rstart", node), weight=0.0)
            if position + 1 < len(order):
                dag.add_edge(("rend", node), ("start", order[position + 1]), weight=0.0)
            previous = node


@pytest.mark.parametrize("schedule,pp,num_mb,vpp", [("gpipe", 3, 5, 1), ("1f1b", 4, 6, 1), ("1f1b", 3, 3, 1),
                                                     ("interleaved", 2, 4, 2), ("interleaved", 3, 6, 2),
                                                     ("zb-interleaved", 3, 6, 2), ("zb-interleaved", 4, 5, 1),
                                                     ("zbv", 3, 7, 2), ("zbv", 4, 5, 2), ("dualpipev", 3, 8, 2),
                                                     ("dualpipev", 2, 4, 2)])
def test_uneven_stages_and_transfers_match_dag_longest_path(schedule, pp, num_mb, vpp):
    rng = random.Random(pp * 100 + num_mb)
    cfg = config(pp, num_mb, schedule, vpp)
    num_layers = cfg.num_model_chunks * 2 + 3
    costs = tuple(layer(fwd=rng.uniform(0.5, 2), bwd=rng.uniform(1, 4), tp_fwd_comm_s=rng.uniform(0, 0.2),
                        tp_bwd_comm_s=rng.uniform(0, 0.2), recompute_s=rng.uniform(0, 0.5))
                  for _ in range(num_layers))
    # Uneven cut: chunk sizes 1, 2, 3, ... then the rest in the last chunk.
    chunk_of, chunk = [], 0
    for index in range(num_layers):
        chunk_of.append(min(chunk, cfg.num_model_chunks - 1))
        if chunk < cfg.num_model_chunks - 1 and chunk_of.count(chunk) == chunk % 3 + 1:
            chunk += 1
    p2p = tuple(rng.uniform(0, 1.0) for _ in range(cfg.num_model_chunks - 1))
    step = StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=tuple(chunk_of), p2p_time_s=p2p,
                     weight_grad_share=tuple(rng.uniform(0.2, 0.6) for _ in costs))
    pred = simulate_step(step)
    assert pred.step_time_s == pytest.approx(_longest_path_step(step), rel=REL)
    # The breakdown accounts for every second of the busiest rank's step.
    assert sum(pred.breakdown.values()) == pytest.approx(pred.step_time_s, rel=REL)


def test_gpipe_transfers_add_two_hops_per_stage():
    fwd, bwd, hop = 1.0, 2.0, 0.25
    pp, num_mb = 4, 6
    pred = simulate_step(uniform(config(pp, num_mb, "gpipe"), fwd=fwd, bwd=bwd, p2p_s=hop))
    assert pred.step_time_s == pytest.approx((num_mb + pp - 1) * (fwd + bwd) + 2 * (pp - 1) * hop, rel=REL)
    assert pred.breakdown["pp_comm"] > 0


def test_timeline_and_metrics():
    cfg = config(2, 4, dp=1)
    step = StepCosts(config=cfg, layer_costs=tuple(layer(tp_fwd_comm_s=0.1, recompute_s=0.2, activation_bytes=5.0)
                                                   for _ in range(4)),
                     chunk_of_layer=(0, 0, 1, 1), p2p_time_s=(0.05,), tokens_per_step=4096.0,
                     model_flops_per_step=8e12, hw_flops_per_step=9e12, peak_flops_per_s=1e12)
    pred = simulate_step(step, timeline=True)
    assert pred.tokens_per_s == pytest.approx(4096.0 / pred.step_time_s)
    assert pred.model_tflops_per_gpu == pytest.approx(8.0 / pred.step_time_s / 2)
    assert pred.hw_tflops_per_gpu == pytest.approx(9.0 / pred.step_time_s / 2)
    assert pred.mfu == pytest.approx(pred.model_tflops_per_gpu)  # peak is 1 TFLOP/s
    forwards = [i for i in pred.timeline if i.kind == "forward"]
    assert len(forwards) == 2 * 4 and all(i.end_s - i.start_s == pytest.approx(2.0) for i in forwards)
    sends = [i for i in pred.timeline if i.kind == "send"]
    assert len(sends) == 2 * 4  # 4 activations forward, 4 gradients back
    assert {i.kind for i in pred.timeline} >= {"forward", "backward", "recompute", "tp_comm", "send", "recv"}
    # Intervals on one rank's compute stream never overlap.
    for rank in range(2):
        spans = sorted((i.start_s, i.end_s) for i in pred.timeline if i.rank == rank and i.stream == "compute")
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    assert len(pred.memory_timeline) == 2 and pred.memory_timeline[0][-1][1] == pytest.approx(0.0)
    assert max(v for _, v in pred.memory_timeline[0]) == pytest.approx(pred.memory[0].activations)


def test_bad_step_costs_are_rejected():
    cfg = config(2, 4)
    with pytest.raises(ValueError, match="chunks"):
        StepCosts(config=cfg, layer_costs=(layer(), layer()), chunk_of_layer=(0, 0))
    with pytest.raises(ValueError, match="non-decreasing"):
        StepCosts(config=cfg, layer_costs=(layer(), layer()), chunk_of_layer=(1, 0))
    with pytest.raises(ValueError, match="boundary"):
        StepCosts(config=cfg, layer_costs=(layer(), layer()), chunk_of_layer=(0, 1), p2p_time_s=(1.0, 1.0))
    assert math.isinf(StepCosts(config=cfg, layer_costs=(layer(), layer()), chunk_of_layer=(0, 1)).usable_memory_bytes)


@pytest.mark.timeout(60)
def test_random_pipelines_match_dag_longest_path():
    """Property check over random schedules, shapes and costs (30 examples, ~1 s)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=30, deadline=None, derandomize=True)
    @given(st.sampled_from(["gpipe", "1f1b", "interleaved"]), st.integers(1, 4), st.integers(1, 3),
           st.integers(1, 3), st.randoms(use_true_random=False))
    def check(schedule, pp, rounds, vpp, rng):
        if schedule != "interleaved" or pp == 1:
            schedule, vpp = ("1f1b" if schedule == "interleaved" else schedule), 1
        cfg = config(pp, pp * rounds, schedule, vpp)
        num_chunks = cfg.num_model_chunks
        costs = tuple(layer(fwd=rng.uniform(0.1, 2), bwd=rng.uniform(0.1, 4)) for _ in range(num_chunks))
        step = StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=tuple(range(num_chunks)),
                         p2p_time_s=tuple(rng.uniform(0, 1) for _ in range(num_chunks - 1)))
        pred = simulate_step(step)
        assert pred.step_time_s == pytest.approx(_longest_path_step(step), rel=REL)
        assert sum(pred.breakdown.values()) == pytest.approx(pred.step_time_s, rel=REL)
        assert 0.0 <= pred.bubble_fraction < 1.0

    check()


@pytest.mark.parametrize("schedule,pp,num_mb,vpp", [("1f1b", 2, 4, 1), ("gpipe", 3, 3, 1), ("interleaved", 2, 4, 2),
                                                     ("interleaved", 3, 6, 3)])
def test_reduction_after_each_chunk_blocks_the_rank(schedule, pp, num_mb, vpp):
    """torch pipelining with FSDP reduces a chunk's gradients after its last backward and the
    rank's next compute waits: check against the DAG with reduction nodes."""
    rng = random.Random(7 * pp + vpp)
    cfg = config(pp, num_mb, schedule, vpp, dp=2)
    num_chunks = cfg.num_model_chunks
    costs = tuple(layer(fwd=rng.uniform(0.5, 2), bwd=rng.uniform(1, 3), dp_grad_comm_s=rng.uniform(0.5, 3),
                        grad_bytes=1e9) for _ in range(num_chunks))
    step = StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=tuple(range(num_chunks)),
                     p2p_time_s=tuple(rng.uniform(0, 0.3) for _ in range(num_chunks - 1)), grad_sync="after_chunk")
    pred = simulate_step(step, timeline=True)
    assert pred.step_time_s == pytest.approx(_longest_path_step(step), rel=REL)
    assert sum(pred.breakdown.values()) == pytest.approx(pred.step_time_s, rel=REL)
    overlapped = simulate_step(StepCosts(**{**step.__dict__, "grad_sync": "overlap"}))
    assert overlapped.step_time_s <= pred.step_time_s + 1e-12
    assert len([i for i in pred.timeline if i.kind == "dp_comm"]) == num_chunks


def test_reduction_every_microbatch_queues_when_slower_than_a_microbatch():
    # One layer, one bucket: micro-batch i's reduction (4 s) is ready at i * (f + b) = 3 i s;
    # reductions longer than a micro-batch queue up, so the last ends at 3 + m * 4.
    num_mb = 5
    cfg = config(1, num_mb, dp=2, zero=2)
    costs = (layer(fwd=1.0, bwd=2.0, dp_grad_comm_s=4.0, grad_bytes=1.0),)
    step = StepCosts(config=cfg, layer_costs=costs, chunk_of_layer=(0,), grad_sync="overlap_every_microbatch")
    assert simulate_step(step).step_time_s == pytest.approx(3.0 + num_mb * 4.0, rel=REL)
    # Shorter than a micro-batch: each hides behind the next micro-batch, the last is exposed.
    short_layer = layer(fwd=1.0, bwd=2.0, dp_grad_comm_s=0.5, grad_bytes=1.0)
    short = StepCosts(**{**step.__dict__, "layer_costs": (short_layer,)})
    assert simulate_step(short).step_time_s == pytest.approx(num_mb * 3.0 + 0.5, rel=REL)


@pytest.mark.parametrize("schedule,vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_idle_intervals_are_the_bubble(schedule, vpp):
    pp, num_mb = 4, 8
    pred = simulate_step(uniform(config(pp, num_mb, schedule, vpp), fwd=1.0 / vpp, bwd=2.0 / vpp), timeline=True)
    for rank in range(pp):
        idle = sum(i.end_s - i.start_s for i in pred.timeline if i.rank == rank and i.kind == "idle")
        busy = sum(i.end_s - i.start_s for i in pred.timeline
                   if i.rank == rank and i.stream == "compute" and i.kind != "idle")
        # Balanced stages, no communication: every rank idles exactly the bubble, and its compute
        # stream is covered from 0 to the step's end.
        assert idle == pytest.approx(pred.bubble_fraction * pred.step_time_s, rel=REL)
        assert idle + busy == pytest.approx(pred.step_time_s, rel=REL)
