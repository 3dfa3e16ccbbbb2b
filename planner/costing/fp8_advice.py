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
from meshplan.planner.contracts.fp8_choice import (FP8_FILTER_ENGINES, FP8_LINEARS, TORCHTITAN_LINEAR_FQNS,
                                                   stored_fp8_filter)
from meshplan.planner.costing.compute_time import compute_times_s
from meshplan.planner.costing.expert_parallel import dense_part
from meshplan.planner.costing.fp8_filter import fp8_linears, linear_roles
from meshplan.planner.costing.precision import activation_scale


def filter_problem(graph, config: ParallelConfig) -> str | None:
    """Why `config`'s fp8 filter cannot be priced or run on `graph`'s blocks, or None: blocks whose
    Linear shapes are unknown, or torchtitan's tensorwise TP plan, whose Float8ColwiseParallel and
    Float8RowwiseParallel raise on a block Linear left in bf16 (torchao float8_tensor_parallel.py)."""
    if config.precision != "fp8":
        return None
    block = first_block(graph)
    if block is None:
        return None
    linears = fp8_linears(block, graph.info, config, graph.dtype)
    if config.fp8_filter and not linears.shapes:
        return (f"--fp8-filter {','.join(config.fp8_filter)} needs the shapes of {graph.spec}'s block Linears, which "
                "meshplan knows for GPT, Llama and MoE specs and presets (their attention and dense or shared-expert "
                "MLP); this model's blocks are priced with every Linear in fp8: drop --fp8-filter")
    if (config.engine == "torchtitan" and config.fp8_recipe == "tensorwise" and config.tp > 1
            and not linears.everything):
        kept = ", ".join(TORCHTITAN_LINEAR_FQNS.get(role, role) for role, fp8 in
                         zip(linear_roles(linears.shapes), linears.in_fp8) if not fp8)
        return (f"torchtitan's tensorwise Float8 TP plan wraps every block Linear in Float8ColwiseParallel or "
                f"Float8RowwiseParallel, which refuse the Linears this filter leaves in bf16 ({kept}); use "
                f"--fp8-recipe rowwise, --tp 1, or no --fp8-filter")
    return None


def first_block(graph):
    """The model's first transformer block as the fp8 rules see it: a MoE block's dense part
    (attention and shared experts: its routed experts' fp8 is the engine's, `fp8.experts_in_fp8`);
    None without blocks."""
    for layer in graph.layers:
        if layer.kind == "block" and layer.tp_split.kind == "block":
            return dense_part(layer, graph.info) if layer.expert_params else layer
    return None


def _block_s(layer, graph, cluster: ClusterProfile, config: ParallelConfig) -> float:
    fwd_s, bwd_s, _ = compute_times_s(layer, config, cluster, graph.info, activation_scale(config.precision, graph.dtype),
                                      1.0, graph.dtype, graph.attention)
    return fwd_s + bwd_s


def slower_in_fp8(graph, cluster: ClusterProfile, config: ParallelConfig) -> tuple[tuple[str, float], ...]:
    """(role, seconds a micro-batch's block saves with it in bf16) of each block Linear that the
    configuration runs in fp8 and would run faster in bf16, in `FP8_LINEARS` order; () where the
    configuration is not fp8, its engine cannot filter, or a filter could not run
    (`filter_problem`). The block judged is the first transformer block (`first_block`)."""
    if config.precision != "fp8" or config.engine not in FP8_FILTER_ENGINES:
        return ()
    block = first_block(graph)
    if block is None:
        return ()
    linears = fp8_linears(block, graph.info, config, graph.dtype)
    trials = [(role, replace(config, fp8_filter=(*config.fp8_filter, role)))
              for role, fp8 in zip(linear_roles(linears.shapes), linears.in_fp8) if fp8]
    # whether a filter can run depends on filtering something, not on which Linear: asked once
    if not trials or filter_problem(graph, trials[0][1]):
        return ()
    base_s = _block_s(block, graph, cluster, config)
    slower = [(role, base_s - _block_s(block, graph, cluster, trial)) for role, trial in trials]
    return tuple((role, saved_s) for role, saved_s in slower if saved_s > 0)


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


def best_on_path(graph, cluster: ClusterProfile, config: ParallelConfig, predict) -> tuple[tuple[str, ...], float] | None:
    """(filter, step seconds) of the filter on `filter_path` past the configuration's own whose
    step, `predict(filter)` (a `Prediction`), is shortest among those that fit; None without one."""
    fitting = []
    for names in filter_path(graph, cluster, config)[1:]:
        prediction = predict(names)
        if prediction.fits:
            fitting.append((prediction.step_time_s, names))
    if not fitting:
        return None
    step_s, names = min(fitting)
    return names, step_s
