"""Posing the candidates' problems: each candidate's cost table (`table_cache`), its ILP problem
and a first lower bound on its objective, as `solving.solve_candidates` takes them (`Pending`);
candidates proven not to fit, or dominated by a rule, come back solved as pruned."""
from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

from meshplan.planner.contracts.config import RECOMPUTE, ParallelConfig
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.layer_cost import grad_copy_params
from meshplan.planner.costing.state_memory import grad_copy_bytes_per_param, grad_sync_mode
from meshplan.planner.search.bounds import compute_bound_s
from meshplan.planner.search.ilp.formulation import StageProblem
from meshplan.planner.search.solving import Pending, Solved, floor_shape, min_static_bytes
from meshplan.planner.search.table_cache import TableCache, build_tables, strategies_of
from meshplan.planner.simulation.contention import stream_links
from meshplan.planner.costing.weight_grad import model_weight_share


def build_problems(graph, cluster, candidates, global_batch, precision, pins, limit, layerwise, time_limit_s,
                   workers: int = 1) -> tuple[list[Pending], list[Solved], TableCache]:
    """Cost tables (shared between candidates with the same strategy) and ILP problems: (the
    problems to solve, the candidates pruned already, the tables). With `workers` > 1 and many
    tables, the tables are built over a fork process pool."""
    recompute_options = (pins.recompute,) if pins.recompute else RECOMPUTE
    strategies = strategies_of(candidates)
    sibling_of = {} if layerwise else _zero1_siblings(strategies)
    build = partial(build_tables, graph, cluster, recompute_options=recompute_options, layerwise=layerwise,
                    workers=workers)
    built, too_big = ({}, set()) if layerwise else _static_memory_scan(candidates, strategies, sibling_of, build, limit)
    sibling_of = {st: sibling for st, sibling in sibling_of.items() if sibling not in too_big}
    built_now = [(c, st) for c, st in zip(candidates, strategies)
                 if st not in sibling_of and st not in too_big and st not in built]
    # Most expert layouts only enter the expert-degree rule, which reads compute bounds: their
    # tables are built light first (`LIGHT_RECOMPUTE`), and in full only for the layouts kept.
    light: dict = {}
    if not layerwise and len(recompute_options) > 1 and _expert_layouts_compete(candidates):
        light = build_tables(graph, cluster, [c for c, _ in built_now], [st for _, st in built_now],
                             recompute_options=LIGHT_RECOMPUTE, layerwise=False, workers=workers)
    else:
        built.update(build([c for c, _ in built_now], [st for _, st in built_now]))
    tables = TableCache(graph, cluster, recompute_options, built)
    savings: dict = {}  # `_copy_saving_s`'s, per mesh
    problems, pruned, with_table = [], [], []
    weight_share = model_weight_share(graph)  # the zero-bubble schedules' W share of the backward
    for candidate, strategy in zip(candidates, strategies):
        tables.record(candidate, strategy)
        if strategy in too_big:  # its resident bytes exceed memory at any micro-batch: no table built
            pruned.append(Solved(candidate, math.inf, pruned="memory"))
            continue
        # Replaying a schedule for its step factor is the costly part: until the candidate comes
        # up for solving, its problem carries the floor and its bound is the compute bound at it.
        make_floor = partial(_floor_problem, tables, strategy, candidate, cluster, limit, time_limit_s)
        if strategy in sibling_of:  # its table waits: the ZeRO-1 sibling's compute bounds it
            problems.append(Pending(candidate, _sibling_bound_s(built.get(sibling_of[strategy]) or
                                                                light[sibling_of[strategy]], candidate, graph, cluster,
                                                                savings),
                                    make_floor, weight_share=weight_share))
            continue
        table = built.get(strategy) or light[strategy]
        bound = compute_bound_s(table, floor_shape(candidate), grad_sync_mode(candidate))
        if min_static_bytes(table, candidate.pp) > limit:  # resident bytes: alike in a light table
            pruned.append(Solved(candidate, bound, pruned="memory"))
            continue
        problems.append(Pending(candidate, bound, make_floor, weight_share=weight_share))
        with_table.append(problems[-1])
    problems, dominated = best_expert_degrees(problems)
    if light:
        strategy_of = {id(c): st for c, st in zip(candidates, strategies)}
        _full_tables_of_kept(problems, strategy_of, sibling_of, light, build, tables, graph, cluster, savings)
    kept = {id(item) for item in problems}
    for item in with_table:  # posed only for the expert layouts kept (most MoE candidates are not)
        if id(item) in kept:
            item.floor_problem()
    return problems, pruned + dominated, tables


# The recomputation a light table prices (`build_problems`): every layer's fastest option, so its
# compute bound is the full table's (a test holds them equal); the full table's bound replaces
# it for every candidate kept, so a bound the search prunes with is always the full one.
LIGHT_RECOMPUTE = ("none",)


def _expert_layouts_compete(candidates) -> bool:
    """Whether some candidates differ only in their expert layout (`best_expert_degrees`)."""
    seen = set()
    for c in candidates:
        if c.ep > 1 or c.etp is not None:
            key = _but_ep(c)
            if key in seen:
                return True
            seen.add(key)
    return False


def _sibling_bound_s(sibling, candidate: ParallelConfig, graph, cluster, savings: dict) -> float:
    """The compute bound of a pipelined ZeRO-2/3 candidate from its ZeRO-1 sibling's table: ZeRO-2
    runs the same gathers and optimizer; ZeRO-3 gathers in every pass instead of once in the tail.
    Where the sibling's gradient copies cost more (meshplan's executor: an fp32 accumulation at
    ZeRO-1, a cast at ZeRO-2/3, `state_memory.grad_copy_bytes_per_param`), the difference comes
    off every layer first: each layer's options pay it alike."""
    bound = compute_bound_s(sibling, floor_shape(candidate), "overlap", _copy_saving_s(graph, cluster, candidate, savings))
    if candidate.zero == 3:
        bound -= sibling.least_tail_s(False) / candidate.pp
    return bound


def _copy_saving_s(graph, cluster, candidate: ParallelConfig, savings: dict) -> tuple[float, float]:
    """(over every layer, over one block at most) the seconds a micro-batch's gradient copies
    cost the candidate's ZeRO-1 sibling beyond the candidate (a tied copy counted on the head,
    so never less than the difference); `savings` keeps them per mesh (a search asks for
    thousands of candidates over a few meshes)."""
    saved = grad_copy_bytes_per_param(candidate, zero=1) - grad_copy_bytes_per_param(candidate)
    if saved <= 0:
        return 0.0, 0.0
    key = (candidate.tp, candidate.ep, candidate.expert_tp, saved)
    if key not in savings:
        seconds = [(layer.kind, memory_time_s(saved * grad_copy_params(layer, graph.info, *key[:3],
                                                                       holds_shared=bool(layer.shared_params)),
                                              cluster))
                   for layer in graph.layers]
        blocks = [s for kind, s in seconds if kind == "block"] or [s for _, s in seconds]
        savings[key] = (sum(s for _, s in seconds), max(blocks))
    return savings[key]


def _full_tables_of_kept(problems: list[Pending], strategy_of: dict, sibling_of: dict, light: dict, build,
                         tables: TableCache, graph, cluster, savings: dict) -> None:
    """The full tables of the kept candidates whose bounds came from light ones (theirs or their
    ZeRO-1 sibling's), built now over the pool into `tables`, and each such candidate's bound from them."""
    need: dict = {}
    for item in problems:
        strategy = strategy_of[id(item.candidate)]
        source = sibling_of.get(strategy, strategy)
        if source in light and not tables.is_built(source):  # the candidate only names it (no layerwise meshes)
            need.setdefault(source, item.candidate)
    if need:
        tables.add(build(list(need.values()), list(need)))
    for item in problems:
        strategy = strategy_of[id(item.candidate)]
        if strategy in sibling_of and sibling_of[strategy] in light:
            item.bound_s = _sibling_bound_s(tables.get(sibling_of[strategy]), item.candidate, graph, cluster,
                                            savings)
        elif strategy in light:
            item.bound_s = compute_bound_s(tables.get(strategy), floor_shape(item.candidate),
                                           grad_sync_mode(item.candidate))


def _static_memory_scan(candidates, strategies, sibling_of: dict, build, limit: float) -> tuple[dict, set]:
    """(the tables built, the strategies whose resident bytes alone exceed `limit`).

    Parameters, gradients and optimizer states do not depend on the micro-batch size
    (`static_key`), so one table per group of strategies equal but for it tells whether the
    group's least resident bytes fit (`solving.min_static_bytes`); the tables of groups that do
    not are never built (the table build was the largest cost of a MoE search of many expert layouts)."""
    first: dict = {}
    for candidate, strategy in zip(candidates, strategies):
        if strategy not in sibling_of:
            first.setdefault(static_key(strategy), (candidate, strategy))
    built = build([c for c, _ in first.values()], [st for _, st in first.values()])
    doomed = {key for key, (candidate, strategy) in first.items()
              if min_static_bytes(built[strategy], candidate.pp) > limit}
    return built, {st for st in set(strategies) if static_key(st) in doomed}


def static_key(strategy: ParallelConfig) -> tuple:
    """Every field of a strategy (`table_cache.strategies_of`) but its micro-batch size: what its
    layers' resident bytes (parameters, gradients, optimizer states) depend on."""
    s = strategy
    return (s.tp, s.dp, s.zero, s.recompute, s.sp, s.precision, s.pp, s.shard_group, s.cp, s.ep, s.etp, s.engine,
            s.offload, s.fp8_recipe, s.fp8_filter, s.recompute_modules, s.cp_method)


def _floor_problem(tables: TableCache, strategy, candidate: ParallelConfig, cluster, limit: float,
                   time_limit_s: float) -> StageProblem:
    """The candidate's problem at its floor step factor, its table read (or built) now. A
    `partial` of it waits in each `Pending`: two small objects per candidate, where a closure's
    cells made the garbage collector run twice as often over the search's 20k+ candidates."""
    dp_link, pp_link = stream_links(candidate, cluster.gpus_per_node)
    return StageProblem(tables.get(strategy), floor_shape(candidate), mem_limit_bytes=limit, time_limit_s=time_limit_s,
                        grad_sync=grad_sync_mode(candidate), dp_shares_pp_link=bool(pp_link) and dp_link == pp_link,
                        dp_link=dp_link)


def _zero1_siblings(strategies) -> dict:
    """Pipelined ZeRO-2/3 strategy -> the same strategy at ZeRO-1, where that one is searched too.

    Their layers compute alike and ZeRO-2/3 only add (ZeRO-3: exposed gathers in every pass;
    both: a reduction every micro-batch, which the compute bound leaves out), so the sibling's
    compute bound bounds them (ZeRO-2 gathers once per step and runs the same optimizer, so with
    the sibling's tail; ZeRO-3 without it), and their own tables are built only when the search
    reaches them: most never are."""
    present = set(strategies)
    out = {}
    for strategy in present:
        if strategy.pp > 1 and strategy.zero >= 2 and strategy.dp > 1 and strategy.offload != "params":
            sibling = replace(strategy, zero=1)
            if sibling in present:
                out[strategy] = sibling
    return out


# Expert layouts solved per configuration that differs only in (ep, etp): they change the MoE
# blocks' costs alone, so only the layouts with the smallest lower bounds are worth an ILP.
EXPERT_DEGREES_SOLVED = 1


def best_expert_degrees(problems: list[Pending]) -> tuple[list[Pending], list[Solved]]:
    """Keep, among candidates equal but for ep, the EXPERT_DEGREES_SOLVED with the smallest lower
    bound (ties: the smaller ep); the others are pruned by the bound."""
    if all(item.candidate.ep == 1 and item.candidate.etp is None for item in problems):
        return problems, []  # one expert layout per configuration (a dense model): nothing to compare
    groups: dict = {}
    for item in problems:
        groups.setdefault(_but_ep(item.candidate), []).append(item)
    chosen = set()
    for rivals in groups.values():
        if len(rivals) > 1:
            rivals.sort(key=lambda other: (other.bound_s, other.candidate.ep, -other.candidate.expert_tp))
        chosen.update(id(other) for other in rivals[:EXPERT_DEGREES_SOLVED])
    kept, dropped = [], []
    for item in problems:
        if id(item) in chosen:
            kept.append(item)
        else:
            dropped.append(Solved(item.candidate, item.bound_s, pruned="expert_degree"))  # a rule, not a bound
    return kept, dropped


def _but_ep(c: ParallelConfig) -> tuple:
    """Every field of a candidate but its expert layout, ep and etp (the group `best_expert_degrees`
    compares within)."""
    return (c.gpus, c.global_batch, c.tp, c.pp, c.dp, c.microbatch_size, c.cp, c.zero, c.recompute, c.sp,
            c.schedule, c.virtual_stages, c.precision, c.shard_group, c.cp_method)
