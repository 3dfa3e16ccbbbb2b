"""Periodic blocks (GPT-OSS's alternating sliding-window and full-attention blocks) solved by the
compact ILP on their envelope (`search.ilp.envelope`), read back on the real blocks.

The exact optimum is the per-layer ILP's (which `test_solve.py` holds to brute force); the
envelope's assignment, scored on the real table, can be no better than it, and its own ILP
objective, every block priced at its kinds' largest costs, no lower than the real score. How far
the envelope may fall behind depends on how much the kinds differ: here they differ by 10% in
time and 5% in bytes, and the assignment is held within 3% of the optimum (the cut is the same
up to which kind of block sits at a boundary). Their floor (every cost field at its kinds' least)
gives the search's memory-aware bound a run to bound, below the per-layer optimum."""
from __future__ import annotations

import math
import random
from dataclasses import fields, replace

import pytest

from meshplan.planner.costing.tables import CostTable, LayerType, OptionCost
from meshplan.planner.search import bounds
from meshplan.planner.search.ilp.envelope import (envelope_option, envelope_table, floor_option, floor_table,
                                                  periodic_types)
from meshplan.planner.search.ilp.formulation import PipelineShape, StageProblem, solve_stages


def _option(recompute, time_s, act, static, buffer=0.0, dp_s=0.5):
    return OptionCost(recompute=recompute, fwd_s=time_s / 3, bwd_s=2 * time_s / 3, static_bytes=static,
                      act_bytes=act, buffer_bytes=buffer, dp_comm_s=dp_s, param_gather_s=0.01, optimizer_s=0.02)


def _block(key: str, time_s: float, act: float, static: float) -> LayerType:
    return LayerType(key, (_option("none", time_s, act, static), _option("selective", time_s * 1.1, act * 0.6, static),
                           _option("full", time_s * 1.33, act * 0.1, static, buffer=act)))


def periodic_table(num_blocks: int, pattern=(1, 2), seed: int = 0) -> CostTable:
    """Embedding, blocks whose types repeat `pattern` (1: full attention, 2: a window, 10% faster
    and 5% leaner, 3: a third kind), head."""
    rng = random.Random(seed)
    time_s, act, static = rng.uniform(0.5, 1.5), rng.uniform(1, 3) * 2**30, rng.uniform(0.5, 2) * 2**30
    embed = LayerType("embed", (_option("none", 0.2, act * 0.2, 2 * static),))
    full = _block("full", time_s, act, static)
    window = _block("window", time_s * 0.9, act * 0.95, static)
    third = _block("third", time_s * 0.95, act * 1.02, static)
    head = LayerType("head", (_option("none", 1.0, act, 2 * static),))
    types = (embed, full, window, third, head)
    blocks = tuple(pattern[i % len(pattern)] for i in range(num_blocks))
    names = ("embed",) + tuple(f"blocks.{i}" for i in range(num_blocks)) + ("head",)
    return CostTable(layer_names=names, layer_type=(0,) + blocks + (4,), types=types)


def test_the_pattern_is_found_only_where_blocks_repeat_with_aligned_options():
    assert periodic_types(periodic_table(8, (1, 2))) == (1, 2)
    assert periodic_types(periodic_table(9, (1, 2, 3))) == (1, 2, 3)
    assert periodic_types(periodic_table(26, (1, 1, 1, 1, 1, 2))) == (1, 2)  # Gemma 3: five local blocks, one global
    assert periodic_types(periodic_table(10, (1, 1, 1, 1, 1, 2))) is None  # under two whole periods: no pattern
    assert periodic_types(periodic_table(8, (1,))) is None  # one type: the compact formulation's own case
    table = periodic_table(8, (1, 2))
    assert periodic_types(replace(table, layer_type=table.layer_type[:4] + (1,) + table.layer_type[5:])) is None
    lean = LayerType("window", table.types[2].options[:2])  # one option fewer: indices would not align
    assert periodic_types(replace(table, types=table.types[:2] + (lean,) + table.types[3:])) is None
    # kinds 40% apart in time (a dense block beside a MoE one): the envelope would misprice the light one
    light = LayerType("light", tuple(replace(o, fwd_s=o.fwd_s * 0.6, bwd_s=o.bwd_s * 0.6) for o in table.types[1].options))
    assert periodic_types(replace(table, types=table.types[:2] + (light,) + table.types[3:])) is None


def test_an_envelope_option_is_each_field_at_its_largest():
    table = periodic_table(4)
    full, window = table.types[1].options[2], table.types[2].options[2]
    merged = envelope_option([window, full])
    assert merged.recompute == "full"
    for f in fields(OptionCost):
        if f.name not in ("recompute", "tp", "dp"):
            assert getattr(merged, f.name) == max(getattr(full, f.name), getattr(window, f.name)), f.name
    envelope = envelope_table(table)
    assert envelope.layer_type[1:-1] == (len(table.types),) * 4 and envelope.layer_type[0] == 0
    assert envelope.layer_type[-1] == 4 and envelope.runs()[1][2] == 4


def test_a_floor_option_is_each_field_at_its_least():
    table = periodic_table(6, (1, 2, 3))
    kinds = [table.types[t].options[1] for t in (1, 2, 3)]
    merged = floor_option(kinds)
    assert merged.recompute == "selective"
    for f in fields(OptionCost):
        if f.name not in ("recompute", "tp", "dp"):
            assert getattr(merged, f.name) == min(getattr(o, f.name) for o in kinds), f.name
    floor = floor_table(table)
    assert floor.layer_type[1:-1] == (len(table.types),) * 6 and floor.layer_type[0] == 0 and floor.layer_type[-1] == 4
    assert bounds.bound_table(table) == (floor, (1, 6, len(table.types)))  # the floor's run, for the memory bound
    assert floor_table(periodic_table(8, (1,))) is None and bounds.bound_table(periodic_table(8, (1,)))[1] == (1, 8, 1)


def test_memory_bound_on_the_floor_is_below_the_per_layer_optimum():
    """`bounds.bound_table`'s floor: the memory-aware bound of periodic blocks is at most the
    per-layer ILP's optimum on the real blocks (and so at most the envelope's assignment); where
    memory binds it beats the compute bound, and it is infinite only where nothing fits."""
    stronger = proofs = 0
    for seed in range(10):
        rng = random.Random(seed)
        table = periodic_table(rng.randint(6, 10), rng.choice(((1, 2), (1, 2, 3), (2, 2, 1))), seed=seed)
        pp = rng.choice((1, 2, 3))
        v = rng.choice((1, 2)) if pp > 1 else 1
        shape = PipelineShape(pp, pp * rng.randint(1, 3), v, "interleaved" if v > 1 else "1f1b")
        loose = StageProblem(table, shape, mip_rel_gap=1e-9, formulation="per-layer")
        lean = solve_stages(replace(loose, objective="memory")).objective_s
        fastest = max(solve_stages(loose).rank_mem_bytes)
        limit = lean + (fastest - lean) * rng.uniform(-0.2, 1.0)  # some limits below the leanest peak
        floor, structure = bounds.bound_table(table)
        bound = bounds.memory_bound_s(floor, shape, limit, structure, loose.grad_sync)
        compute = bounds.compute_bound_s(table, shape)
        exact = solve_stages(replace(loose, mem_limit_bytes=limit))
        if exact.feasible:
            assert bound <= exact.objective_s * (1 + 1e-9), seed
            stronger += bound > compute * 1.01
        else:
            assert limit < lean * (1 + 1e-6), seed  # the ILP finds nothing only where nothing fits
            proofs += math.isinf(bound)
    assert stronger >= 2 and proofs >= 1


@pytest.mark.parametrize("shape", [PipelineShape(2, 4), PipelineShape(4, 8), PipelineShape(2, 4, 2, "interleaved")])
def test_envelope_assignment_against_the_per_layer_optimum(shape):
    table = periodic_table(14, seed=shape.num_stages)
    loose = StageProblem(table, shape, mip_rel_gap=1e-9)
    lean = solve_stages(replace(loose, objective="memory", formulation="per-layer")).objective_s
    fastest = max(solve_stages(replace(loose, formulation="per-layer")).rank_mem_bytes)
    problem = replace(loose, mem_limit_bytes=(lean + fastest) / 2)
    envelope = solve_stages(problem)
    exact = solve_stages(replace(problem, formulation="per-layer"))
    assert envelope.formulation == "envelope" and exact.formulation == "per-layer"
    assert envelope.feasible and max(envelope.rank_mem_bytes) <= problem.mem_limit_bytes * (1 + 1e-6)
    assert exact.objective_s * (1 - 1e-9) <= envelope.objective_s <= exact.objective_s * 1.03
    assert envelope.model_objective >= envelope.objective_s * (1 - 1e-9)  # the envelope bounds the real blocks


def test_what_only_fits_per_layer_is_solved_per_layer():
    """A limit between the real leanest peak and the envelope's: the envelope ILP is infeasible,
    the per-layer one is not, and the per-layer answer is returned."""
    table = periodic_table(10)
    problem = StageProblem(table, PipelineShape(2, 4), mip_rel_gap=1e-9)
    real = solve_stages(replace(problem, objective="memory", formulation="per-layer")).objective_s
    bound = solve_stages(replace(problem, table=envelope_table(table), objective="memory")).objective_s
    assert bound > real
    solution = solve_stages(replace(problem, mem_limit_bytes=(real + bound) / 2))
    assert solution.feasible and solution.formulation == "per-layer"


def test_gpt_oss_blocks_are_periodic_in_its_cost_table():
    """gpt-oss-120b's 36 blocks alternate sliding-window and full attention: two types, one
    pattern. On 2 pipeline stages of 32 GPUs at a memory limit that binds, the envelope's
    assignment is within 2% of the per-layer optimum (1.0% measured; the kinds differ by 7-10% in
    time), solved in a fraction of the per-layer ILP's time."""
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.costing.tables import build_cost_table
    from meshplan.planner.profiling.profiler import profile

    graph, cluster = profile("gpt-oss-120b", 4096), load_cluster("h100-sxm")
    config = ParallelConfig(gpus=64, global_batch=512, dp=64, zero=3, microbatch_size=4)
    table = build_cost_table(graph, cluster, config)
    assert len(periodic_types(table)) == 2 and len(set(table.layer_type[1:-1])) == 2
    config = ParallelConfig(gpus=64, global_batch=512, pp=2, dp=32, zero=3, microbatch_size=1)
    base = StageProblem(build_cost_table(graph, cluster, config), PipelineShape(2, config.num_microbatches),
                        mip_rel_gap=1e-4)
    lean = solve_stages(replace(base, objective="memory", formulation="per-layer")).objective_s
    fastest = max(solve_stages(replace(base, formulation="per-layer")).rank_mem_bytes)
    problem = replace(base, mem_limit_bytes=(lean + fastest) / 2)
    envelope, exact = solve_stages(problem), solve_stages(replace(problem, formulation="per-layer"))
    assert envelope.formulation == "envelope" and exact.status == "optimal"
    assert exact.objective_s * (1 - 1e-9) <= envelope.objective_s <= exact.objective_s * 1.02
