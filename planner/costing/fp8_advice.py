"""Which block Linears an fp8 configuration would run faster left in bf16, by the cost model itself.

A Linear is worth converting when its fp8 GEMMs save more than its casts cost: thin TP shards
(GQA's k and v projections at high TP degrees, 128 output columns a rank for Llama 3 70B at TP 8)
and small models lose. torchao's auto filter (`fp8_filter.AUTO_FILTER_RULES`) judges by the
weight's shape before TP from H100 microbenchmarks; this asks the cost model, on the rank's shards
and the run's micro-batch, what leaving each Linear in bf16 changes in one block's forward and
backward (`compute_time.compute_times_s`, so casts, rescales and the fp8 GEMM rate are the ones
the step is priced with).
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.fp8_choice import FP8_FILTER_ENGINES, FP8_LINEARS, stored_fp8_filter
from meshplan.planner.costing.compute_time import compute_times_s
from meshplan.planner.costing.fp8_filter import filter_problem, fp8_linears, linear_roles
from meshplan.planner.costing.precision import activation_scale


def _block_s(layer, graph, cluster: ClusterProfile, config: ParallelConfig) -> float:
    fwd_s, bwd_s, _ = compute_times_s(layer, config, cluster, graph.info, activation_scale(config.precision, graph.dtype),
                                      1.0, graph.dtype, graph.attention)
    return fwd_s + bwd_s


def slower_in_fp8(graph, cluster: ClusterProfile, config: ParallelConfig) -> tuple[tuple[str, float], ...]:
    """(role, seconds a micro-batch's block saves with it in bf16) of each block Linear that the
    configuration runs in fp8 and would run faster in bf16, in `FP8_LINEARS` order; () where the
    configuration is not fp8, its engine cannot filter, or a filter could not run
    (`fp8_filter.filter_problem`). The block judged is the first transformer block."""
    if config.precision != "fp8" or config.engine not in FP8_FILTER_ENGINES:
        return ()
    blocks = [layer for layer in graph.layers if layer.kind == "block" and layer.tp_split.kind == "block"]
    if not blocks:
        return ()
    block = blocks[0]
    linears = fp8_linears(block, graph.info, config, graph.dtype)
    base_s = _block_s(block, graph, cluster, config)
    slower = []
    for role, fp8 in zip(linear_roles(linears.shapes), linears.in_fp8):
        if not fp8:
            continue
        trial = replace(config, fp8_filter=tuple(sorted({*config.fp8_filter, role})))
        if filter_problem(graph, trial):
            return ()
        saved_s = base_s - _block_s(block, graph, cluster, trial)
        if saved_s > 0:
            slower.append((role, saved_s))
    return tuple(slower)


def suggested_filter(config: ParallelConfig, slower) -> tuple[str, ...]:
    """The configuration's fp8 filter with the roles `slower` added, in its stored order."""
    return stored_fp8_filter(config.precision, config.engine, config.fp8_recipe, (*config.fp8_filter, *slower))


def filter_path(graph, cluster: ClusterProfile, config: ParallelConfig) -> tuple[tuple[str, ...], ...]:
    """The filters from the configuration's own on, each adding every Linear the cost model finds
    slower in fp8 under the one before (`slower_in_fp8`), until none is: leaving k and v alone can
    make q pay its region's input cast by itself, and so be found slower in turn. The block's time
    falls along the path; a step's need not (a shorter backward hides less of the data-parallel
    communication), so `plan --fp8-filter fastest` prices each filter on it as its own candidate
    and the hints simulate each."""
    path = [config.fp8_filter]
    for _ in range(len(FP8_LINEARS)):
        slower = slower_in_fp8(graph, cluster, config)
        if not slower:
            break
        config = replace(config, fp8_filter=suggested_filter(config, [role for role, _ in slower]))
        path.append(config.fp8_filter)
    return tuple(path)
