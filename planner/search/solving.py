"""Solving the candidates: an ILP per candidate, lower bounds on each ILP's objective, and the
batched, pruned solve over a process pool. `problems.build_problems` poses the candidates'
problems (`Pending`); `solve_candidates` solves them in order of bound."""
from __future__ import annotations

import contextlib
import heapq
import math
from concurrent.futures import as_completed
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable, NamedTuple

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.schedule import schedule_spec
from meshplan.planner.costing.tables import CostTable
from meshplan.planner.search.bounds import bound_table, compute_bound_s, memory_bound_s, step_factor_floor
from meshplan.planner.search.reduction_bound import reduction_bound_s
from meshplan.planner.search.pool import worker_pool
from meshplan.planner.simulation import replay_memo
from meshplan.planner.search.ilp.evaluation import (evaluate_assignment, expand_counts, heuristic_start, live_vectors,
                                                   memory_of_assignment)
from meshplan.planner.search.ilp.formulation import (PipelineShape, StageProblem, StageSolution, pinned_structure,
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
    # memory forces leaner options); "memory": no assignment fits (`bounds`); "host_memory": the
    # offloaded states cannot fit in host memory (`offloading.prune_host_memory`)
    pruned: str = ""
    problem: StageProblem | None = field(default=None, compare=False, repr=False)  # as solved


class Pending:
    """A candidate, a lower bound on its ILP objective, and its ILP problem, posed late.

    Replaying a schedule for its step factor is the costly part of a problem, so it waits: the
    bound is the compute bound at the floor (`bounds.step_factor_floor`), `floor_problem()`
    carries that floor, and `exact_problem()` replays the schedule the first time it is called,
    which `solve_candidates` does only once the candidate comes up for solving. A candidate
    whose table waits too (`problems.build_problems`: bounded by its ZeRO-1 sibling) has its
    table built by the first `floor_problem()`."""

    __slots__ = ("candidate", "bound_s", "weight_share", "_make_floor", "_floor", "_exact")

    def __init__(self, candidate: ParallelConfig, bound_s: float, make_floor: Callable[[], StageProblem], *,
                 weight_share: float = 0.5, floor_problem: StageProblem | None = None):
        self.candidate, self.bound_s, self.weight_share = candidate, bound_s, weight_share
        self._make_floor, self._floor, self._exact = make_floor, floor_problem, None

    @property
    def built(self) -> bool:
        """Whether the floor problem, and so the cost table, exists yet."""
        return self._floor is not None

    def floor_problem(self) -> StageProblem:
        """The problem at the floor step factor (no schedule replayed)."""
        if self._floor is None:
            self._floor = self._make_floor()
        return self._floor

    def exact_problem(self) -> StageProblem:
        """The problem at the step factor its schedule really plays (`pipeline_shape`)."""
        if self._exact is None:
            self._exact = replace(self.floor_problem(), shape=pipeline_shape(self.candidate, self.weight_share))
        return self._exact


@dataclass(frozen=True)
class Ready:
    """A candidate with its exact problem and a lower bound on its objective: nothing to refine
    (a re-solve with another limit or objective)."""

    candidate: ParallelConfig
    bound_s: float
    problem: StageProblem

    def exact_problem(self) -> StageProblem:
        return self.problem


# How far a heap entry's bound is refined (`_refine`): the compute bound at the floor step
# factor, the memory-aware bound at the floor, both at the exact step factor (schedule replayed).
FLOOR, FLOOR_MEMORY, EXACT = 0, 1, 2


class _Entry(NamedTuple):
    """A candidate in `solve_candidates`' heap, by bound (ties: its sort key, then its place).

    A NamedTuple rather than a dataclass: the heap compares entries as tuples, in C; a
    dataclass's generated `__lt__` makes pushing and popping 23k entries (llama3-70b on 256
    GPUs) about 3x slower, half a second more. `index` is unique, so the fields after it are
    never compared."""

    bound_s: float
    sort_key: tuple
    index: int
    item: Pending | Ready
    level: int
    reason: str = "bound"  # the bound that gives bound_s (a Solved.pruned)


def solve_candidates(problems: list[Pending | Ready], *, num_keep: int, workers: int = 2, progress=None,
                     seed: bool = True) -> list[Solved]:
    """Solve in order of lower bound, pruning against the `num_keep`-th best objective so far.

    Before the first batch, `seed` evaluates the heuristic assignment of the candidates with the
    smallest bounds (`_seed_threshold`): num_keep distinct candidates with feasible assignments
    of objective at most U prove that the num_keep-th best objective is at most U, so the first
    batches already prune against U and solve with it as their cutoff. Those num_keep candidates
    are solved first: their ILPs then lower the threshold to real objectives before the rest.

    A heap holds the candidates by bound; a `Pending` one whose bound is not yet EXACT is refined
    when it reaches the top (memory-aware bound, exact step factor) and goes back in. Every bound
    is a true lower bound on its ILP objective, so once the top of the heap cannot beat the
    threshold, nothing below it can either."""
    with worker_pool(workers, _start_solver) if workers > 1 else contextlib.nullcontext() as pool:
        # the workers load the solver while this process seeds
        return _solve_all(problems, num_keep, progress, seed, pool)


def _solve_all(problems: list[Pending | Ready], num_keep: int, progress, seed: bool, pool) -> list[Solved]:
    """The loop of `solve_candidates`. A batch's contenders' second solves (`_screen`) run beside
    the next batch's screens and are settled once those end: the next batch is chosen, and its
    contenders judged, against the objectives the batch's screens found (each a feasible
    assignment, so at least the candidate's optimum: the threshold they give prunes no less
    safely), which keeps both workers busy while a long second solve closes its gap."""
    results: list[Solved] = []
    best: dict[int, float] = {}  # entry index -> objective of its best feasible solution so far
    heap = [_Entry(item.bound_s, item.candidate.sort_key, index, item, FLOOR if isinstance(item, Pending) else EXACT)
            for index, item in enumerate(problems)]
    heapq.heapify(heap)
    seeded, first = _seed_threshold(heap, num_keep, results, progress) if seed else (math.inf, [])
    if first:  # the seeding candidates go first: their ILPs settle the threshold soonest
        chosen = {entry.index for entry in first}
        heap = [entry for entry in heap if entry.index not in chosen]
        heapq.heapify(heap)
    in_flight: _Flight | None = None
    while heap or first or in_flight is not None:
        threshold = min(seeded, _kth_best(best, num_keep))
        if first:
            batch, first = first[:SOLVE_BATCH], first[SOLVE_BATCH:]
        else:
            batch = _next_batch(heap, threshold, results, progress)
        flight = None
        if batch:
            cutoff = threshold if math.isfinite(threshold) else None
            posed = [entry.item.exact_problem() for entry in batch]
            todo = [replace(problem, cutoff_s=cutoff) for problem in posed]
            screens, seconds = _screen(todo, min(best.values(), default=math.inf), pool)
            for entry, solution in zip(batch, screens):
                _keep_best(best, entry.index, solution)
            flight = _Flight(batch, posed, screens, seconds)
        if in_flight is not None:
            _settle(in_flight, results, best, progress)
        in_flight = flight
    return results


def _kth_best(best: dict[int, float], k: int) -> float:
    """The k-th smallest objective found (one per candidate), inf with fewer than k."""
    return sorted(best.values())[k - 1] if len(best) >= k else math.inf


class _Flight(NamedTuple):
    """A screened batch: its entries, their problems as posed, the screens' solutions and the
    second solves still running (`_screen`)."""

    batch: list
    posed: list[StageProblem]
    screens: list[StageSolution]
    seconds: dict


def _settle(flight: _Flight, results: list[Solved], best: dict[int, float], progress) -> None:
    """The batch's solutions, each the better of its screen and its second solve, into `results`
    and `best`."""
    for entry, problem, solution in zip(flight.batch, flight.posed, _better(flight.screens, flight.seconds)):
        results.append(Solved(entry.item.candidate, entry.bound_s, solution, problem=problem))
        _keep_best(best, entry.index, solution)
        tick(progress)


def _keep_best(best: dict[int, float], index: int, solution: StageSolution) -> None:
    """`best[index]`: the smallest objective of the entry's feasible solutions so far."""
    if solution.feasible:
        best[index] = min(best.get(index, math.inf), solution.objective_s)


# A candidate's first solve gets this share of its time limit (the screen). One stopped there
# whose proven bound is CONTENDER_WINDOW above the best objective so far is taken as one that
# cannot win, as the ILP's cutoff compares the same objectives: the search's steps and the
# simulator's agree within 0.7% (`bench_ilp_vs_simulator`). It stays a runner-up, re-ranked with
# its assignment and its gap; any other is solved again with the whole limit.
SCREEN_SHARE = 0.2
CONTENDER_WINDOW = 0.02


def proven_bound_s(solution: StageSolution) -> float:
    """What a stopped solve proves: no assignment of the candidate beats its ILP objective less
    the relative gap (the solver's dual bound); -inf where the solve proved nothing, or where it
    solved the envelope of periodic blocks, whose bound is not one on the real blocks (their
    costs are at most the envelope's)."""
    if solution.status == "optimal":
        return solution.objective_s
    if (solution.status != "time_limit" or solution.formulation == "envelope"
            or not math.isfinite(solution.model_objective) or math.isnan(solution.gap)):
        return -math.inf
    return solution.model_objective * (1.0 - solution.gap)


def can_win(solution: StageSolution, best_s: float) -> bool:
    """Whether a candidate solved to `solution` may still be the fastest plan against the best
    objective `best_s` found (see CONTENDER_WINDOW)."""
    return proven_bound_s(solution) < best_s * (1.0 + CONTENDER_WINDOW)


def _screen(problems: list[StageProblem], best_s: float, pool) -> tuple[list[StageSolution], dict]:
    """Solve `problems` at SCREEN_SHARE of their time limits, then once more with the whole limit
    those that stopped without a solution or that may still win against `best_s` (the best
    objective before the batch: the decision does not depend on the order solves finish in).
    Only the compact formulation's problems are screened (`pinned_structure`): the others, solved
    per layer (slow to prove anything in a fifth of the limit) or on an envelope (whose bound
    decides nothing, `proven_bound_s`), get their whole limit at once. A second solve starts from
    the screen's assignment (`StageProblem.start`); with a pool it is queued as soon as its screen
    ends, beside the batch's other screens, and returned still running (a future, by index) once
    every screen has ended; without one it is solved at once."""
    screen = [pinned_structure(problem.table, problem.shape) is not None for problem in problems]
    screened = [replace(problem, time_limit_s=problem.time_limit_s * SCREEN_SHARE) if short else problem
                for problem, short in zip(problems, screen)]

    def again(index: int, solution: StageSolution) -> bool:
        return screen[index] and (solution.status == "no_solution"
                                  or (solution.status == "time_limit" and can_win(solution, best_s)))
    if pool is None:
        solutions = [solve_stages(problem) for problem in screened]
        return solutions, {index: solve_stages(_from(problems[index], solution))
                           for index, solution in enumerate(solutions) if again(index, solution)}
    solutions: list = [None] * len(problems)
    queued = {pool.submit(_solve_shipped, _shipped(problem)): index for index, problem in enumerate(screened)}
    seconds = {}
    for future in as_completed(queued):
        index = queued[future]
        solutions[index] = future.result()
        if again(index, solutions[index]):
            seconds[index] = pool.submit(_solve_shipped, _shipped(_from(problems[index], solutions[index])))
    return solutions, seconds


def _better(screens: list[StageSolution], seconds: dict) -> list[StageSolution]:
    """Each problem's screen, or its second solve (waited for where it still runs) where that found
    a solution the screen did not or one no worse."""
    solutions = list(screens)
    for index, second in seconds.items():
        solution = second if isinstance(second, StageSolution) else second.result()
        previous = solutions[index]
        if not previous.feasible or (solution.feasible and solution.objective_s <= previous.objective_s):
            solutions[index] = solution
    return solutions


def _from(problem: StageProblem, screen: StageSolution) -> StageProblem:
    """The problem's second solve, started from the assignment its screen found, if any."""
    return replace(problem, start=(screen.chunk_of_layer, screen.option_of_layer)) if screen.feasible else problem


def _shipped(problem: StageProblem) -> tuple[StageProblem, dict]:
    """A problem and the schedule replays it needs: a worker has none of those this process made
    since it forked."""
    return problem, replay_memo.entries(problem.shape.replay_key)


# Candidates whose heuristic assignment `_seed_threshold` evaluates, at most, per kept solution.
SEED_CANDIDATES_PER_KEPT = 6
# Relative slack on the seeded threshold: a candidate whose heuristic assignment is already
# optimal must not be cut off by its own value (HiGHS compares against its cutoff within its
# tolerances), so it only prunes what is clearly worse.
SEED_SLACK = 1e-4


def heuristic_upper_s(problem: StageProblem) -> float:
    """The objective of a heuristic assignment when it fits, else inf: an upper bound on the
    problem's ILP optimum (it is one of the ILP's feasible assignments). The assignment is
    `ilp.evaluation.heuristic_start`'s where the ILP is the compact one (`formulation.pinned_structure`:
    its assignment is one the compact ILP accepts), else `per_layer_heuristic`'s."""
    if problem.objective != "time":
        return math.inf
    structure = pinned_structure(problem.table, problem.shape)
    if structure is None:
        found = per_layer_heuristic(problem)
        if found is None:
            return math.inf
        chunks, options = found
    else:
        found = heuristic_start(problem, structure)
        if found is None:
            return math.inf
        counts, pinned = found
        chunks, options = expand_counts(counts, structure[0], problem.table.num_layers, problem.shape.num_chunks,
                                        pinned)
    objective, _, memory = evaluate_assignment(problem, chunks, options)
    if problem.mem_limit_bytes is not None and max(memory) > problem.mem_limit_bytes:
        return math.inf
    return objective


def per_layer_heuristic(problem: StageProblem) -> tuple[list[int], list[int]] | None:
    """(chunk_of_layer, option_of_layer) of a table without a compact structure (a dense-first
    mixture of experts), or None: contiguous chunks of about equal time at every layer's fastest
    option; then, while a rank is over the memory limit, its layer whose leanest option saves the
    most activation bytes switched to it."""
    table, shape = problem.table, problem.shape
    num_layers, num_chunks = table.num_layers, shape.num_chunks
    if num_layers < num_chunks:
        return None
    kinds = [table.types[t].options for t in table.layer_type]
    options = [min(range(len(o)), key=lambda i, o=o: (o[i].time_s, i)) for o in kinds]
    lean = [min(range(len(o)), key=lambda i, o=o: (o[i].act_bytes, o[i].time_s, i)) for o in kinds]
    times = [kinds[layer][options[layer]].time_s for layer in range(num_layers)]
    total_s, done_s, chunks = sum(times), 0.0, []
    for layer, time_s in enumerate(times):  # the chunk whose share of the time holds the layer's middle
        chunk = min(num_chunks - 1, int(num_chunks * (done_s + time_s / 2) / total_s)) if total_s > 0 else 0
        chunks.append(max(chunk, chunks[-1] if chunks else 0))
        done_s += time_s
    if len(set(chunks)) < num_chunks:  # a chunk left empty: equal layer counts instead
        chunks = [layer * num_chunks // num_layers for layer in range(num_layers)]
    limit = problem.mem_limit_bytes
    peaks = [live_vectors(shape, rank) for rank in range(shape.num_stages)]
    for _ in range(num_layers + 1):
        memory = memory_of_assignment(problem, chunks, options, peaks)
        over = [rank for rank in range(shape.num_stages) if limit is not None and memory[rank] > limit]
        if not over:
            return chunks, options
        movable = [layer for layer in range(num_layers)
                   if shape.rank_of(chunks[layer]) == over[0] and options[layer] != lean[layer]]
        if not movable:
            return None
        layer = max(movable, key=lambda i: (kinds[i][options[i]].act_bytes - kinds[i][lean[i]].act_bytes, -i))
        options[layer] = lean[layer]
    return None


def _seed_threshold(heap: list[_Entry], num_keep: int, results: list[Solved], progress) -> tuple[float, list[_Entry]]:
    """A valid pruning threshold before anything is solved: walk the heap in bound order (as
    `_next_batch` does, refining bounds), evaluate each candidate's heuristic assignment, and
    stop once the next bound reaches the num_keep-th smallest objective found (or after
    SEED_CANDIDATES_PER_KEPT * num_keep candidates). The
    num_keep-th smallest of these objectives, one per candidate, is at least the num_keep-th
    best ILP objective, so whatever bounds at or above it cannot be re-ranked. The candidates
    looked at go back on the heap with their refined bounds. Returns (the threshold, the heap
    entries of the num_keep candidates that give it, which `solve_candidates` solves first)."""
    looked: list[_Entry] = []
    uppers: list[tuple[float, int]] = []
    while heap and len(looked) < SEED_CANDIDATES_PER_KEPT * num_keep:
        if len(uppers) >= num_keep and heap[0].bound_s >= sorted(u for u, _ in uppers)[num_keep - 1]:
            break  # nothing further can lower the threshold
        entry = heapq.heappop(heap)
        if entry.level < EXACT:
            _refine_onto(heap, entry, results, progress)
            continue
        looked.append(entry)
        upper = heuristic_upper_s(entry.item.exact_problem())
        if math.isfinite(upper):
            uppers.append((upper, len(looked) - 1))
    for entry in looked:
        heapq.heappush(heap, entry)
    if len(uppers) < num_keep:
        return math.inf, []
    uppers.sort()
    return uppers[num_keep - 1][0] * (1 + SEED_SLACK), [looked[index] for _, index in uppers[:num_keep]]


def _next_batch(heap: list[_Entry], threshold: float, results: list[Solved], progress) -> list[_Entry]:
    """Up to SOLVE_BATCH candidates to solve, in order of bound: candidates whose bound reaches
    the threshold are pruned (naming the bound), floor bounds are refined on the way."""
    batch: list[_Entry] = []
    while heap and len(batch) < SOLVE_BATCH:
        entry = heapq.heappop(heap)
        if entry.bound_s >= threshold:
            results.append(Solved(entry.item.candidate, entry.bound_s, pruned=entry.reason))
            tick(progress)
        elif entry.level < EXACT:
            _refine_onto(heap, entry, results, progress)
        else:
            batch.append(entry)
    return batch


def _refine_onto(heap: list[_Entry], entry: _Entry, results: list[Solved], progress) -> None:
    """The entry one level further refined back on the heap, or pruned when no assignment fits."""
    level = entry.level + 1
    new_bound, new_reason = _refine(entry.item, level)
    if math.isinf(new_bound):
        results.append(Solved(entry.item.candidate, new_bound, pruned="memory"))
        tick(progress)
    elif new_bound > entry.bound_s:  # every bound holds: keep the strongest
        heapq.heappush(heap, entry._replace(bound_s=new_bound, level=level, reason=new_reason))
    else:
        heapq.heappush(heap, entry._replace(level=level))


def _refine(item: Pending, level: int) -> tuple[float, str]:
    """(the candidate's lower bound at `level`, the bound that gives it). FLOOR_MEMORY: the
    memory-aware bound at the floor step factor, replaying no schedule; EXACT: the exact step
    factor and both bounds with the schedule replayed."""
    late = not item.built
    problem = item.exact_problem() if level >= EXACT else item.floor_problem()
    if late and problem.mem_limit_bytes is not None \
            and min_static_bytes(problem.table, item.candidate.pp) > problem.mem_limit_bytes:
        return math.inf, "memory"  # what `build_problems` checks for the tables it builds at once
    compute_s = max(compute_bound_s(problem.table, problem.shape, problem.grad_sync),
                    reduction_bound_s(problem.table, problem.shape, problem.grad_sync, replay=level >= EXACT))
    table, structure = bound_table(problem.table)  # periodic blocks: their floor's run
    memory_s = memory_bound_s(table, problem.shape, problem.mem_limit_bytes, structure, problem.grad_sync,
                              replay=level >= EXACT)
    return max(compute_s, memory_s), ("bound" if compute_s >= memory_s else "memory_bound")


def _solve_shipped(task: tuple[StageProblem, dict]) -> StageSolution:
    """A worker's solve of a problem sent with the parent's replays of its schedule
    (`simulation.replay_memo`), which the worker then need not replay again."""
    problem, replays = task
    replay_memo.load(replays)
    return solve_stages(problem)


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
