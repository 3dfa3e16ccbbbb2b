"""The screened solve: each candidate's ILP first runs at a share of its time limit; only those
that stopped there and may still win are solved again with the whole limit.

A fake solver stands in for HiGHS (its answers are set per candidate and per limit), so each
rule is checked on exact values: what a stopped solve proves (objective less the relative gap),
the contender window against the best objective, which candidates are solved twice, and that
the better of the two solutions is kept. The search's own agreement with brute force on real
ILPs is `test_pruning`'s.
"""
from __future__ import annotations

import math
import random

import pytest

from meshplan.planner.search import solving
from meshplan.planner.search.ilp.formulation import PipelineShape, StageProblem, StageSolution
from meshplan.planner.search.solving import CONTENDER_WINDOW, SCREEN_SHARE, can_win, proven_bound_s

from tests.planner.search.test_solve import random_table

LIMIT_S = 2.5


def _stopped(objective_s: float, gap: float) -> StageSolution:
    return StageSolution("time_limit", objective_s, gap, model_objective=objective_s)


def test_proven_bound_is_the_objective_less_the_gap():
    assert proven_bound_s(_stopped(12.0, 0.25)) == pytest.approx(9.0)
    assert proven_bound_s(StageSolution("optimal", 7.5)) == 7.5
    for unproven in (StageSolution("no_solution"), StageSolution("time_limit", 3.0, float("nan"), model_objective=3.0),
                     # the envelope's costs are its kinds' largest: its bound is none on the real blocks
                     StageSolution("time_limit", 12.0, 0.25, model_objective=12.0, formulation="envelope")):
        assert proven_bound_s(unproven) == -math.inf


def test_a_candidate_wins_only_within_the_window():
    best_s = 10.0
    edge_s = best_s * (1 + CONTENDER_WINDOW)
    assert can_win(_stopped(edge_s / 0.9 * 0.999, 0.1), best_s)       # proves just under the edge
    assert not can_win(_stopped(edge_s / 0.9 * 1.001, 0.1), best_s)   # proves just over it
    assert can_win(StageSolution("no_solution"), best_s)


def _problems(count: int) -> list[StageProblem]:
    table = random_table(random.Random(3), 6)
    return [StageProblem(table, PipelineShape(2, 4, 1), time_limit_s=LIMIT_S + index) for index in range(count)]


# per problem (by its whole limit): what the screen returns, and what the whole limit returns
ANSWERS = {
    LIMIT_S + 0: (StageSolution("optimal", 10.5), None),            # solved in the screen
    LIMIT_S + 1: (_stopped(12.0, 0.05), None),                     # proves 11.4: cannot win
    LIMIT_S + 2: (_stopped(11.0, 0.2), StageSolution("optimal", 10.1)),   # proves 8.8: again
    LIMIT_S + 3: (StageSolution("no_solution"), _stopped(10.4, 0.01)),    # nothing found: again
    LIMIT_S + 4: (_stopped(10.6, 0.1), _stopped(10.9, 0.05)),      # again, but the screen's is better
}


def _fake_solver(calls: list):
    """A stand-in for `solve_stages`: ANSWERS by the problem's whole limit, recording each call."""
    def solve(problem):
        whole = round(problem.time_limit_s / SCREEN_SHARE, 9) if problem.time_limit_s < LIMIT_S else None
        calls.append((problem.time_limit_s, whole is not None))
        screen, full = ANSWERS[whole if whole is not None else problem.time_limit_s]
        return screen if whole is not None else full
    return solve


def _screened(problems: list[StageProblem], pool) -> list[StageSolution]:
    """A batch screened against a best objective of 10.0, its second solves settled."""
    return solving._better(*solving._screen(problems, 10.0, pool))


def test_only_stopped_contenders_are_solved_again(monkeypatch):
    calls = []
    monkeypatch.setattr(solving, "solve_stages", _fake_solver(calls))
    got = _screened(_problems(5), pool=None)
    screened = [limit for limit, is_screen in calls if is_screen]
    again = [limit for limit, is_screen in calls if not is_screen]
    assert screened == pytest.approx([(LIMIT_S + i) * SCREEN_SHARE for i in range(5)])
    assert again == [LIMIT_S + 2, LIMIT_S + 3, LIMIT_S + 4]
    assert [s.objective_s for s in got] == [10.5, 12.0, 10.1, 10.4, 10.6]
    assert [s.status for s in got] == ["optimal", "time_limit", "optimal", "time_limit", "time_limit"]


def test_a_pool_solves_the_same_problems_to_the_same_solutions(monkeypatch):
    """With a pool, a contender's second solve is queued as its screen ends, while the batch's other
    screens still run: the same problems are solved, the same solutions kept, in the batch's order."""
    from concurrent.futures import ThreadPoolExecutor

    calls = []
    solve = _fake_solver(calls)
    monkeypatch.setattr(solving, "_solve_shipped", lambda task: solve(task[0]))
    with ThreadPoolExecutor(max_workers=2) as pool:
        got = _screened(_problems(5), pool=pool)
    assert sorted(limit for limit, is_screen in calls if not is_screen) == [LIMIT_S + 2, LIMIT_S + 3, LIMIT_S + 4]
    assert sum(is_screen for _, is_screen in calls) == 5
    assert [s.objective_s for s in got] == [10.5, 12.0, 10.1, 10.4, 10.6]


def test_problems_without_the_compact_structure_get_their_whole_limit_at_once(monkeypatch):
    """Per-layer and envelope problems are not screened: one solve each, at the whole limit."""
    limits = []

    def fake_solve(problem):
        limits.append(problem.time_limit_s)
        return _stopped(11.0, 0.2)

    monkeypatch.setattr(solving, "solve_stages", fake_solve)
    monkeypatch.setattr(solving, "pinned_structure", lambda table, shape: None)
    got = _screened(_problems(3), pool=None)
    assert limits == [LIMIT_S, LIMIT_S + 1, LIMIT_S + 2]
    assert [s.objective_s for s in got] == [11.0, 11.0, 11.0]


@pytest.mark.parametrize("seed", range(6))
def test_a_second_solve_from_the_screen_s_assignment_reaches_the_same_optimum(seed):
    """The screen's assignment read back into the compact ILP's counts (`compact_counts`, the
    inverse of `expand_counts`) is a valid start: solved from it, the ILP ends at the cold solve's
    optimum (within the MIP gap both stop at), on random tables and pipelines."""
    from dataclasses import replace

    from meshplan.planner.search.ilp.evaluation import compact_counts, expand_counts
    from meshplan.planner.search.ilp.formulation import pinned_structure, solve_stages

    rng = random.Random(seed)
    table = random_table(rng, rng.randint(6, 12))
    pp = rng.choice((2, 3))
    vpp = rng.choice((1, 2))
    shape = PipelineShape(pp, rng.choice((4, 6, 8)), vpp, "interleaved" if vpp > 1 else "1f1b")
    problem = StageProblem(table, shape, time_limit_s=30.0)
    structure = pinned_structure(table, shape)
    assert structure is not None
    cold = solve_stages(problem)
    assert cold.status == "optimal"
    counts, pinned = compact_counts((cold.chunk_of_layer, cold.option_of_layer), structure, table.num_layers,
                                    shape.num_chunks, len(table.types[structure[2]].options))
    assert expand_counts(counts, structure[0], table.num_layers, shape.num_chunks, pinned) == (
        list(cold.chunk_of_layer), list(cold.option_of_layer))
    warm = solve_stages(solving._from(problem, cold))
    assert warm.status == "optimal"
    assert warm.objective_s == pytest.approx(cold.objective_s, rel=2 * problem.mip_rel_gap)


def test_an_assignment_the_compact_ilp_cannot_take_is_not_a_start():
    """Run layers out of chunk order, or a pinned layer off its chunk: no start (None)."""
    from meshplan.planner.search.ilp.evaluation import compact_counts

    structure = (1, 4, 1)  # embedding, four blocks, head; 2 chunks
    assert compact_counts(((0, 0, 0, 1, 1, 1), (0,) * 6), structure, 6, 2, 3) is not None
    assert compact_counts(((0, 0, 1, 0, 1, 1), (0,) * 6), structure, 6, 2, 3) is None   # a block back in chunk 0
    assert compact_counts(((1, 0, 0, 1, 1, 1), (0,) * 6), structure, 6, 2, 3) is None   # embedding off chunk 0
    assert compact_counts(((0, 0, 0, 1, 1, 0), (0,) * 6), structure, 6, 2, 3) is None   # head off the last chunk
    assert compact_counts(((0, 0, 0, 1, 1, 1), (0, 3, 0, 0, 0, 0)), structure, 6, 2, 3) is None  # no option 3


def test_a_second_solve_runs_beside_the_next_batch_s_screens(monkeypatch):
    """With a pool, a batch's contenders' second solves are settled only after the next batch's
    screens: a long second solve (here it waits for the next batch's first screen to start, which
    a loop that settled each batch before the next would never do) leaves the other worker that
    batch's screens. The results are the serial loop's, each candidate once, its better solution."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from typing import NamedTuple

    class Candidate(NamedTuple):
        sort_key: tuple

    count = solving.SOLVE_BATCH * 2
    next_batch_started, waited = threading.Event(), []

    def answers(problem, pooled: bool) -> StageSolution:
        index = round((problem.time_limit_s if problem.time_limit_s >= LIMIT_S
                       else problem.time_limit_s / SCREEN_SHARE) - LIMIT_S)
        screen = problem.time_limit_s < LIMIT_S
        if index == solving.SOLVE_BATCH and screen:
            next_batch_started.set()
        if index == 0:  # a contender: stopped in its screen, optimal in its second solve
            if screen:
                return _stopped(10.4, 0.1)
            if pooled:
                waited.append(next_batch_started.wait(timeout=10))
            return StageSolution("optimal", 9.0)
        return StageSolution("optimal", 11.0 + index)

    def run(pool):
        items = [solving.Ready(Candidate((index,)), 0.0, problem) for index, problem in enumerate(_problems(count))]
        return solving._solve_all(items, count, None, False, pool)

    monkeypatch.setattr(solving, "solve_stages", lambda problem: answers(problem, False))
    serial = run(None)
    monkeypatch.setattr(solving, "_solve_shipped", lambda task: answers(task[0], True))
    next_batch_started.clear()  # the serial run set it
    with ThreadPoolExecutor(max_workers=2) as pool:
        pooled = run(pool)
    assert waited == [True]
    for got in (serial, pooled):
        by_candidate = {s.candidate.sort_key[0]: s.solution.objective_s for s in got}
        assert by_candidate == {0: 9.0, **{index: 11.0 + index for index in range(1, count)}}
