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


def test_only_stopped_contenders_are_solved_again(monkeypatch):
    best_s = 10.0
    # per problem (by its whole limit): what the screen returns, and what the whole limit returns
    answers = {
        LIMIT_S + 0: (StageSolution("optimal", 10.5), None),            # solved in the screen
        LIMIT_S + 1: (_stopped(12.0, 0.05), None),                     # proves 11.4: cannot win
        LIMIT_S + 2: (_stopped(11.0, 0.2), StageSolution("optimal", 10.1)),   # proves 8.8: again
        LIMIT_S + 3: (StageSolution("no_solution"), _stopped(10.4, 0.01)),    # nothing found: again
        LIMIT_S + 4: (_stopped(10.6, 0.1), _stopped(10.9, 0.05)),      # again, but the screen's is better
    }
    calls = []

    def fake_many(problems, pool):
        out = []
        for problem in problems:
            whole = round(problem.time_limit_s / SCREEN_SHARE, 9) if problem.time_limit_s < LIMIT_S else None
            calls.append((problem.time_limit_s, whole is not None))
            screen, full = answers[whole if whole is not None else problem.time_limit_s]
            out.append(screen if whole is not None else full)
        return out

    monkeypatch.setattr(solving, "_solve_many", fake_many)
    problems = _problems(5)
    got = solving._screened_solve(problems, best_s, pool=None)
    screened = [limit for limit, is_screen in calls if is_screen]
    again = [limit for limit, is_screen in calls if not is_screen]
    assert screened == pytest.approx([(LIMIT_S + i) * SCREEN_SHARE for i in range(5)])
    assert again == [LIMIT_S + 2, LIMIT_S + 3, LIMIT_S + 4]
    assert [s.objective_s for s in got] == [10.5, 12.0, 10.1, 10.4, 10.6]
    assert [s.status for s in got] == ["optimal", "time_limit", "optimal", "time_limit", "time_limit"]


def test_problems_without_the_compact_structure_get_their_whole_limit_at_once(monkeypatch):
    """Per-layer and envelope problems are not screened: one solve each, at the whole limit."""
    limits = []

    def fake_many(problems, pool):
        limits.extend(problem.time_limit_s for problem in problems)
        return [_stopped(11.0, 0.2) for _ in problems]

    monkeypatch.setattr(solving, "_solve_many", fake_many)
    monkeypatch.setattr(solving, "pinned_structure", lambda table, shape: None)
    got = solving._screened_solve(_problems(3), 10.0, pool=None)
    assert limits == [LIMIT_S, LIMIT_S + 1, LIMIT_S + 2]
    assert [s.objective_s for s in got] == [11.0, 11.0, 11.0]
