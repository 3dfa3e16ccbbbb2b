"""Solving the candidates: a cost table and an ILP per candidate, a compute lower bound on each
ILP's objective, and the batched, pruned solve over a process pool."""
from __future__ import annotations

import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from meshplan.planner.contracts.config import RECOMPUTE, ParallelConfig
from meshplan.planner.costing.pipeline import strategy_for
from meshplan.planner.costing.state_memory import grad_sync_mode
from meshplan.planner.costing.tables import CostTable, build_cost_table, stream_bytes
from meshplan.planner.simulation.split_backward import model_weight_share
from meshplan.planner.search.candidates import divisors
from meshplan.planner.search.ilp.formulation import PipelineShape, StageProblem, StageSolution, solve_stages


# ParallelConfigs solved between two pruning decisions: fixed, so the result does not depend on the
# number of worker processes.
SOLVE_BATCH = 4



def lower_bound_s(table: CostTable, shape: PipelineShape) -> float:
    """No assignment of `table` to this pipeline can have a smaller ILP objective.

    With S the sum over layers of the fastest option plus the chunks' fixed work, sum_r T_r >= S
    and T_max >= S / p, so the pipeline term is at least F S / p; the transfers add G P, and
    the tail is at least the average per-rank optimizer + gather time plus the fixed work.
    """
    counts = _type_counts(table)
    total = sum(n * table.types[t].min_time_s() for t, n in counts.items()) + table.chunk_overhead_s * shape.num_chunks
    tail = sum(n * min(o.param_gather_s + o.optimizer_s for o in table.types[t].options) for t, n in counts.items())
    slowest_weight, sum_weight = shape.weights
    pp = shape.num_stages
    return ((slowest_weight / pp + sum_weight) * total + shape.transfers_on_path * table.p2p_s
            + tail / pp + table.rank_fixed_s)


def pipeline_shape(candidate: ParallelConfig, weight_share: float = 0.5) -> PipelineShape:
    """The candidate's pipeline with the step factor its schedule really plays (1F1B and GPipe:
    m + p - 1; torch's interleaved and zero-bubble schedules as the simulator plays them, see
    `simulation.factors`, the latter with the model's W share of the backward)."""
    from meshplan.planner.simulation.factors import step_factor

    m, v = candidate.num_microbatches, candidate.virtual_stages
    if candidate.schedule in ("1f1b", "gpipe"):
        return PipelineShape(candidate.pp, m, v, candidate.schedule)
    factor = step_factor(candidate.schedule, candidate.pp, m, v, weight_share=weight_share)
    return PipelineShape(candidate.pp, m, v, candidate.schedule, step_factor=max(factor, candidate.pp / v))


def _type_counts(table: CostTable) -> dict[int, int]:
    counts: dict[int, int] = {}
    for t in table.layer_type:
        counts[t] = counts.get(t, 0) + 1
    return counts



def min_static_bytes(table: CostTable, pp: int) -> float:
    """Resident bytes of the least loaded rank can be no less than the average."""
    return sum(n * min(o.static_bytes for o in table.types[t].options) for t, n in _type_counts(table).items()) / pp



@dataclass(frozen=True)
class Solved:
    """A candidate with its ILP solution (or why it has none)."""

    candidate: ParallelConfig
    lower_bound_s: float
    solution: StageSolution | None = None
    pruned: str = ""  # "", "bound", "memory"



def solve_candidates(problems: list[tuple[ParallelConfig, float, StageProblem]], *, num_keep: int,
                     workers: int = 2, progress=None) -> list[Solved]:
    """Solve in order of lower bound, pruning against the `num_keep`-th best objective so far."""
    order = sorted(problems, key=lambda item: (item[1], item[0].sort_key))
    results: list[Solved] = []
    best: list[float] = []  # sorted objectives of feasible solutions
    batch_size = SOLVE_BATCH
    pool = (ProcessPoolExecutor(max_workers=workers, mp_context=_fork_context(), initializer=_ignore_interrupt)
            if workers > 1 else None)
    try:
        index = 0
        while index < len(order):
            threshold = best[num_keep - 1] if len(best) >= num_keep else math.inf
            batch = []
            while index < len(order) and len(batch) < batch_size:
                candidate, bound, problem = order[index]
                index += 1
                if bound >= threshold:
                    results.append(Solved(candidate, bound, pruned="bound"))
                    tick(progress)
                else:
                    batch.append((candidate, bound, problem))
            mapper = pool.map if pool is not None else map
            cutoff = threshold if math.isfinite(threshold) else None
            todo = [replace(b[2], cutoff_s=cutoff) for b in batch]
            for (candidate, bound, _), solution in zip(batch, mapper(solve_stages, todo)):
                results.append(Solved(candidate, bound, solution))
                if solution.feasible:
                    best = sorted(best + [solution.objective_s])
                tick(progress)
    except KeyboardInterrupt:  # Ctrl-C: stop the workers now rather than wait for their solves
        if pool is not None:
            for process in list(getattr(pool, "_processes", {}).values()):
                process.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
            pool = None
        raise
    finally:
        if pool is not None:
            pool.shutdown()
    return results


def _ignore_interrupt() -> None:
    """Workers leave Ctrl-C (SIGINT to the whole process group) to the parent, which stops them."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)



def _fork_context():
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else methods[0])



def tick(progress) -> None:
    if progress is not None:
        progress.update(1)



def build_problems(graph, cluster, candidates, global_batch, precision, pins, limit, layerwise, time_limit_s):
    """Cost tables (shared between candidates with the same strategy) and ILP problems."""
    recompute_options = (pins.recompute,) if pins.recompute else RECOMPUTE
    table_cache: dict = {}
    tables: dict[ParallelConfig, CostTable] = {}
    problems, pruned = [], []
    weight_share = model_weight_share(graph)  # the zero-bubble schedules' W share of the backward
    for candidate in candidates:
        strategy = strategy_for(candidate)
        if strategy not in table_cache:
            # per-layer degrees are for analysis of (tp, dp) meshes; context-parallel candidates keep theirs
            meshes = _layerwise_meshes(candidate, cluster) if layerwise and candidate.cp == 1 else ()
            table = build_cost_table(graph, cluster, strategy, recompute_options, layerwise_meshes=meshes)
            if meshes:
                table = replace(table, reshard_s=_reshard_s(table, candidate, cluster))
            table_cache[strategy] = table
        table = tables[candidate] = table_cache[strategy]
        shape = pipeline_shape(candidate, weight_share)
        bound = lower_bound_s(table, shape)
        if min_static_bytes(table, candidate.pp) > limit:
            pruned.append(Solved(candidate, bound, pruned="memory"))
            continue
        problems.append((candidate, bound, StageProblem(table, shape, mem_limit_bytes=limit,
                                                        time_limit_s=time_limit_s,
                                                        grad_sync=grad_sync_mode(candidate))))
    return problems, pruned, tables



def _layerwise_meshes(candidate: ParallelConfig, cluster) -> tuple[tuple[int, int], ...]:
    """(tp, dp) pairs with the candidate's tp * dp that a layer may use in a layerwise plan; TP
    groups stay inside a node, as everywhere else."""
    per_stage = candidate.tp * candidate.dp
    return tuple((tp, per_stage // tp) for tp in divisors(per_stage)
                 if tp <= candidate.tp * 8 and cluster.gpus_per_node % tp == 0)


def _reshard_s(table: CostTable, candidate: ParallelConfig, cluster) -> float:
    """Moving one micro-batch's boundary activation between layouts inside a stage (all-to-all)."""
    from meshplan.planner.costing.collectives import all_gather_time_s

    group = candidate.tp * candidate.dp
    if group == 1:
        return 0.0
    return all_gather_time_s(stream_bytes(table.types, table.layer_type), group, cluster.link_for_group(group))
