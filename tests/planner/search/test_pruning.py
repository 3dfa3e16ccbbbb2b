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

from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.search import bounds
from meshplan.planner.search.candidates import MEMORY_MARGIN, Pins, enumerate_candidates, usable_memory_bytes
from meshplan.planner.search.driver import search_plan
from meshplan.planner.search.ilp.formulation import PipelineShape, StageProblem, compact_structure, solve_stages
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
}
NUM_KEEP = 6
REL_TOL = 3e-3  # the ILP stops within 0.2% of optimal (StageProblem.mip_rel_gap)


def _setup(case):
    spec, seq, cluster_name, gpus, global_batch, pins = CASES[case]
    cluster = load_cluster(cluster_name)
    graph = profile(spec, seq)
    candidates = enumerate_candidates(graph, cluster, gpus, global_batch, pins, 16, "bf16-mixed")
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
                    exact = step_factor(schedule, pp, m, v, weight_share=share)
                    assert bounds.step_factor_floor(schedule, pp, m, v) <= max(exact, pp / v) + 1e-9


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
