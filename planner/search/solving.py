"""Solving the candidates: a cost table and an ILP per candidate, a compute lower bound on each
ILP's objective, and the batched, pruned solve over a process pool."""
from __future__ import annotations

import contextlib
import heapq
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from meshplan.planner.contracts.config import RECOMPUTE, ParallelConfig
from meshplan.planner.contracts.schedule import schedule_spec
from meshplan.planner.costing.uniform import cost_config
from meshplan.planner.costing.state_memory import grad_sync_mode
from meshplan.planner.simulation.contention import stream_links
from meshplan.planner.costing.tables import CostTable, build_cost_table, costed_config, stream_bytes
from meshplan.planner.simulation.split_backward import model_weight_share
from meshplan.planner.search.bounds import compute_bound_s, memory_bound_s, step_factor_floor
from meshplan.planner.search.candidates import divisors
from meshplan.planner.search.pool import worker_pool
from meshplan.planner.search.ilp.evaluation import evaluate_assignment, expand_counts, heuristic_start
from meshplan.planner.search.ilp.formulation import (PipelineShape, StageProblem, StageSolution, compact_structure,
                                                     solve_stages)


# ParallelConfigs solved between two pruning decisions: fixed, so the result does not depend on the
# number of worker processes.
SOLVE_BATCH = 4



def lower_bound_s(table: CostTable, shape: PipelineShape) -> float:
    """No assignment of `table` to this pipeline can have a smaller ILP objective.

    With S the sum over layers of the fastest option plus the chunks' fixed work, sum_r T_r >= S
    and T_max >= S / p, so the pipeline term is at least F S / p; the transfers add G P, and
    the tail is at least the average per-rank optimizer + gather time plus the fixed work.
    """
    total = table.fastest_sum_s + table.chunk_overhead_s * shape.num_chunks
    tail = table.least_tail_s(False)
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
    if candidate.schedule_spec.textbook_factor:
        return PipelineShape(candidate.pp, m, v, candidate.schedule)
    factor = step_factor(candidate.schedule, candidate.pp, m, v, weight_share=weight_share)
    return PipelineShape(candidate.pp, m, v, candidate.schedule, step_factor=max(factor, candidate.pp / v))


def floor_shape(candidate: ParallelConfig) -> PipelineShape:
    """The candidate's pipeline with `bounds.step_factor_floor` for its step factor (no replay)."""
    return _floor_shape(candidate.schedule, candidate.pp, candidate.num_microbatches, candidate.virtual_stages)


@lru_cache(maxsize=4096)
def _floor_shape(schedule: str, pp: int, m: int, v: int) -> PipelineShape:
    if schedule_spec(schedule).textbook_factor:
        return PipelineShape(pp, m, v, schedule)
    return PipelineShape(pp, m, v, schedule, step_factor=step_factor_floor(schedule, pp, m, v))


def _type_counts(table: CostTable) -> dict[int, int]:
    return dict(table.type_counts)



def min_static_bytes(table: CostTable, pp: int) -> float:
    """Resident bytes of the least loaded rank can be no less than the average."""
    return table.least_static_bytes / pp



@dataclass(frozen=True)
class Solved:
    """A candidate with its ILP solution (or why it has none)."""

    candidate: ParallelConfig
    lower_bound_s: float
    solution: StageSolution | None = None
    # "": solved; "bound": the compute bound; "memory_bound": the memory-aware bound (time once
    # memory forces leaner options); "memory": no assignment fits (`bounds`)
    pruned: str = ""
    problem: StageProblem | None = field(default=None, compare=False, repr=False)  # as solved


class Pending:
    """(candidate, lower bound, problem) as `build_problems` hands them to `solve_candidates`.

    Replaying a schedule for its step factor is the costly part of a problem, so it waits: the
    bound is the compute bound at the floor (`bounds.step_factor_floor`), `floor_problem` carries
    that floor, and `problem` (the third item) replays the schedule the first time it is read.
    `solve_candidates` reads the exact problem only once a candidate comes up for solving."""

    __slots__ = ("candidate", "bound_s", "_floor", "_make_floor", "weight_share", "_exact")

    def __init__(self, candidate: ParallelConfig, bound_s: float, floor_problem: StageProblem | None,
                 weight_share: float = 0.5, make_floor=None):
        self.candidate, self.bound_s, self._floor, self._make_floor = candidate, bound_s, floor_problem, make_floor
        self.weight_share, self._exact = weight_share, None

    @property
    def built(self) -> bool:
        """Whether the cost table exists yet (see `build_problems`: some wait for their turn)."""
        return self._floor is not None

    @property
    def floor_problem(self) -> StageProblem:
        if self._floor is None:
            self._floor = self._make_floor()
        return self._floor

    @property
    def problem(self) -> StageProblem:
        if self._exact is None:
            self._exact = replace(self.floor_problem, shape=pipeline_shape(self.candidate, self.weight_share))
        return self._exact

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int):
        return (self.candidate, self.bound_s, None)[index] if index in (0, 1, -2) else self.problem

    def __iter__(self):
        return iter((self.candidate, self.bound_s, self.problem))


def solve_candidates(problems: list[tuple[ParallelConfig, float, StageProblem]], *, num_keep: int,
                     workers: int = 2, progress=None, seed: bool = True) -> list[Solved]:
    """Solve in order of lower bound, pruning against the `num_keep`-th best objective so far.

    Before the first batch, `seed` evaluates the heuristic assignment of the candidates with the
    smallest bounds (`_seed_threshold`): num_keep distinct candidates with feasible assignments
    of objective at most U prove that the num_keep-th best objective is at most U, so the first
    batches already prune against U and solve with it as their cutoff. Those num_keep candidates
    are solved first: their ILPs then lower the threshold to real objectives before the rest.

    A heap holds the candidates by bound; one whose bound is still the cheap floor (`Pending`
    with exact False) is refined when it reaches the top (exact step factor, memory-aware bound)
    and goes back in. Every bound is a true lower bound on its ILP objective, so once the top of
    the heap cannot beat the threshold, nothing below it can either."""
    with worker_pool(workers, _start_solver) if workers > 1 else contextlib.nullcontext() as pool:
        # the workers load the solver while this process seeds
        return _solve_all(problems, num_keep, progress, seed, pool)


def _solve_all(problems: list, num_keep: int, progress, seed: bool, pool) -> list[Solved]:
    results: list[Solved] = []
    best: list[float] = []  # sorted objectives of feasible solutions
    heap = [(item[1], item[0].sort_key, index, item, 0 if isinstance(item, Pending) else 2, "bound")
            for index, item in enumerate(problems)]
    heapq.heapify(heap)
    seeded, first = _seed_threshold(heap, num_keep, results, progress) if seed else (math.inf, [])
    if first:  # the seeding candidates go first: their ILPs settle the threshold soonest
        chosen = {entry[2] for entry in first}
        heap = [entry for entry in heap if entry[2] not in chosen]
        heapq.heapify(heap)
        first = [(entry[3][0], entry[0], entry[3][2]) for entry in first]
    while heap or first:
        threshold = min(seeded, best[num_keep - 1] if len(best) >= num_keep else math.inf)
        if first:
            batch, first = first[:SOLVE_BATCH], first[SOLVE_BATCH:]
        else:
            batch = _next_batch(heap, threshold, results, progress)
        mapper = pool.map if pool is not None else map
        cutoff = threshold if math.isfinite(threshold) else None
        todo = [replace(b[2], cutoff_s=cutoff) for b in batch]
        for (candidate, bound, problem), solution in zip(batch, mapper(solve_stages, todo)):
            results.append(Solved(candidate, bound, solution, problem=problem))
            if solution.feasible:
                best = sorted(best + [solution.objective_s])
            tick(progress)
    return results


# Candidates whose heuristic assignment `_seed_threshold` evaluates, at most, per kept solution.
SEED_CANDIDATES_PER_KEPT = 6
# Relative slack on the seeded threshold: a candidate whose heuristic assignment is already
# optimal must not be cut off by its own value (HiGHS compares against its cutoff within its
# tolerances), so it only prunes what is clearly worse.
SEED_SLACK = 1e-4


def heuristic_upper_s(problem: StageProblem) -> float:
    """The objective of `ilp.evaluation.heuristic_start`'s assignment when it fits, else inf: an
    upper bound on the problem's ILP optimum (it is one of the ILP's feasible assignments)."""
    structure = compact_structure(problem.table)
    if structure is None or problem.objective != "time":
        return math.inf
    found = heuristic_start(problem, structure)
    if found is None:
        return math.inf
    counts, pinned = found
    chunks, options = expand_counts(counts, structure[0], problem.table.num_layers, problem.shape.num_chunks, pinned)
    objective, _, memory = evaluate_assignment(problem, chunks, options)
    if problem.mem_limit_bytes is not None and max(memory) > problem.mem_limit_bytes:
        return math.inf
    return objective


def _seed_threshold(heap: list, num_keep: int, results: list[Solved], progress) -> tuple[float, list]:
    """A valid pruning threshold before anything is solved: walk the heap in bound order (as
    `_next_batch` does, refining bounds), evaluate each candidate's heuristic assignment, and
    stop once the next bound reaches the num_keep-th smallest objective found (or after
    SEED_CANDIDATES_PER_KEPT * num_keep candidates). The
    num_keep-th smallest of these objectives, one per candidate, is at least the num_keep-th
    best ILP objective, so whatever bounds at or above it cannot be re-ranked. The candidates
    looked at go back on the heap with their refined bounds. Returns (the threshold, the heap
    entries of the num_keep candidates that give it, which `solve_candidates` solves first)."""
    looked, uppers = [], []
    while heap and len(looked) < SEED_CANDIDATES_PER_KEPT * num_keep:
        if len(uppers) >= num_keep and heap[0][0] >= sorted(u for u, _ in uppers)[num_keep - 1]:
            break  # nothing further can lower the threshold
        entry = heapq.heappop(heap)
        bound, key, index, item, level, reason = entry
        if level < 2:
            new_bound, new_reason = _refine(item, level + 1)
            if math.isinf(new_bound):
                results.append(Solved(item[0], new_bound, pruned="memory"))
                tick(progress)
                continue
            if new_bound > bound:
                bound, reason = new_bound, new_reason
            heapq.heappush(heap, (bound, key, index, item, level + 1, reason))
            continue
        looked.append(entry)
        upper = heuristic_upper_s(item[2])
        if math.isfinite(upper):
            uppers.append((upper, len(looked) - 1))
    for entry in looked:
        heapq.heappush(heap, entry)
    if len(uppers) < num_keep:
        return math.inf, []
    uppers.sort()
    return uppers[num_keep - 1][0] * (1 + SEED_SLACK), [looked[index] for _, index in uppers[:num_keep]]


def _next_batch(heap: list, threshold: float, results: list[Solved], progress) -> list[tuple]:
    """Up to SOLVE_BATCH candidates to solve, in order of bound: candidates whose bound reaches
    the threshold are pruned (naming the bound), floor bounds are refined on the way."""
    batch = []
    while heap and len(batch) < SOLVE_BATCH:
        bound, key, index, item, level, reason = heapq.heappop(heap)
        candidate = item[0]
        if bound >= threshold:
            results.append(Solved(candidate, bound, pruned=reason))
            tick(progress)
        elif level < 2:
            new_bound, new_reason = _refine(item, level + 1)
            if math.isinf(new_bound):
                results.append(Solved(candidate, new_bound, pruned="memory"))
                tick(progress)
                continue
            if new_bound > bound:  # every bound holds: keep the strongest
                bound, reason = new_bound, new_reason
            heapq.heappush(heap, (bound, key, index, item, level + 1, reason))
        else:
            batch.append((candidate, bound, item[2]))
    return batch


def _refine(item: Pending, level: int) -> tuple[float, str]:
    """(the candidate's lower bound at `level`, the bound that gives it). Level 1: the memory-aware
    bound at the floor step factor, replaying no schedule; level 2: the exact step factor and
    both bounds with the schedule replayed."""
    late = isinstance(item, Pending) and not item.built
    problem = item.problem if level >= 2 else item.floor_problem
    if late and problem.mem_limit_bytes is not None \
            and min_static_bytes(problem.table, item.candidate.pp) > problem.mem_limit_bytes:
        return math.inf, "memory"  # what `build_problems` checks for the tables it builds at once
    compute_s = compute_bound_s(problem.table, problem.shape, problem.grad_sync)
    memory_s = memory_bound_s(problem.table, problem.shape, problem.mem_limit_bytes,
                              compact_structure(problem.table), problem.grad_sync, replay=level >= 2)
    return max(compute_s, memory_s), ("bound" if compute_s >= memory_s else "memory_bound")


def _start_solver() -> None:
    """A solving worker (`pool.worker_pool` leaves Ctrl-C to the parent) loads the ILP solver
    before its first solve."""
    try:
        import highspy  # noqa: F401
        import pulp  # noqa: F401
    except ImportError:  # the backend says which solver is missing, when one is needed
        pass


def tick(progress) -> None:
    if progress is not None:
        progress.update(1)



def build_problems(graph, cluster, candidates, global_batch, precision, pins, limit, layerwise, time_limit_s,
                   workers: int = 1):
    """Cost tables (shared between candidates with the same strategy) and ILP problems. With
    `workers` > 1 and many tables, the tables are built over a fork process pool."""
    recompute_options = (pins.recompute,) if pins.recompute else RECOMPUTE
    strategies = _strategies(candidates)
    sibling_of = {} if layerwise else _zero1_siblings(strategies)
    built_now = [(c, st) for c, st in zip(candidates, strategies) if st not in sibling_of]
    table_cache = _build_tables(graph, cluster, [c for c, _ in built_now], [st for _, st in built_now],
                                recompute_options, layerwise, workers)
    late = _LateTables(graph, cluster, recompute_options, table_cache)
    tables: dict[ParallelConfig, CostTable] = _CandidateTables(late)
    problems, pruned = [], []
    weight_share = model_weight_share(graph)  # the zero-bubble schedules' W share of the backward
    for candidate, strategy in zip(candidates, strategies):
        # Replaying a schedule for its step factor is the costly part: until the candidate comes
        # up for solving, its problem carries the floor and its bound is the compute bound at it.
        shape = floor_shape(candidate)
        grad_sync = grad_sync_mode(candidate)
        dp_link, pp_link = stream_links(candidate, cluster.gpus_per_node)

        def make_floor(strategy=strategy, shape=shape, grad_sync=grad_sync,
                       shares=bool(pp_link) and dp_link == pp_link):
            return StageProblem(late[strategy], shape, mem_limit_bytes=limit, time_limit_s=time_limit_s,
                                grad_sync=grad_sync, dp_shares_pp_link=shares)

        tables.strategy_of[candidate] = strategy
        if strategy in sibling_of:  # its table waits: the ZeRO-1 sibling's compute bounds it
            sibling = table_cache[sibling_of[strategy]]
            bound = compute_bound_s(sibling, shape, "overlap")  # ZeRO-2: the same gathers and optimizer
            if strategy.zero == 3:  # which gathers in every pass instead of once in the tail
                bound -= sibling.least_tail_s(False) / candidate.pp
            problems.append(Pending(candidate, bound, None, weight_share=weight_share, make_floor=make_floor))
            continue
        table = table_cache[strategy]
        bound = compute_bound_s(table, shape, grad_sync)
        if min_static_bytes(table, candidate.pp) > limit:
            pruned.append(Solved(candidate, bound, pruned="memory"))
            continue
        problems.append(Pending(candidate, bound, make_floor(), weight_share=weight_share))
    problems, dominated = best_expert_degrees(problems)
    return problems, pruned + dominated, tables


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
        if strategy.pp > 1 and strategy.zero >= 2 and strategy.dp > 1:
            sibling = replace(strategy, zero=1)
            if sibling in present:
                out[strategy] = sibling
    return out


class _LateTables(dict):
    """strategy -> CostTable: the tables built at once, and the others built on first use."""

    def __init__(self, graph, cluster, recompute_options, built: dict):
        super().__init__(built)
        self._job, self._cache = (graph, cluster, recompute_options), {}

    def __missing__(self, strategy):
        graph, cluster, recompute_options = self._job
        table = self[strategy] = build_cost_table(graph, cluster, strategy, recompute_options, cache=self._cache)
        return table


class _CandidateTables(dict):
    """candidate -> its CostTable, looked up (and built, if it waited) on first use."""

    def __init__(self, late: _LateTables):
        super().__init__()
        self.late, self.strategy_of = late, {}

    def __missing__(self, candidate):
        table = self[candidate] = self.late[self.strategy_of[candidate]]
        return table


def _strategies(candidates) -> list:
    """`cost_config` of every candidate, one object per distinct cost."""
    seen: dict = {}
    out = []
    for c in candidates:
        key = (c.tp, c.dp, c.zero, c.recompute, c.sp, c.microbatch_size, c.precision, c.pp, c.shard_group, c.cp, c.ep)
        strategy = seen.get(key)
        if strategy is None:
            strategy = seen[key] = cost_config(c)
        out.append(strategy)
    return out


# Below this many distinct strategies the tables are built in process (a pool costs more).
PARALLEL_TABLES_MIN = 400
_TABLE_JOB: tuple | None = None  # (graph, cluster, recompute options), inherited by forked workers


def _build_tables(graph, cluster, candidates, strategies, recompute_options, layerwise, workers) -> dict:
    """strategy -> CostTable for every candidate's strategy (`tables.build_cost_table`)."""
    global _TABLE_JOB
    jobs: dict = {}
    for candidate, strategy in zip(candidates, strategies):
        if strategy not in jobs:
            # per-layer degrees are for analysis of (tp, dp) meshes; context- and expert-parallel
            # candidates keep theirs
            jobs[strategy] = (_layerwise_meshes(candidate, cluster)
                              if layerwise and candidate.cp == 1 and candidate.ep == 1 else ())
    todo = list(jobs.items())
    _TABLE_JOB = (graph, cluster, recompute_options)
    try:
        if workers > 1 and len(todo) >= PARALLEL_TABLES_MIN:
            # strategies equal but for ep, or for pp > 1, next to each other: they share their
            # dense layers' costs, or all their layers' (`tables.build_cost_table`'s cache)
            todo.sort(key=lambda job: (replace(costed_config(job[0]), ep=1).__repr__(), job[0].pp,
                                       job[0].ep))
            size = -(-len(todo) // (4 * workers))
            pieces = [todo[start:start + size] for start in range(0, len(todo), size)]
            shared = build_cost_table(graph, cluster, todo[0][0], recompute_options, layerwise_meshes=todo[0][1])
            # what differs between tables comes back; names and layer types are the graph's
            built = [replace(shared, types=types, p2p_s=p2p_s, boundary_bytes=boundary_bytes,
                             chunk_overhead_s=chunk_s, rank_fixed_s=fixed_s)
                     for piece in _map_in_pool(_table_parts_of, pieces, workers)
                     for types, p2p_s, boundary_bytes, chunk_s, fixed_s in piece]
        else:
            built = _tables_of(todo)
    finally:
        _TABLE_JOB = None
    out = {}
    for (strategy, meshes), table in zip(todo, built):
        if meshes:
            table = replace(table, reshard_s=_reshard_s(table, _candidate_mesh(strategy), cluster))
        out[strategy] = table
    return out


def _tables_of(jobs: list) -> list[CostTable]:
    graph, cluster, recompute_options = _TABLE_JOB
    cache: dict = {}  # option costs shared between tables (`tables.build_cost_table`)
    return [build_cost_table(graph, cluster, strategy, recompute_options, layerwise_meshes=meshes, cache=cache)
            for strategy, meshes in jobs]


def _table_parts_of(jobs: list) -> list[tuple]:
    return [(t.types, t.p2p_s, t.boundary_bytes, t.chunk_overhead_s, t.rank_fixed_s) for t in _tables_of(jobs)]


def _candidate_mesh(strategy):
    """What `_reshard_s` reads of a candidate (tp, dp), from its strategy."""
    from types import SimpleNamespace

    return SimpleNamespace(tp=strategy.tp, dp=strategy.dp)


def _map_in_pool(fn, items: list, workers: int) -> list:
    """fn over items in a fork process pool, in order; Ctrl-C stops the workers at once."""
    with worker_pool(workers) as pool:
        return list(pool.map(fn, items))


# Expert-parallel degrees solved per configuration that differs only in ep: EP changes the MoE
# blocks' costs alone, so only the degrees with the smallest lower bounds are worth an ILP.
EXPERT_DEGREES_SOLVED = 1


def best_expert_degrees(problems: list) -> tuple[list, list[Solved]]:
    """Keep, among candidates equal but for ep, the EXPERT_DEGREES_SOLVED with the smallest lower
    bound (ties: the smaller ep); the others are pruned by the bound."""
    groups: dict = {}
    for item in problems:
        groups.setdefault(_but_ep(item[0]), []).append(item)
    chosen = set()
    for rivals in groups.values():
        if len(rivals) > 1:
            rivals.sort(key=lambda other: (other[1], other[0].ep))
        chosen.update(id(other) for other in rivals[:EXPERT_DEGREES_SOLVED])
    kept, dropped = [], []
    for item in problems:
        if id(item) in chosen:
            kept.append(item)
        else:
            dropped.append(Solved(item[0], item[1], pruned="expert_degree"))  # a rule, not a bound
    return kept, dropped



def _but_ep(c: ParallelConfig) -> tuple:
    """Every field of a candidate but ep (the group `best_expert_degrees` compares within)."""
    return (c.gpus, c.global_batch, c.tp, c.pp, c.dp, c.microbatch_size, c.cp, c.zero, c.recompute, c.sp,
            c.schedule, c.virtual_stages, c.precision, c.shard_group)


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
