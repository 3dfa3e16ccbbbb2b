"""Cost tables built with shared option costs (the search's cache, and over its process pool) are
the tables built alone: sharing a dense layer's costs between expert-parallel degrees, or building
in another process, changes no number."""
from __future__ import annotations

from meshplan.planner.contracts.config import RECOMPUTE
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.uniform import cost_config
from meshplan.planner.costing.tables import build_cost_table
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.search import solving
from meshplan.planner.search.candidates import Pins, enumerate_candidates

# a small mixture of experts with a leading dense block: dense layers, MoE blocks, every EP
# degree, and context parallelism at this sequence length
MOE_SPEC = "moe:layers=4,hidden=256,heads=8,kv_heads=4,experts=8,top_k=2,expert_ffn=128,vocab=1024,dense_layers=1,ffn=512"


def _case():
    cluster = load_cluster("h100-sxm")
    graph = profile(MOE_SPEC, 4096)
    candidates = enumerate_candidates(graph, cluster, 32, 64, Pins(), 4, "bf16-mixed")
    return cluster, graph, candidates


def test_shared_option_costs_change_no_table():
    cluster, graph, candidates = _case()
    strategies = sorted({cost_config(c) for c in candidates}, key=repr)
    assert {s.ep for s in strategies} > {1} and {s.cp for s in strategies} > {1}
    cache: dict = {}
    for strategy in strategies:
        assert build_cost_table(graph, cluster, strategy, cache=cache) == build_cost_table(graph, cluster, strategy)


def test_tables_built_over_the_pool_are_the_same(monkeypatch):
    cluster, graph, candidates = _case()
    monkeypatch.setattr(solving, "PARALLEL_TABLES_MIN", 1)
    strategies = [cost_config(c) for c in candidates]
    tables = solving._build_tables(graph, cluster, candidates, strategies, RECOMPUTE, False, 2)
    assert set(tables) == set(strategies)
    for strategy, table in tables.items():
        assert table == build_cost_table(graph, cluster, strategy)
