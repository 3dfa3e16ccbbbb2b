"""SP under TP, which the executor refuses for a mixture of experts at every expert layout
(`executable.moe_refuses_sp`), is dropped before the layouts are enumerated: the candidates are
exactly the executable ones of the full enumeration, and a pin that leaves nothing executable
still gets the refused candidates (the plan then says why `train` refuses it)."""
from __future__ import annotations

import pytest

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


def _meshes(candidates) -> set:
    return {(c.tp, c.pp, c.dp, c.cp, c.ep, c.expert_tp, c.sp, c.zero, c.microbatch_size) for c in candidates}


def test_another_engine_gets_sp_under_tp_for_a_mixture_of_experts():
    """SP under TP, which meshplan's executor refuses for a mixture of experts, is what Megatron-LM
    requires with TP (`config.moe_sp_problem`): under --engine megatron every TP layout of a mixture
    of experts has SP, each of meshplan's layouts is there (with SP where it has TP), and no TP
    layout without SP is."""
    graph = profile(MOE_SPEC, 1024)
    own = enumerate_candidates(graph, H100, 16, 32, Pins(), 4, "bf16-mixed")
    megatron = enumerate_candidates(graph, H100, 16, 32, Pins(), 4, "bf16-mixed", engine="megatron")
    assert {c.engine for c in megatron} == {"megatron"}
    assert any(c.sp and c.tp > 1 and c.ep > 1 for c in megatron) and not any(c.sp for c in own)
    assert not any(c.tp > 1 and not c.sp for c in megatron)
    with_sp = {m[:6] + (m[0] > 1,) + m[7:] for m in _meshes(own)}
    assert with_sp <= _meshes(megatron) and any(m[0] > 1 for m in with_sp)


def test_hf_moe_layouts_only_the_executor_refuses_are_counted_and_searched_by_other_engines():
    """A Hugging Face mixture of experts trains on meshplan's executor with tp 1 and no EP: the
    default engine's space keeps to that and hands the rest to `left_out`, which is exactly what
    another engine (whose plan is exported, not trained by meshplan) searches beyond it, with SP
    under TP where that engine requires it."""
    pytest.importorskip("transformers")
    graph = profile("deepseek-v2-lite", 256)
    left: list = []
    own = enumerate_candidates(graph, H100, 64, 64, Pins(), 1, "bf16-mixed", left_out=left)
    assert own and all(c.ep == 1 and c.tp == 1 for c in own)
    assert left and all(why_not_executable(c, model_facts(graph)) for c in left)
    assert any(c.ep > 1 for c in left) and not set(own) & set(left)
    megatron = enumerate_candidates(graph, H100, 64, 64, Pins(), 1, "bf16-mixed", engine="megatron")
    # every layout, with the SP Megatron-LM requires of a mixture of experts under TP
    assert _meshes(megatron) >= {m[:6] + (m[0] > 1,) + m[7:] for m in _meshes(own) | _meshes(left)}
    nothing: list = []
    enumerate_candidates(graph, H100, 64, 64, Pins(), 1, "bf16-mixed", engine="megatron", left_out=nothing)
    assert nothing == []


def test_the_plan_names_the_layouts_the_executor_left_out():
    from meshplan.planner.search.assembly import explain

    plan = {"prediction": {"step_time_s": 1.0, "mfu": 0.3, "bubble_fraction": 0.0, "peak_memory_bytes": 1e9},
            "mesh": {"pp": 1, "dp": 8, "tp": 1}, "sp": False, "zero": 1, "layers": [{"recompute": "none"}],
            "schedule": {"name": "1f1b", "virtual_stages": 1, "microbatches": 1, "microbatch_size": 1},
            "solver": {"usable_memory_bytes": 8e10, "num_executor_limited": 42}}
    assert "42 more layouts were left out because meshplan's executor does not train them" in explain(plan)
    del plan["solver"]["num_executor_limited"]
    assert "left out because" not in explain(plan)


def test_mtp_depths_share_the_output_layer_s_chunk_so_no_pipeline_has_more_chunks_than_that_allows():
    """Every chunk holds a layer and the multi-token-prediction depths sit in the last chunk with
    the output layer (`CostTable.last_chunk_layers`): an embedding, 4 blocks, 2 depths and a head
    (8 layers) fill at most 6 chunks, as the 6 layers without depths do; 8 chunks (PP 8, or PP 4
    with 2 virtual stages), which have no assignment and each cost an ILP, are not posed."""
    from meshplan.planner.profiling.mtp import with_mtp

    plain = profile(MOE_SPEC, 1024)
    deep = with_mtp(plain, 2)
    assert len(deep.layers) == len(plain.layers) + 2 == 8
    for graph in (plain, deep):
        got = enumerate_candidates(graph, H100, 16, 64, Pins(), 4, "bf16-mixed", engine="megatron")
        chunks = {c.pp * c.virtual_stages for c in got}
        assert max(chunks) == 6 and 8 not in chunks, sorted(chunks)
