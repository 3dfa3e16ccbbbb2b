"""Pruning never removes a candidate the re-ranking would have seen.

Brute force solves every candidate's ILP (no cutoff, no pruning); the pruned search must then
hold the same best `num_keep` objectives, every pruned candidate's bound must be at most its
brute-force objective (or the candidate infeasible), and the plan's accounting must add up.
Each bound is exercised: the compute bound at the floor step factor, the memory-aware bound
without and with the schedule replayed, the "no assignment fits" proof, and the threshold seeded
from heuristic assignments before anything is solved (each one an upper bound on its ILP).
"""
from __future__ import annotations

import math
import random

import pytest

from dataclasses import replace

from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.tables import LayerType
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.search import bounds, reduction_bound
from meshplan.planner.search.candidates import MEMORY_MARGIN, Pins, enumerate_candidates, usable_memory_bytes
from meshplan.planner.search.driver import search_plan
from meshplan.planner.search.ilp.evaluation import leading_chunks
from meshplan.planner.search.ilp.formulation import (PipelineShape, StageProblem, compact_structure, pinned_structure,
                                                     solve_stages)
from meshplan.planner.search.problems import build_problems
from meshplan.planner.search.solving import heuristic_upper_s, solve_candidates
from meshplan.planner.simulation.factors import step_factor

from tests.planner.search.test_solve import random_table

# (spec, seq, cluster, gpus, global batch, pins): tight memory, so recomputation and the
# memory-aware bound matter, and every schedule family appears
CASES = {
    "small-gpt": ("gpt:layers=24,hidden=1024,heads=16,vocab=32000", 1024, "a100-80g", 16, 64, Pins(tp=2)),
    "llama3-8b-tight": ("llama3-8b", 8192, "h100-sxm", 16, 32, Pins(tp=8, cp=1)),
    "llama3-70b-pipelines": ("llama3-70b", 4096, "h100-sxm", 64, 64, Pins(tp=8, cp=1, zero=1, mbs=1)),
    # alternating sliding-window and full-attention blocks (no run of identical layers): the
    # memory-aware bound on their floor (`bounds.bound_table`) prunes, and proves nothing fits
    "gpt-oss-20b-periodic": ("gpt-oss-20b", 4096, "a100-40g", 32, 64, Pins(tp=1, cp=1, ep=8, zero=1, mbs=1)),
}
ENGINES = {"gpt-oss-20b-periodic": "megatron"}  # expert parallelism searched; the others: meshplan's
NUM_KEEP = 6
REL_TOL = 3e-3  # the ILP stops within 0.2% of optimal (StageProblem.mip_rel_gap)


def _setup(case):
    spec, seq, cluster_name, gpus, global_batch, pins = CASES[case]
    cluster = load_cluster(cluster_name)
    graph = profile(spec, seq)
    candidates = enumerate_candidates(graph, cluster, gpus, global_batch, pins, 16, "bf16-mixed",
                                      ENGINES.get(case, "meshplan"))
    limit = usable_memory_bytes(cluster) * (1 - MEMORY_MARGIN)
    problems, memory_pruned, _ = build_problems(graph, cluster, candidates, global_batch, "bf16-mixed", pins, limit,
                                                False, 10.0)
    return candidates, problems, memory_pruned


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(CASES))
def test_pruned_search_keeps_the_brute_force_best(case):
    candidates, problems, memory_pruned = _setup(case)
    brute = {}
    exact = {item.candidate: item.exact_problem() for item in problems}  # schedule replayed, no cutoff
    for candidate, problem in exact.items():
        solution = solve_stages(problem)
        brute[candidate] = solution.objective_s if solution.feasible else math.inf
    ranked = sorted((objective, c.sort_key, c) for c, objective in brute.items() if math.isfinite(objective))
    assert len(ranked) > NUM_KEEP, "the case must leave something to prune"

    # the seeded threshold: every heuristic assignment is an upper bound on its ILP's optimum,
    # so the NUM_KEEP-th smallest of them bounds the NUM_KEEP-th best objective
    uppers = {}
    for candidate, problem in exact.items():
        uppers[candidate] = heuristic_upper_s(problem)
        if math.isfinite(uppers[candidate]):
            assert brute[candidate] <= uppers[candidate] * (1 + REL_TOL), candidate.label()
    finite = sorted(u for u in uppers.values() if math.isfinite(u))
    if len(finite) >= NUM_KEEP:
        assert ranked[NUM_KEEP - 1][0] <= finite[NUM_KEEP - 1] * (1 + REL_TOL)

    solved = solve_candidates(problems, num_keep=NUM_KEEP, workers=1)  # seeded (the default)
    assert len(solved) == len(problems)
    reasons = {s.pruned for s in solved}
    assert reasons & {"bound", "memory_bound"}, f"nothing was pruned by a bound in {case}"
    if case.endswith("periodic"):
        assert {"memory_bound", "memory"} <= reasons
    for item in solved:
        if item.pruned in ("bound", "memory_bound"):  # a bound is a bound
            assert item.lower_bound_s <= brute[item.candidate] * (1 + 1e-9), item.candidate.label()
        elif item.pruned == "memory":  # the relaxation proved that nothing fits
            assert math.isinf(brute[item.candidate]), item.candidate.label()
    found = sorted(s.solution.objective_s for s in solved if s.solution is not None and s.solution.feasible)
    for (best, _, candidate), got in zip(ranked[:NUM_KEEP], found[:NUM_KEEP]):
        assert got == pytest.approx(best, rel=REL_TOL), candidate.label()
    winner = ranked[0][2]
    assert any(s.candidate == winner and s.solution is not None for s in solved)
    # memory pruning before the ILP is a proof too
    for item in memory_pruned:
        assert item.pruned in ("memory", "expert_degree")


@pytest.mark.timeout(600)
def test_plan_accounting_adds_up():
    spec, seq, cluster, gpus, global_batch, pins = CASES["llama3-8b-tight"]
    plan = search_plan(spec, cluster, gpus, global_batch, seq, pins=pins, workers=1)
    s = plan.solver
    pruned = (s["num_pruned_bound"] + s["num_pruned_memory_bound"] + s["num_pruned_memory"]
              + s.get("num_pruned_expert_degree", 0))
    assert s["num_solved"] + pruned == s["num_candidates"]
    from meshplan.planner.search.assembly import explain

    text = explain(plan.to_json())
    assert f"{s['num_pruned_memory_bound']} by the memory-aware bound" in text


@pytest.mark.parametrize("schedule,vmax", [("interleaved", 4), ("zb-interleaved", 4), ("zbv", 2), ("dualpipev", 2)])
def test_step_factor_floor_is_below_the_replayed_factor(schedule, vmax):
    for pp in (2, 3, 4, 8):
        for m in (pp, 2 * pp, 3 * pp, 4 * pp + 2):
            for v in ((2,) if schedule in ("zbv", "dualpipev") else range(2 if schedule == "interleaved" else 1,
                                                                             vmax + 1)):
                if schedule == "dualpipev" and m < 2 * pp or schedule == "zbv" and m < 2 * pp - 1:
                    continue
                if schedule in ("interleaved", "zb-interleaved") and m % max(1, m // pp):
                    continue
                if schedule == "interleaved" and m % pp:
                    continue
                for share in (0.3, 0.5):
                    exact = max(step_factor(schedule, pp, m, v, weight_share=share), pp / v)
                    floor = bounds.step_factor_floor(schedule, pp, m, v)
                    assert floor <= exact + 1e-9
                    if schedule == "interleaved":  # whole backwards: the fill and drain bound is tight
                        assert floor == pytest.approx(exact, rel=1e-12), (pp, m, v)


@pytest.mark.parametrize("seed", range(12))
def test_memory_bound_is_below_the_ilp_on_random_tables(seed):
    rng = random.Random(seed)
    table = random_table(rng, num_blocks=rng.randint(6, 12), p2p_s=rng.uniform(0, 0.05))
    pp = rng.choice((1, 2, 3))
    v = rng.choice((1, 2)) if pp > 1 else 1
    m = pp * rng.randint(1, 3)
    shape = PipelineShape(pp, m, v, "interleaved" if v > 1 else "1f1b")
    unconstrained = solve_stages(StageProblem(table, shape, mip_rel_gap=1e-7))
    limit = max(unconstrained.rank_mem_bytes) * rng.uniform(0.5, 1.0)
    problem = StageProblem(table, shape, mem_limit_bytes=limit, mip_rel_gap=1e-7)
    bound = bounds.memory_bound_s(table, shape, limit, compact_structure(table), problem.grad_sync)
    assert bound >= bounds.compute_bound_s(table, shape)
    solution = solve_stages(problem)
    if solution.feasible:
        assert bound <= solution.objective_s * (1 + 1e-9)


def _dense_first(table, rng: random.Random, num_dense: int):
    """`table` with `num_dense` blocks of another kind between the embedding and the run (a
    dense-first mixture of experts, as DeepSeek-V3): lighter in time and state, heavier in
    activations, so memory may prefer either kind."""
    block = table.types[1]
    scale_s, scale_act, scale_static = rng.uniform(0.3, 0.9), rng.uniform(0.8, 1.6), rng.uniform(0.2, 0.8)
    dense = LayerType("dense", tuple(replace(o, fwd_s=o.fwd_s * scale_s, bwd_s=o.bwd_s * scale_s,
                                             act_bytes=o.act_bytes * scale_act,
                                             static_bytes=o.static_bytes * scale_static) for o in block.options))
    num_blocks = table.num_layers - 2
    names = ("embed",) + tuple(f"blocks.{i}" for i in range(num_dense + num_blocks)) + ("head",)
    return replace(table, layer_names=names, types=table.types + (dense,),
                   layer_type=(0,) + (3,) * num_dense + (1,) * num_blocks + (2,))


def test_memory_bound_with_dense_first_blocks_is_below_the_ilp():
    """The bound of tables with no compact structure: the longest run bounded, the dense blocks
    before it counted at their fastest time; the per-layer ILP is the reference. Memory must
    make the bound matter on some of them. The per-layer heuristic's assignment, where it fits,
    bounds the optimum from above."""
    stronger = heuristics = 0
    for seed in range(10):
        rng = random.Random(1000 + seed)
        num_dense = rng.randint(1, 3)
        table = _dense_first(random_table(rng, num_blocks=rng.randint(5, 8), p2p_s=rng.uniform(0, 0.05)), rng,
                             num_dense)
        assert compact_structure(table) is None
        structure = bounds.bound_structure(table)
        assert structure == (1 + num_dense, table.num_layers - 2 - num_dense, 1)
        pp = rng.choice((1, 2, 3))
        v = rng.choice((1, 2)) if pp > 1 else 1
        shape = PipelineShape(pp, pp * rng.randint(1, 3), v, "interleaved" if v > 1 else "1f1b")
        unconstrained = solve_stages(StageProblem(table, shape, mip_rel_gap=1e-7))
        limit = max(unconstrained.rank_mem_bytes) * rng.uniform(0.5, 1.0)
        # the per-layer ILP: the reference, its dense blocks free (the compact one pins them, below)
        problem = StageProblem(table, shape, mem_limit_bytes=limit, mip_rel_gap=1e-7, formulation="per-layer")
        bound = bounds.memory_bound_s(table, shape, limit, structure, problem.grad_sync)
        compute = bounds.compute_bound_s(table, shape)
        assert bound >= compute
        stronger += bound > compute * 1.01
        solution = solve_stages(problem)
        assert solution.formulation == "per-layer"
        if solution.feasible:
            assert bound <= solution.objective_s * (1 + 1e-9), seed
        upper = heuristic_upper_s(problem)  # `per_layer_heuristic`'s assignment: one the ILP accepts
        if math.isfinite(upper):
            heuristics += 1
            assert solution.feasible and solution.objective_s <= upper * (1 + 1e-6), seed
    assert stronger >= 3
    assert heuristics >= 5


@pytest.mark.parametrize("gathers", [False, True])
def test_compact_ilp_with_pinned_dense_blocks_is_exact_and_within_the_per_layer_space(gathers):
    """Dense blocks before the run pinned from chunk 0 on, a run's share to a chunk
    (`formulation.pinned_structure`, `evaluation.leading_chunks`): the compact ILP's own
    objective is the closed form of its assignment (its rows exact, gather heads included), that
    assignment keeps them in their chunks and fits, it is never below the per-layer optimum (a
    restriction of it) and equals it where the per-layer optimum places them so too (compared
    without gathers: with them the compact ILP also lays a chunk's run out in option order); its
    heuristic start, a compact assignment, bounds it from above."""
    equal = compared = spread = 0
    # chunk 0 holding every dense block (1, 2 chunks), or them spread over the first chunks (4, 6)
    shapes = (PipelineShape(1, 2), PipelineShape(2, 4), PipelineShape(2, 2, 2, "interleaved"), PipelineShape(4, 4),
              PipelineShape(3, 3, 2, "interleaved"), PipelineShape(2, 4, 2, "interleaved"))
    for seed, shape in enumerate(shapes):
        rng = random.Random(3000 + seed)
        num_dense = rng.randint(2, 3)
        table = _dense_first(random_table(rng, num_blocks=rng.randint(6, 7), p2p_s=rng.uniform(0, 0.05)), rng,
                             num_dense)
        if gathers:
            table = _with_gathers(table, rng)
        first, count = 1 + num_dense, table.num_layers - 2 - num_dense
        leading = leading_chunks(first, count, shape.num_chunks)
        assert all(leading.count(c) <= max(1, count // shape.num_chunks) for c in set(leading) - {0})
        if count < shape.num_chunks or (shape.num_chunks > 1 and leading[-1] >= shape.num_chunks - 1):
            assert pinned_structure(table, shape) is None  # too few run layers for the chunks after them
            continue
        assert pinned_structure(table, shape) == (first, count, 1)
        spread += leading[-1] > 0
        loose = solve_stages(StageProblem(table, shape, mip_rel_gap=1e-7))
        limit = max(loose.rank_mem_bytes) * rng.uniform(0.7, 1.0)
        problem = StageProblem(table, shape, mem_limit_bytes=limit, mip_rel_gap=1e-7)
        compact = solve_stages(problem)
        assert compact.formulation == "compact"
        if not compact.feasible:
            continue
        compared += 1
        assert compact.model_objective == pytest.approx(compact.objective_s, rel=1e-6), seed
        assert compact.chunk_of_layer[:first] == leading
        assert max(compact.rank_mem_bytes) <= limit * (1 + 1e-6)
        upper = heuristic_upper_s(problem)
        assert upper >= compact.objective_s * (1 - 1e-6) or math.isinf(upper)
        if gathers:  # the per-layer ILP with gathers takes seconds; the rows' exactness is the point
            continue
        per_layer = solve_stages(replace(problem, formulation="per-layer"))
        assert per_layer.feasible and compact.objective_s >= per_layer.objective_s * (1 - 1e-6), seed
        if per_layer.chunk_of_layer[:first] == leading:
            equal += 1
            assert compact.objective_s == pytest.approx(per_layer.objective_s, rel=1e-6), seed
    assert compared >= 5 and spread >= 2 and (equal >= 2 or gathers)


def _with_gathers(table, rng: random.Random):
    """`table` with ZeRO-3-like parameter gathers, so chunk passes expose gather heads."""
    def gathered(o):
        return replace(o, fwd_gather_s=o.fwd_s * rng.uniform(0.1, 0.6), bwd_gather_s=o.bwd_s * rng.uniform(0.1, 0.6),
                       fwd_busy_s=o.fwd_s, bwd_busy_s=o.bwd_s)
    return replace(table, types=tuple(replace(t, options=tuple(gathered(o) for o in t.options)) for t in table.types))


@pytest.mark.parametrize("grad_sync,num_stronger", [("overlap", 2), ("overlap_every_microbatch", 2),
                                                   ("after_chunk", 0)])
def test_reduction_bound_is_below_the_ilp_on_random_tables(grad_sync, num_stronger):
    """The reduction-aware bound against the ILP's optimum, with gather heads and large
    gradient reductions (random_table's reductions reach its layers' backward), where it must
    beat the compute bound on some tables unless the compute bound counts the whole reduction
    already (a blocking one, "after_chunk")."""
    stronger = 0
    for seed in range(6):
        rng = random.Random(2000 + seed)
        table = _with_gathers(random_table(rng, num_blocks=rng.randint(5, 9), p2p_s=rng.uniform(0, 0.05)), rng)
        pp = rng.choice((1, 2, 3))
        v = rng.choice((1, 2)) if pp > 1 else 1
        shape = PipelineShape(pp, pp * rng.randint(1, 3), v, "interleaved" if v > 1 else "1f1b")
        problem = StageProblem(table, shape, mip_rel_gap=1e-7, grad_sync=grad_sync)
        bound = reduction_bound.reduction_bound_s(table, shape, grad_sync, replay=True)
        assert bound >= reduction_bound.reduction_bound_s(table, shape, grad_sync) or grad_sync != "overlap_every_microbatch"
        stronger += bound > bounds.compute_bound_s(table, shape, grad_sync) * 1.01
        solution = solve_stages(problem)
        assert solution.feasible
        assert bound <= solution.objective_s * (1 + 1e-9), seed
    assert stronger >= num_stronger
