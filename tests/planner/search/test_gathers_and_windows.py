"""The prefetched-gather rule and the reduction windows the ILP and the closed form read, against
the event engine they stand in for.

- A chunk pass of identical layers: per-layer steady exposure plus one head per pass is exactly
  the engine's recurrence (`step_costs.pass_end_times`), whichever of gather and compute is longer.
- A pass [other, run x n, other]: with the change beside each other layer
  (`pass_gather_exposure_s`), also exact; and the cost table folds that change into the pinned
  embedding and head, so the ILP's evaluated chunk time equals the engine's chunk duration.
- Reduction windows: without pipelining F B F B ... gives (1, 0) and (m, m - 1); on a pipeline
  the rows give, for balanced unit chunks, exactly the exposure of the engine's own reduction queue.
"""
from __future__ import annotations

import random

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.gathers import after_other_gather_s, gather_exposure_s
from meshplan.planner.costing.layer_cost import LayerCost
from meshplan.planner.search.ilp.evaluation import exposed_dp_s, pass_gather_s, reduction_windows
from meshplan.planner.search.ilp.formulation import PipelineShape
from meshplan.planner.simulation.event_engine import _play, _rank_tails
from meshplan.planner.simulation.step_costs import StepCosts, build_chunks, pass_end_times


def pass_gather_exposure_s(gather_s, busy_s) -> float:
    """The rules composed over one pass of a chunk's layers (pass order): every layer's steady
    share, the first layer's head, and where a layer follows another kind, what hiding behind
    that layer changes; held below against the engine's recurrence."""
    exposed = 0.0
    for i, (gather, busy) in enumerate(zip(gather_s, busy_s)):
        steady, head = gather_exposure_s(gather, busy)
        exposed += steady + (head if i == 0 else after_other_gather_s(gather, busy, busy_s[i - 1]))
    return exposed

REL = 1e-9  # sums of a few dozen durations


@pytest.mark.parametrize("busy, gather", [(2.0, 0.5), (1.0, 3.0), (1.0, 1.0), (0.7, 0.0)])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_identical_layers_steady_plus_one_head_is_the_engine(busy, gather, n):
    steady, head = gather_exposure_s(gather, busy)
    assert n * (busy + steady) + head == pytest.approx(pass_end_times([busy] * n, [gather] * n)[-1], rel=REL)


def test_a_run_between_two_other_layers_is_exact():
    rng = random.Random(7)
    for _ in range(300):
        run_busy, run_gather = rng.uniform(0.1, 2.0), rng.uniform(0.0, 2.0)
        first, last = (rng.uniform(0.01, 3.0), rng.uniform(0.0, 3.0)), (rng.uniform(0.01, 3.0), rng.uniform(0.0, 3.0))
        n = rng.randint(1, 6)
        busy = [first[0]] + [run_busy] * n + [last[0]]
        gathers = [first[1]] + [run_gather] * n + [last[1]]
        rule = sum(busy) + pass_gather_exposure_s(gathers, busy)
        assert rule == pytest.approx(pass_end_times(busy, gathers)[-1], rel=REL)


def _solved_zero3(spec, seq, pins_kwargs, gpus, global_batch):
    from meshplan.planner.profiling.profiler import profile
    from meshplan.planner.search.candidates import Pins, enumerate_candidates
    from meshplan.planner.search.ilp.formulation import solve_stages
    from meshplan.planner.search.problems import build_problems
    from meshplan.planner.simulation.simulator import step_costs

    cluster, graph = load_cluster("h100-sxm"), profile(spec, seq)
    pins = Pins(**pins_kwargs)
    candidate = enumerate_candidates(graph, cluster, gpus, global_batch, pins, 16, "bf16-mixed")[0]
    (pending,) = build_problems(graph, cluster, [candidate], global_batch, "bf16-mixed", pins, 1e18, False, 10.0)[0]
    problem = pending.exact_problem()
    solution = solve_stages(problem)
    recompute = tuple(problem.table.option(layer, index).recompute
                      for layer, index in enumerate(solution.option_of_layer))
    costs = step_costs(graph, cluster, candidate, chunk_of_layer=solution.chunk_of_layer, recompute_of_layer=recompute)
    return problem, solution, build_chunks(costs)


@pytest.mark.timeout(300)
def test_ilp_chunk_times_are_the_engines_chunk_durations_under_zero3():
    """Every chunk of an interleaved ZeRO-3 llama3-70b plan, the embedding's and the head's
    included: the ILP's chunk time (steady shares, heads, the pinned layers' folded change) equals
    the engine's played duration. 1e-6: the two sum the same figures in another order."""
    problem, solution, chunks = _solved_zero3("llama3-70b", 8192, dict(tp=8, pp=4, schedule="interleaved", vpp=2,
                                                                       zero=3, mbs=1, dp=16, sp=False), 512, 512)
    heads = pass_gather_s(problem.table, solution.chunk_of_layer, solution.option_of_layer, len(chunks))
    assert any(h > 0 for h in heads[0]) and any(h > 0 for h in heads[1])  # the rule is exercised
    overhead = problem.table.chunk_overhead_s
    for c, chunk in enumerate(chunks):
        assert solution.chunk_time_s[c] - overhead == pytest.approx(chunk.fwd_s + chunk.bwd_s, rel=1e-6), c


def test_no_pipelining_windows_are_the_first_and_last_backward():
    shape = PipelineShape(1, 8)
    assert reduction_windows(shape, 0) == ((1.0, 0.0, 0.0), (8.0, 7.0, 0.0))


@pytest.mark.parametrize("schedule, pp, num_mb, vpp", [("1f1b", 4, 8, 1), ("1f1b", 8, 32, 1),
                                                       ("interleaved", 4, 8, 2), ("interleaved", 4, 16, 4),
                                                       ("gpipe", 4, 8, 1)])
@pytest.mark.parametrize("reduce_over_bwd", [0.5, 1.2, 1.6, 3.0])
def test_windows_give_the_engines_exposure_on_balanced_chunks(schedule, pp, num_mb, vpp, reduce_over_bwd):
    """Balanced chunks of 8 layers (a chunk: forward 1, backward 2), a reduction of
    `reduce_over_bwd` backwards after every micro-batch's backward, no transfers: each rank's
    reduction ends past its compute end by what its window rows say. The rows release a window's
    reductions when its first backward starts; the engine releases each layer's when that layer's
    backward ends, so it may end up to one layer's backward (0.25) later, never earlier."""
    cfg = ParallelConfig(gpus=pp, global_batch=num_mb, pp=pp, schedule=schedule, virtual_stages=vpp, zero=3)
    num_chunks, per_chunk = pp * vpp, 8
    unit = LayerCost(fwd_compute_s=1.0 / per_chunk, bwd_compute_s=2.0 / per_chunk, recompute_s=0.0,
                     tp_fwd_comm_s=0.0, tp_bwd_comm_s=0.0, fwd_gather_s=0.0, bwd_gather_s=0.0,
                     dp_grad_comm_s=2.0 * reduce_over_bwd / per_chunk, dp_param_gather_s=0.0, optimizer_step_s=0.0,
                     param_bytes=0.0, grad_bytes=1e12, optimizer_bytes=0.0,  # a bucket per layer
                     activation_bytes=0.0, buffer_bytes=0.0, output_bytes=0.0)
    costs = StepCosts(config=cfg, layer_costs=(unit,) * (num_chunks * per_chunk),
                      chunk_of_layer=tuple(i // per_chunk for i in range(num_chunks * per_chunk)),
                      grad_sync="overlap_every_microbatch")
    chunks = build_chunks(costs)
    played = _play(costs, chunks)
    shape = PipelineShape(pp, num_mb, vpp, schedule)
    for rank, tail in enumerate(_rank_tails(costs, chunks, played)):
        # whole-rank figures: v chunks of forward 1, backward 2, reduction 2 reduce_over_bwd
        rows = max(0.0, exposed_dp_s("overlap_every_microbatch", vpp * 2.0 * reduce_over_bwd, 0.0, vpp * 1.0,
                                     vpp * 2.0, reduction_windows(shape, rank)))
        assert 1 <= len(reduction_windows(shape, rank)) <= 7  # the rows per rank the README states
        engine = max(0.0, tail.dp_end_s - tail.compute_end_s)
        assert rows - 1e-9 <= engine <= rows + 2.0 / per_chunk + 1e-9, (rank, rows, engine)


def test_step_factor_and_windows_share_one_play(monkeypatch):
    """A shape's step factor and reduction windows read one play of the schedule; a schedule
    without a split backward plays alike at every W share, so its factor does not depend on it,
    while a zero-bubble schedule's does and gets its own play."""
    from meshplan.planner.simulation import factors

    plays = []
    real = factors._unit_play
    monkeypatch.setattr(factors, "_unit_play", lambda *args: plays.append(args) or real(*args))
    for cached in (factors._recorded_play, factors.step_factor, factors.reduction_windows):
        cached.cache_clear()
    one_f_one_b = factors.step_factor("1f1b", 4, 8, 1, 2.0, 0.3)
    factors.reduction_windows("1f1b", 4, 8, 1, 2.0)
    assert len(plays) == 1 and factors.step_factor("1f1b", 4, 8, 1, 2.0, 0.7) == one_f_one_b == 11.0
    zero_bubble = factors.step_factor("zb-interleaved", 4, 8, 2, 2.0, 0.3)
    factors.reduction_windows("zb-interleaved", 4, 8, 2, 2.0)
    assert len(plays) == 3 and zero_bubble != factors.step_factor("zb-interleaved", 4, 8, 2, 2.0, 0.5)
    assert len(plays) == 3  # the windows' play at W share 0.5 serves the factor there too
