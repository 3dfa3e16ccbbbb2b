"""A MoE block's dense part is priced once for all its expert layouts (`layer_cost`'s `memo`,
which `tables.build_cost_table` passes its cache as): every cost and every table comes out
identical to pricing each layout from scratch, since the dense part reads no expert layout field."""
from __future__ import annotations

import itertools

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.tables import build_cost_table
from tests.planner.costing.meshes import expert_block, mesh, small_moe_graph

H100 = load_cluster("h100-sxm")


def _layouts(tp: int, ranks: int):
    """(etp, ep) pairs over tp * ranks GPUs: etp = tp (None) or 1, ep a power of two up to 8."""
    for etp, ep in itertools.product((None, 1), (1, 2, 4, 8)):
        if (etp or tp) * ep <= tp * ranks and not (etp == 1 and tp == 1):
            yield etp, ep


def test_memoised_dense_part_gives_the_same_block_cost():
    graph = small_moe_graph()
    block = expert_block(graph)
    memo: dict = {}
    checked = 0
    for tp, cp, zero, recompute, sp in itertools.product((1, 2), (1, 2), (0, 1, 3), ("none", "full"), (False, True)):
        if sp and tp == 1:
            continue
        for etp, ep in _layouts(tp, 8 * cp):
            config = ParallelConfig(gpus=8 * tp * cp, global_batch=16, tp=tp, dp=8, cp=cp, microbatch_size=2,
                                    zero=zero, recompute=recompute, sp=sp, ep=ep, etp=etp)
            fresh = layer_cost(block, config, H100, graph.info, profile_dtype="bf16")
            shared = layer_cost(block, config, H100, graph.info, profile_dtype="bf16", memo=memo)
            assert shared == fresh, (config, shared, fresh)
            checked += 1
    # one dense part per configuration equal but for the layout, each reused by its other layouts
    dense_parts = sum(key[0] == "dense_part" for key in memo)
    assert dense_parts == 2 * 3 * 2 * (1 + 2)  # cp x zero x recompute, at tp 1 and at tp 2 with and without SP
    assert checked > 2 * dense_parts


def test_tables_sharing_a_cache_equal_tables_built_alone():
    graph = small_moe_graph()
    cache: dict = {}
    for ep in (1, 2, 4, 8):
        config = mesh(tp=2, dp=8, ep=ep, microbatch_size=2, zero=1)
        assert build_cost_table(graph, H100, config, cache=cache) == build_cost_table(graph, H100, config)
    assert sum(key[0] == "dense_part" for key in cache) == 3  # one per recompute option


def test_expert_times_are_priced_once_per_layout_and_micro_batch():
    """The routed experts' times read only `EXPERT_TIME_FIELDS`: across data degrees, ZeRO stages
    and pipeline depths the memoised block costs equal fresh ones, the memo holding one entry per
    (tp, ep, etp, recompute) here."""
    from meshplan.planner.costing.expert_parallel import EXPERT_TIME_FIELDS

    graph = small_moe_graph()
    block = expert_block(graph)
    memo: dict = {}
    layouts, checked = set(), 0
    for tp, dp, pp, zero, recompute in itertools.product((1, 2), (8, 16), (1, 2), (0, 1, 3), ("none", "full")):
        for etp, ep in _layouts(tp, dp):
            config = ParallelConfig(gpus=tp * dp * pp, global_batch=128, tp=tp, dp=dp, pp=pp, microbatch_size=2,
                                    zero=zero, recompute=recompute, ep=ep, etp=etp)
            fresh = layer_cost(block, config, H100, graph.info, profile_dtype="bf16")
            assert layer_cost(block, config, H100, graph.info, profile_dtype="bf16", memo=memo) == fresh, config
            layouts.add(tuple(getattr(config, name) for name in EXPERT_TIME_FIELDS))
            checked += 1
    assert sum(key[0] == "expert_times" for key in memo) == len(layouts) < 0.2 * checked


def test_memoised_compute_times_give_the_same_layer_costs():
    """Every layer of a dense model, priced with one memo across a sweep of meshes, micro-batch
    counts, precisions, fp8 recipes, engines (torchtitan eager and compiled) and recomputation, costs exactly what it costs
    priced fresh: the compute times read only `compute_time.compute_time_key` of the configuration."""
    from meshplan.planner.profiling.profiler import profile

    graph = profile("llama:layers=2,hidden=512,heads=8,kv_heads=4,vocab=8000", 1024, dtype="bf16")
    memo: dict = {}
    checked = 0
    sweep = itertools.product((1, 2), (1, 2), (2, 4), (1, 2), (0, 1, 3), ("none", "selective", "full"),
                              (("bf16-mixed", None), ("fp8", "tensorwise"), ("fp8", "delayed")),
                              (("meshplan", False), ("megatron", False), ("torchtitan", False), ("torchtitan", True)),
                              (1, 4))
    for tp, cp, dp, pp, zero, recompute, (precision, recipe), (engine, compiled), steps in sweep:
        config = ParallelConfig(gpus=tp * cp * dp * pp, global_batch=8 * dp * steps, tp=tp, cp=cp, dp=dp, pp=pp, zero=zero,
                                recompute=recompute, sp=tp > 1, precision=precision, fp8_recipe=recipe, engine=engine,
                                torch_compile=compiled)
        for layer in graph.layers:
            fresh = layer_cost(layer, config, H100, graph.info, profile_dtype="bf16", attention=graph.attention)
            shared = layer_cost(layer, config, H100, graph.info, profile_dtype="bf16", attention=graph.attention,
                                memo=memo)
            assert shared == fresh, (layer.name, config)
            checked += 1
    assert sum(key[0] == "compute_times" for key in memo) < checked / 4
