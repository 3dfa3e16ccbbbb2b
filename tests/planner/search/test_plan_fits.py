"""`plan` never writes a winner its own simulator says does not fit."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.search import driver

TINY = "gpt:layers=4,hidden=64,heads=4,vocab=256"


def _plan(monkeypatch, refuse):
    """Plan TINY on 4 CPU processes with the simulator reporting `refuse(candidate)` as not fitting."""
    real = driver._simulate

    def simulate(graph, cluster, solved, *args):
        ranked = real(graph, cluster, solved, *args)
        if refuse(solved.candidate):
            ranked = replace(ranked, prediction=replace(ranked.prediction, fits=False))
        return ranked
    monkeypatch.setattr(driver, "_simulate", simulate)
    return driver.search_plan(TINY, "cpu", 4, 16, 64, workers=1, top_k=2, num_rerank=2)


def test_a_winner_that_does_not_fit_when_simulated_is_never_written(monkeypatch):
    best = driver.search_plan(TINY, "cpu", 4, 16, 64, workers=1, top_k=2, num_rerank=2)
    mesh = (best.config.tp, best.config.pp, best.config.dp)
    # Every candidate on the unconstrained winner's mesh stops fitting: those rank first in the
    # ILP's order, so the search has to simulate further to find one that fits.
    plan = _plan(monkeypatch, lambda candidate: (candidate.tp, candidate.pp, candidate.dp) == mesh)
    assert plan.prediction["fits"]
    assert (plan.config.tp, plan.config.pp, plan.config.dp) != mesh


def test_a_request_where_nothing_fits_when_simulated_is_refused(monkeypatch):
    with pytest.raises(MeshplanError, match="fits when simulated.*binding: memory per GPU"):
        _plan(monkeypatch, lambda candidate: True)


def test_a_search_collects_rarely_and_restores_the_collector(monkeypatch):
    """During a search the collector runs at `SEARCH_GC_THRESHOLDS`; after it, and after a refusal,
    at the caller's thresholds again."""
    import gc

    seen = []
    real = driver._search

    def spy(*args):
        seen.append(gc.get_threshold())
        return real(*args)
    monkeypatch.setattr(driver, "_search", spy)
    before = gc.get_threshold()
    driver.search_plan(TINY, "cpu", 4, 16, 64, workers=1, top_k=1, num_rerank=1)
    assert seen and all(t == driver.SEARCH_GC_THRESHOLDS for t in seen)
    assert gc.get_threshold() == before
    with pytest.raises(MeshplanError):
        driver.search_plan(TINY, "cpu", 4, 16, 64, workers=1, tp=3)  # 3 does not divide the 4 heads
    assert gc.get_threshold() == before
