"""Cost tables built with shared option costs (the search's cache, and over its process pool) are
the tables built alone: sharing a dense layer's costs between expert-parallel degrees, or building
in another process, changes no number."""
from __future__ import annotations

from meshplan.planner.contracts.config import RECOMPUTE
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.uniform import cost_config
from meshplan.planner.costing.tables import build_cost_table
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.search import table_cache
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
    monkeypatch.setattr(table_cache, "PARALLEL_TABLES_MIN", 1)
    strategies = [cost_config(c) for c in candidates]
    tables = table_cache.build_tables(graph, cluster, candidates, strategies, RECOMPUTE, False, 2)
    assert set(tables) == set(strategies)
    for strategy, table in tables.items():
        assert table == build_cost_table(graph, cluster, strategy)


def test_tables_left_for_later_are_built_on_first_use_and_the_same():
    """Pipelined ZeRO-2/3 candidates with a searched ZeRO-1 sibling get no table up front (the
    sibling's bounds them); their first floor problem builds it, equal to one built alone, and the
    cache hands every candidate its strategy's table."""
    from meshplan.planner.search.problems import build_problems

    cluster = load_cluster("h100-sxm")
    graph = profile("gpt:layers=4,hidden=256,heads=4,vocab=1024", 512)
    candidates = enumerate_candidates(graph, cluster, 16, 64, Pins(), 4, "bf16-mixed")
    problems, pruned, tables = build_problems(graph, cluster, candidates, 64, "bf16-mixed", Pins(), 1e18, False, 10.0)
    assert len(problems) + len(pruned) == len(candidates)
    late = [item for item in problems if not item.built]
    assert late and all(item.candidate.zero >= 2 and item.candidate.pp > 1 and item.candidate.dp > 1 for item in late)
    item = late[0]
    strategy = cost_config(item.candidate)
    assert not tables.is_built(strategy)
    problem = item.floor_problem()
    assert item.built and tables.is_built(strategy)
    assert problem.table == build_cost_table(graph, cluster, strategy)
    assert tables.table_for(item.candidate) is problem.table
    assert item.exact_problem().table is problem.table  # the exact problem replays the schedule on the same table
    for other in problems[:20]:
        assert tables.table_for(other.candidate) == build_cost_table(graph, cluster, cost_config(other.candidate))


def test_resident_bytes_do_not_depend_on_the_micro_batch(monkeypatch):
    """`problems.static_key` leaves the micro-batch out: strategies equal but for it have the same
    least resident bytes, and the search prunes by memory exactly the candidates a table of their
    own prunes (`solving.min_static_bytes`), without building the tables of groups that do not fit."""
    from meshplan.planner.search import problems as problems_module
    from meshplan.planner.search.solving import min_static_bytes

    cluster, graph, candidates = _case()
    candidates = [c for c in candidates if c.schedule_spec.searched]
    strategies = {cost_config(c): c for c in candidates}
    least: dict = {}
    for strategy in strategies:
        least.setdefault(problems_module.static_key(strategy), set()).add(
            build_cost_table(graph, cluster, strategy).least_static_bytes)
    assert all(len(values) == 1 for values in least.values())
    assert max(len({s.microbatch_size for s in strategies if problems_module.static_key(s) == key})
               for key in least) > 1
    sizes = sorted(next(iter(values)) for values in least.values())
    limit = sizes[len(sizes) // 2]  # half the groups do not fit
    built_ones = []
    real_build = table_cache.build_tables

    def counting_build(*args, **kwargs):
        out = real_build(*args, **kwargs)
        if kwargs["recompute_options"] != problems_module.LIGHT_RECOMPUTE:  # full tables: each built once
            built_ones.extend(out)
        return out

    monkeypatch.setattr(problems_module, "build_tables", counting_build)
    problems, pruned, _ = problems_module.build_problems(graph, cluster, candidates, 64, "bf16-mixed", Pins(), limit,
                                                         False, 10.0)
    memory = {s.candidate for s in pruned if s.pruned == "memory"}
    expected = {c for c in candidates if min_static_bytes(build_cost_table(graph, cluster, cost_config(c)), c.pp) > limit}
    assert memory == expected and memory
    assert len(built_ones) == len(set(built_ones)) < len(strategies)


def test_light_tables_bound_as_the_full_ones():
    """A light table (`problems.LIGHT_RECOMPUTE`: the fastest option of each layer) gives the full
    table's compute bound and resident bytes, for every candidate of a mixture of experts."""
    from meshplan.planner.costing.state_memory import grad_sync_mode
    from meshplan.planner.search.bounds import compute_bound_s
    from meshplan.planner.search.problems import LIGHT_RECOMPUTE
    from meshplan.planner.search.solving import floor_shape

    cluster, graph, candidates = _case()
    cache_full: dict = {}
    cache_light: dict = {}
    for candidate in candidates[::3]:
        strategy = cost_config(candidate)
        full = build_cost_table(graph, cluster, strategy, cache=cache_full)
        light = build_cost_table(graph, cluster, strategy, LIGHT_RECOMPUTE, cache=cache_light)
        shape, sync = floor_shape(candidate), grad_sync_mode(candidate)
        assert compute_bound_s(light, shape, sync) == compute_bound_s(full, shape, sync)
        assert light.least_static_bytes == full.least_static_bytes


def test_expert_layouts_ruled_on_light_tables_pose_the_same_problems(monkeypatch):
    """The expert-degree rule read off light tables keeps the same candidates with the same bounds
    and prunes the same ones, as when every table is built in full; the kept ones' tables are full."""
    from meshplan.planner.search import problems as problems_module

    cluster, graph, candidates = _case()

    def posed():
        problems, pruned, tables = problems_module.build_problems(graph, cluster, candidates, 64,
                                                                  "bf16-mixed", Pins(), 1e18, False, 10.0)
        for item in problems[:40]:
            assert tables.table_for(item.candidate) == build_cost_table(graph, cluster, cost_config(item.candidate))
        return ([(p.candidate, p.bound_s) for p in problems], sorted((s.candidate.sort_key, s.pruned) for s in pruned))
    light = posed()
    assert any(reason == "expert_degree" for _, reason in light[1])
    monkeypatch.setattr(problems_module, "_expert_layouts_compete", lambda candidates: False)
    assert posed() == light
