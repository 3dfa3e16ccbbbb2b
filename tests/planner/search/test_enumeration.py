"""SP under TP, which the executor refuses for a mixture of experts at every expert layout
(`executable.moe_refuses_sp`), is dropped before the layouts are enumerated: the candidates are
exactly the executable ones of the full enumeration, and a pin that leaves nothing executable
still gets the refused candidates (the plan then says why `train` refuses it)."""
from __future__ import annotations

from meshplan.planner.costing.executable import model_facts, why_not_executable
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.search import candidates as cands
from meshplan.planner.search.candidates import Pins, enumerate_candidates

MOE_SPEC = "moe:layers=4,hidden=256,heads=8,kv_heads=4,experts=8,top_k=2,expert_ffn=128,vocab=1024"
H100 = load_cluster("h100-sxm")


def _full(graph, pins: Pins) -> list:
    """Every candidate with the refused SP ones, before the executor's refusals."""
    return cands._enumerate(graph, H100, 16, 32, pins, 4, "bf16-mixed", "meshplan", None, model_facts(graph),
                            refused_sp=True)


def test_moe_sp_is_dropped_before_enumeration_and_nothing_else_changes():
    graph = profile(MOE_SPEC, 1024)
    facts = model_facts(graph)
    full = _full(graph, Pins())
    refused = [c for c in full if c.sp and c.tp > 1]
    assert len(refused) > 100 and all(why_not_executable(c, facts) for c in refused)
    expected = sorted((c for c in full if why_not_executable(c, facts) is None), key=lambda c: c.sort_key)
    got = enumerate_candidates(graph, H100, 16, 32, Pins(), 4, "bf16-mixed")
    assert got == expected and not any(c.sp for c in got)


def test_a_pinned_sp_still_gets_the_refused_candidates():
    graph = profile(MOE_SPEC, 1024)
    got = enumerate_candidates(graph, H100, 16, 32, Pins(sp=True, tp=2), 4, "bf16-mixed")
    full = _full(graph, Pins(sp=True, tp=2))
    assert got == sorted(full, key=lambda c: c.sort_key) and got and all(c.sp for c in got)
