r"""The stage-assignment ILP for one outer candidate, and the public `plan(...)` entry point.

The outer search (`planner.search`) fixes the mesh (pp, dp, tp), the schedule with its
micro-batch count m and virtual stages v, the ZeRO stage and SP; `planner.cost_tables` turns that
into a `CostTable`. This module chooses, per layer, its model chunk and its option (recomputation;
with `--layerwise` also tp/dp) by an integer linear program.

Model (p pipeline ranks, v virtual stages, C = p v chunks; chunk c runs on rank c mod p)::

    layers l = 0..L-1, options o in O(l) with per-micro-batch time f_lo + b_lo, resident bytes
    s_lo, activation bytes a_lo, transient buffer u_lo, per-step DP reduction d_lo, ZeRO
    gather + optimizer q_lo; P = one boundary transfer; live_k(c) = micro-batches chunk c holds
    at the k-th memory peak of its rank under the schedule (planner.schedules).

    per-layer formulation           x_lco in {0,1}:  sum_co x_lco = 1                  (assign_l)
                                     k_l = sum_co c x_lco,  0 <= k_{l+1} - k_l <= 1     (contig_l)
                                     k_0 = 0,  k_{L-1} = C - 1      (first/last layer, every chunk used)
    compact formulation (one run R of N identical layers between an optional first layer e and
    an optional last layer h; e is pinned to chunk 0 and h to chunk C-1, so contiguity holds by
    construction and only counts matter):
                                     n_co in Z>=0:  sum_co n_co = N                     (run_total)
                                     sum_o n_co >= 1 for chunks holding neither e nor h (nonempty_c)
    chunk time      t_c = sum f+b of its layers + P ([c > 0] + [c < C-1])
    rank time       T_r = sum_{c mod p = r} t_c ;   T_max >= T_r                        (tmax_r)
                    v > 1: T_max >= v t_c (tmax_chunk_c): the interleaved steady state runs
                    one chunk of each rank after another, so a chunk longer than T_max / v
                    stalls its neighbours like a slower rank would
    exposed DP      E_r >= D_r - B_r,  E_r >= d_first(r)  (D_r: gradient reduction of the rank's
                    layers; B_r: its backward of the last micro-batch, which the reduction
                    overlaps; the rank's first layer produces its gradients last, so its own
                    reduction is never hidden: per-layer E_r >= d_l (X_lr - X_{l-1,r}) with
                    X_lc = sum_o x_lco; compact: the run's d, or the first/last layer's)
                    Tail >= E_r + Q_r                                                   (tail_r)
    memory          M_rk = S_r + sum_{c on r} live_k(c) A_c + U_r <= limit              (mem_r_k)
                    U_r >= u_lo y_co, n_co <= N y_co, y binary (largest transient buffer) (buf_*)
    minimise        (F - p/v) T_max + (1/v) sum_r T_r + Tail
                    F = m + (p-1)/v by default: (m-1) slowest stage + sum of stages for 1F1B/GPipe,
                    m T + (p-1) T / v for balanced interleaved stages (Megatron-LM); the search
                    passes F as torch's schedule really plays (`pipeline_factor`).

T_max, E_r and Tail are epigraph variables of a minimisation, so the max() terms are exact. With
`objective="memory"` the same model minimises the peak M instead (M >= M_rk, no limit), which is
how an infeasible request learns the smallest per-GPU memory that would work.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

from planner.cost_tables import CostTable
from planner.stage_eval import evaluate_assignment, heuristic_start, live_vectors, pipeline_factor

__all__ = ["PipelineShape", "StageProblem", "StageSolution", "compact_structure", "evaluate_assignment",
           "heuristic_start", "live_vectors", "pipeline_factor", "plan", "solve_stages"]

FORMULATIONS = ("auto", "compact", "per-layer")


@dataclass(frozen=True)
class PipelineShape:
    """The pipeline the layers are cut for."""

    num_stages: int
    num_microbatches: int
    virtual_stages: int = 1
    schedule: str = "1f1b"
    # Balanced step time over one rank's per-micro-batch time, as the schedule really plays
    # (`pipeline_factor`); None: the textbook m + (p - 1) / v.
    step_factor: float | None = None

    def __post_init__(self):
        for name in ("num_stages", "num_microbatches", "virtual_stages"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.step_factor is not None and self.step_factor < self.num_stages / self.virtual_stages:
            raise ValueError(f"step_factor {self.step_factor} is below p / v = {self.num_stages}/{self.virtual_stages}")

    @property
    def num_chunks(self) -> int:
        return self.num_stages * self.virtual_stages

    @property
    def weights(self) -> tuple[float, float]:
        """(weight of the slowest rank, weight of the sum of ranks) in the pipeline time."""
        v, m = self.virtual_stages, self.num_microbatches
        if self.step_factor is None:
            return m - 1 / v, 1 / v
        return self.step_factor - self.num_stages / v, 1 / v


@dataclass(frozen=True)
class StageProblem:
    """One candidate's ILP: its cost table, pipeline, memory limit and solver options."""

    table: CostTable
    shape: PipelineShape
    mem_limit_bytes: float | None = None  # per rank; None: unconstrained
    objective: str = "time"  # "time" or "memory"
    time_limit_s: float = 20.0
    formulation: str = "auto"
    overlap_dp: bool = True  # gradient reduction overlaps the last micro-batch's backward
    backend: str = "highs"  # "highs" or "cbc"
    # Stop when the incumbent is proven within this fraction of optimal. Near-equal stage
    # balances make proving the last 0.1% slow on long interleaved pipelines, and the simulator
    # re-ranks the top candidates anyway.
    mip_rel_gap: float = 2e-3
    # Stop as soon as no assignment can have an objective below this (the outer search passes
    # the objective a candidate must beat to matter); status "cutoff" then.
    cutoff_s: float | None = None

    def __post_init__(self):
        if self.objective not in ("time", "memory"):
            raise ValueError(f"objective must be 'time' or 'memory', got {self.objective!r}")
        if self.formulation not in FORMULATIONS:
            raise ValueError(f"formulation must be one of {FORMULATIONS}, got {self.formulation!r}")
        if self.shape.num_chunks > self.table.num_layers:
            raise ValueError(f"{self.shape.num_chunks} pipeline chunks need at least as many layers; "
                             f"the model has {self.table.num_layers}")


@dataclass(frozen=True)
class StageSolution:
    """What the ILP chose, with the real solver status and gap."""

    status: str  # "optimal", "time_limit" (feasible, gap may be > 0), "infeasible", "cutoff", "no_solution"
    objective_s: float = float("inf")  # time objective; with objective="memory": peak bytes
    gap: float = 0.0  # relative MIP gap at exit
    chunk_of_layer: tuple[int, ...] = ()
    option_of_layer: tuple[int, ...] = ()
    chunk_time_s: tuple[float, ...] = ()
    rank_mem_bytes: tuple[float, ...] = ()
    formulation: str = ""
    backend: str = ""
    solve_time_s: float = field(default=0.0, compare=False)
    binding: tuple[str, ...] = ()  # constraints at their limit (tight memory ranks)
    model_objective: float = float("nan")  # the ILP's own objective value (memory: GiB)

    @property
    def feasible(self) -> bool:
        return self.status in ("optimal", "time_limit")


# --------------------------------------------------------------------------------------------
# The ILP


def compact_structure(table: CostTable) -> tuple[int, int, int] | None:
    """(first run layer, run length, run type) if the model is [one layer] run [one layer], else None."""
    runs = table.runs()
    long_runs = [run for run in runs if run[2] > 1]
    if len(long_runs) != 1 or len(runs) > 3:
        return None
    type_index, first, count = long_runs[0]
    if first > 1 or table.num_layers - (first + count) > 1:
        return None
    return first, count, type_index


GIB = float(2 ** 30)  # memory rows in GiB keep the ILP's coefficients within a few orders


class _Model:
    """The pulp problem of one candidate plus the expressions its constraint families share."""

    def __init__(self, problem: StageProblem):
        import pulp

        self.pulp = pulp
        self.problem = problem
        self.lp = pulp.LpProblem("meshplan_stages", pulp.LpMinimize)
        shape = problem.shape
        self.num_chunks, self.pp = shape.num_chunks, shape.num_stages
        zero = pulp.LpAffineExpression
        self.chunk_time = [zero() for _ in range(self.num_chunks)]
        self.chunk_act = [zero() for _ in range(self.num_chunks)]
        self.rank_static, self.rank_grad_comm, self.rank_bwd, self.rank_tail = (
            [zero() for _ in range(self.pp)] for _ in range(4))
        self.rank_buffer: list[list[tuple[float, object]]] = [[] for _ in range(self.pp)]
        # Lower bounds on each rank's exposed gradient reduction, one row per group of
        # (seconds, indicator expression) terms.
        self.rank_first_dp: list[list[list[tuple[float, object]]]] = [[] for _ in range(self.pp)]
        self.decoders: list = []  # callables filling (chunks, options) from the solved values
        # Integrality cuts: (K, t, c) with K >= layers of a run in any chunk, so T_max >= v (K t + c).
        self.count_cuts: list[tuple[object, float, float]] = []
        # Tail cuts: (R, s, slack) with R >= run layers on any rank, so Tail >= R s + slack.
        self.tail_cuts: list[tuple[object, float, float]] = []

    def add_option_terms(self, chunk: int, option, amount) -> None:
        """Account `amount` (a variable, expression or number) layers of `option` in `chunk`."""
        rank = chunk % self.pp
        self.chunk_time[chunk] += option.time_s * amount
        self.chunk_act[chunk] += (option.act_bytes / GIB) * amount
        self.rank_static[rank] += (option.static_bytes / GIB) * amount
        self.rank_grad_comm[rank] += option.dp_comm_s * amount
        self.rank_bwd[rank] += option.bwd_s * amount
        self.rank_tail[rank] += (option.param_gather_s + option.optimizer_s) * amount

    def assignment(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        num_layers = self.problem.table.num_layers
        chunks, options = [0] * num_layers, [0] * num_layers
        for decode in self.decoders:
            decode(chunks, options)
        return tuple(chunks), tuple(options)


def _value(var) -> int:
    return int(round(var.varValue or 0.0))


def _add_pinned_layer(model: _Model, layer: int, chunk: int) -> None:
    """A layer whose chunk is fixed (embedding in chunk 0, head in the last): choose its option."""
    table, pulp = model.problem.table, model.pulp
    options = table.types[table.layer_type[layer]].options
    pick = [pulp.LpVariable(f"w_{layer}_{o}", cat="Binary") for o in range(len(options))]
    model.lp += pulp.lpSum(pick) == 1, f"assign_{layer}"
    for option, var in zip(options, pick):
        model.add_option_terms(chunk, option, var)
        if option.buffer_bytes:
            model.rank_buffer[chunk % model.pp].append((option.buffer_bytes / GIB, var))
    if layer == 0:  # the first layer of chunk 0
        model.rank_first_dp[0].append([(min(o.dp_comm_s for o in options), 1)])

    def decode(chunks, chosen):
        chunks[layer] = chunk
        chosen[layer] = next(o for o, var in enumerate(pick) if _value(var))
    model.decoders.append(decode)


def _add_run_count_constraints(model: _Model, first: int, count: int, type_index: int) -> None:
    """Compact run: n[c, o] layers of option o in chunk c; totals, non-empty chunks, buffers."""
    table, pulp, num_chunks = model.problem.table, model.pulp, model.num_chunks
    options = table.types[type_index].options
    counts = [[pulp.LpVariable(f"n_{c}_{o}", lowBound=0, upBound=count, cat="Integer")
               for o in range(len(options))] for c in range(num_chunks)]
    model.lp += pulp.lpSum(v for row in counts for v in row) == count, "run_total"
    has_first, has_last = first == 1, first + count < table.num_layers
    for c in range(num_chunks):
        if not ((c == 0 and has_first) or (c == num_chunks - 1 and has_last)):
            model.lp += pulp.lpSum(counts[c]) >= 1, f"nonempty_{c}"
        for o, option in enumerate(options):
            model.add_option_terms(c, option, counts[c][o])
            if option.buffer_bytes:
                used = pulp.LpVariable(f"y_{c}_{o}", cat="Binary")
                model.lp += counts[c][o] <= count * used, f"buf_use_{c}_{o}"
                model.rank_buffer[c % model.pp].append((option.buffer_bytes / GIB, used))
    # Granularity cut: the fullest chunk holds K >= ceil(N / C) layers, each at least the fastest
    # option's time, so T_max >= v K t_min. Valid for every integer solution; the LP relaxation
    # alone would spread fractional layers evenly, and branching on one K closes that gap.
    fullest = pulp.LpVariable("run_max_per_chunk", lowBound=0, upBound=count, cat="Integer")
    for c in range(num_chunks):
        model.lp += pulp.lpSum(counts[c]) <= fullest, f"run_fullest_{c}"
    chunk_const = _chunk_constants(model, has_first, has_last)
    fastest_s = min(o.time_s for o in options)
    model.count_cuts.append((fullest, fastest_s, min(chunk_const)))
    model.count_cuts.append((1, 0.0, _fullest_chunk_bound(count, fastest_s, chunk_const)))
    _add_run_rank_count_cuts(model, counts, options, count, chunk_const)
    _add_run_reshard_terms(model, counts, options, count)
    _add_run_first_layer_terms(model, counts, options, count, has_first, has_last)
    _add_run_symmetry_constraints(model, has_first, has_last)

    def decode(chunks, chosen):
        layer = first
        for c in range(num_chunks):  # options grouped, in option order, inside each chunk
            for o in range(len(options)):
                for _ in range(_value(counts[c][o])):
                    chunks[layer], chosen[layer] = c, o
                    layer += 1
        assert layer == first + count, f"decoded {layer - first} of {count} run layers"
    model.decoders.append(decode)


def _fullest_chunk_bound(count: int, fastest_s: float, chunk_const: list[float]) -> float:
    """A constant no chunk maximum can beat: with K0 = ceil(N / C), either some chunk holds
    K0 + 1 run layers, or at least N - C (K0 - 1) chunks hold K0, the costliest of which has at
    least the (N - C (K0 - 1))-th smallest fixed time."""
    num_chunks = len(chunk_const)
    base = -(-count // num_chunks)
    at_base = count - num_chunks * (base - 1)
    ordered = sorted(chunk_const)
    return min(base * fastest_s + ordered[at_base - 1], (base + 1) * fastest_s + ordered[0])


def _chunk_constants(model: _Model, has_first: bool, has_last: bool) -> list[float]:
    """Least time of each chunk besides its run layers: transfers and the pinned layers."""
    table, num_chunks = model.problem.table, model.num_chunks
    out = [table.p2p_s * ((c > 0) + (c < num_chunks - 1)) for c in range(num_chunks)]
    if has_first:
        out[0] += table.types[table.layer_type[0]].min_time_s()
    if has_last:
        out[-1] += table.types[table.layer_type[-1]].min_time_s()
    return out


def _add_run_rank_count_cuts(model: _Model, counts, options, count: int, chunk_const: list[float]) -> None:
    """The busiest rank holds R >= ceil(N / p) run layers: T_max >= R t_min, and its per-step
    tail is at least R times a run layer's least exposed reduction plus optimizer work."""
    pulp, table = model.pulp, model.problem.table
    busiest = pulp.LpVariable("run_max_per_rank", lowBound=0, upBound=count, cat="Integer")
    for r in range(model.pp):
        model.lp += pulp.lpSum(v for c in range(r, model.num_chunks, model.pp) for v in counts[c]) <= busiest, \
            f"run_busiest_{r}"
    v = model.problem.shape.virtual_stages
    rank_const = min(sum(chunk_const[r::model.pp]) for r in range(model.pp))
    model.count_cuts.append((busiest, min(o.time_s for o in options) / v, rank_const / v))
    overlap = model.problem.overlap_dp
    per_layer = min(o.dp_comm_s - (o.bwd_s if overlap else 0.0) + o.param_gather_s + o.optimizer_s for o in options)
    pinned = [table.types[t] for i, t in enumerate(table.layer_type) if table.layer_type.count(t) == 1]
    # Pinned layers may lower the busiest rank's sum (their reduction may be shorter than their
    # backward); subtract the most they can.
    slack = sum(min(0.0, min(o.dp_comm_s - (o.bwd_s if overlap else 0.0) for o in lt.options)) for lt in pinned)
    model.tail_cuts.append((busiest, per_layer, slack))


def _add_run_symmetry_constraints(model: _Model, has_first: bool, has_last: bool) -> None:
    """Interleaved: order the activations of a rank's chunks against their live micro-batches.

    The contents of two chunks of one rank (neither holding a pinned layer) can be swapped
    without changing any time, resident memory or buffer; only the activation term
    sum_j live_k(j) A_j changes. If chunk a holds at least as many live micro-batches as chunk b
    at every memory peak, putting the smaller activations in a is never worse (rearrangement
    inequality), so A_a <= A_b loses no optimum and removes the permuted copies of each solution.
    """
    shape = model.problem.shape
    if shape.virtual_stages == 1:
        return
    for r in range(model.pp):
        peaks = live_vectors(shape, r)
        free = [j for j in range(shape.virtual_stages)
                if not (j * model.pp + r == 0 and has_first)
                and not (j * model.pp + r == model.num_chunks - 1 and has_last)]
        free.sort(key=lambda j: tuple(-live[j] for live in peaks))
        for a, b in zip(free, free[1:]):
            if all(live[a] >= live[b] for live in peaks):
                model.lp += model.chunk_act[a * model.pp + r] <= model.chunk_act[b * model.pp + r], \
                    f"symmetry_{r}_{a}_{b}"


def _add_run_first_layer_terms(model: _Model, counts, options, count: int, has_first: bool, has_last: bool):
    """The first layer of each rank's first chunk is a run layer, except in chunk 0 after the
    pinned first layer, and in a last chunk holding only the pinned last layer."""
    pulp, table = model.pulp, model.problem.table
    run_dp = min(o.dp_comm_s for o in options)
    for r in range(model.pp):
        if r == 0 and has_first:
            continue
        if r == model.num_chunks - 1 and has_last:
            last_options = table.types[table.layer_type[-1]].options
            used = pulp.LpVariable(f"first_is_run_{r}", cat="Binary")
            model.lp += pulp.lpSum(counts[r]) <= count * used, f"first_run_up_{r}"
            model.lp += pulp.lpSum(counts[r]) >= used, f"first_run_down_{r}"
            model.rank_first_dp[r].append([(run_dp, used), (min(o.dp_comm_s for o in last_options), 1 - used)])
        else:
            model.rank_first_dp[r].append([(run_dp, 1)])


def _add_run_reshard_terms(model: _Model, counts, options, count: int) -> None:
    """Layerwise: each extra (tp, dp) mesh used in a chunk costs one resharding each way."""
    meshes = sorted({(o.tp, o.dp) for o in options})
    reshard_s = model.problem.table.reshard_s
    if len(meshes) < 2 or not reshard_s:
        return
    pulp = model.pulp
    for c, row in enumerate(counts):
        used = {mesh: pulp.LpVariable(f"mesh_{c}_{i}", cat="Binary") for i, mesh in enumerate(meshes)}
        for o, option in enumerate(options):
            model.lp += row[o] <= count * used[(option.tp, option.dp)], f"mesh_use_{c}_{o}"
        extra = pulp.LpVariable(f"reshards_{c}", lowBound=0)
        model.lp += extra >= pulp.lpSum(used.values()) - 1, f"reshard_count_{c}"
        model.chunk_time[c] += 2 * reshard_s * extra


def _add_layer_assignment_constraints(model: _Model) -> None:
    """Per-layer formulation: x[l, c, o] binaries, contiguous non-decreasing chunks, all used."""
    table, pulp, num_chunks = model.problem.table, model.pulp, model.num_chunks
    num_layers = table.num_layers
    x: dict[tuple[int, int, int], object] = {}
    chunk_index = []
    for layer in range(num_layers):
        options = table.types[table.layer_type[layer]].options
        # Chunk c needs c layers before it and C-1-c after it.
        reachable = range(max(0, num_chunks - num_layers + layer), min(layer, num_chunks - 1) + 1)
        for c in reachable:
            for o, option in enumerate(options):
                var = x[layer, c, o] = pulp.LpVariable(f"x_{layer}_{c}_{o}", cat="Binary")
                model.add_option_terms(c, option, var)
        model.lp += pulp.lpSum(x[layer, c, o] for c in reachable for o in range(len(options))) == 1, \
            f"assign_{layer}"
        chunk_index.append(pulp.lpSum(c * x[layer, c, o] for c in reachable for o in range(len(options))))
        for r in range(model.pp):
            for o, option in enumerate(options):
                on_rank = [x[layer, c, o] for c in reachable if c % model.pp == r]
                if option.buffer_bytes and on_rank:
                    model.rank_buffer[r].append((option.buffer_bytes / GIB, pulp.lpSum(on_rank)))
    model.lp += chunk_index[0] == 0, "first_layer_chunk"
    model.lp += chunk_index[-1] == num_chunks - 1, "last_layer_chunk"
    for layer in range(num_layers - 1):
        step = chunk_index[layer + 1] - chunk_index[layer]
        model.lp += step >= 0, f"contig_order_{layer}"
        model.lp += step <= 1, f"contig_step_{layer}"
    _add_layer_reshard_terms(model, x)
    in_chunk: dict[tuple[int, int], list] = {}
    for (layer, c, _), var in x.items():
        in_chunk.setdefault((layer, c), []).append(var)
    for layer in range(num_layers):
        dp_s = min(o.dp_comm_s for o in table.types[table.layer_type[layer]].options)
        for r in range(model.pp):  # layer is first in chunk r iff it is in r and its predecessor is not
            if (layer, r) in in_chunk:
                here = pulp.lpSum(in_chunk[layer, r]) - pulp.lpSum(in_chunk.get((layer - 1, r), []))
                model.rank_first_dp[r].append([(dp_s, here)])

    def decode(chunks, chosen):
        for (layer, c, o), var in x.items():
            if _value(var):
                chunks[layer], chosen[layer] = c, o
    model.decoders.append(decode)


def _add_layer_reshard_terms(model: _Model, x) -> None:
    """Layerwise per-layer formulation: resharding between consecutive layers of one chunk."""
    table, pulp = model.problem.table, model.pulp
    if not table.reshard_s:
        return
    for layer in range(1, table.num_layers):
        for c in range(model.num_chunks):
            def by_mesh(l):
                out: dict[tuple[int, int], list] = {}
                for o, option in enumerate(table.types[table.layer_type[l]].options):
                    if (l, c, o) in x:
                        out.setdefault((option.tp, option.dp), []).append(x[l, c, o])
                return out
            before, here = by_mesh(layer - 1), by_mesh(layer)
            if len(set(before) | set(here)) < 2:
                continue
            moved = pulp.LpVariable(f"reshard_{layer}_{c}", lowBound=0)
            for mesh, vars_before in before.items():
                others = [v for m, vs in here.items() if m != mesh for v in vs]
                model.lp += moved >= pulp.lpSum(vars_before) + pulp.lpSum(others) - 1, \
                    f"reshard_{layer}_{c}_{mesh[0]}x{mesh[1]}"
            model.chunk_time[c] += 2 * table.reshard_s * moved


def _add_pipeline_time_constraints(model: _Model):
    """Epigraph of the slowest rank and of the exposed per-step tail; returns the objective."""
    problem, pulp = model.problem, model.pulp
    shape, p2p_s = problem.shape, problem.table.p2p_s
    for c in range(model.num_chunks):
        model.chunk_time[c] += p2p_s * ((c > 0) + (c < model.num_chunks - 1))
    rank_time = [pulp.lpSum(model.chunk_time[c] for c in range(r, model.num_chunks, model.pp))
                 for r in range(model.pp)]
    slowest = pulp.LpVariable("t_max", lowBound=0)
    tail = pulp.LpVariable("tail", lowBound=0)
    for r in range(model.pp):
        model.lp += slowest >= rank_time[r], f"tmax_{r}"
    if shape.virtual_stages > 1:  # the interleaved steady state needs equal chunks (see the maths)
        for c in range(model.num_chunks):
            model.lp += slowest >= shape.virtual_stages * model.chunk_time[c], f"tmax_chunk_{c}"
    for k, (fullest, time_s, const_s) in enumerate(model.count_cuts):
        model.lp += slowest >= shape.virtual_stages * (time_s * fullest + const_s), f"granularity_{k}"
    for k, (busiest, per_layer_s, slack_s) in enumerate(model.tail_cuts):
        if per_layer_s > 0:
            model.lp += tail >= per_layer_s * busiest + slack_s, f"tail_granularity_{k}"
    for r in range(model.pp):
        exposed = pulp.LpVariable(f"exposed_dp_{r}", lowBound=0)
        overlap = model.rank_bwd[r] if problem.overlap_dp else 0
        model.lp += exposed >= model.rank_grad_comm[r] - overlap, f"exposed_dp_{r}"
        for k, group in enumerate(model.rank_first_dp[r]):
            model.lp += exposed >= pulp.lpSum(dp_s * indicator for dp_s, indicator in group), f"exposed_first_{r}_{k}"
        model.lp += tail >= exposed + model.rank_tail[r], f"tail_{r}"
    slowest_weight, sum_weight = shape.weights
    return slowest_weight * slowest + sum_weight * pulp.lpSum(rank_time) + tail


def _add_memory_constraints(model: _Model):
    """Per rank and per memory peak of the schedule: resident + live activations + buffer."""
    problem, pulp = model.problem, model.pulp
    peak = pulp.LpVariable("mem_peak", lowBound=0) if problem.objective == "memory" else None
    if peak is None and problem.mem_limit_bytes is None:
        return None
    for r in range(model.pp):
        buffer = pulp.LpVariable(f"buffer_{r}", lowBound=0)
        for i, (size, used) in enumerate(model.rank_buffer[r]):
            model.lp += buffer >= size * used, f"buf_{r}_{i}"
        for k, live in enumerate(live_vectors(problem.shape, r)):
            total = model.rank_static[r] + buffer + pulp.lpSum(
                live[j] * model.chunk_act[j * model.pp + r] for j in range(problem.shape.virtual_stages))
            if peak is not None:
                model.lp += peak >= total, f"mem_peak_{r}_{k}"
            else:
                model.lp += total <= problem.mem_limit_bytes / GIB, f"mem_{r}_{k}"
    return peak


def _build_model(problem: StageProblem, structure: tuple[int, int, int] | None) -> _Model:
    model = _Model(problem)
    table = problem.table
    if structure is None:
        _add_layer_assignment_constraints(model)
    else:
        first, count, type_index = structure
        if first == 1:
            _add_pinned_layer(model, 0, 0)
        _add_run_count_constraints(model, first, count, type_index)
        if first + count < table.num_layers:
            _add_pinned_layer(model, table.num_layers - 1, model.num_chunks - 1)
    time_objective = _add_pipeline_time_constraints(model)
    peak = _add_memory_constraints(model)
    model.lp += (peak if peak is not None else time_objective), "objective"
    return model


def solve_stages(problem: StageProblem) -> StageSolution:
    """Build and solve one candidate's ILP; never raises for infeasibility (status says it)."""
    started = time.perf_counter()
    structure = compact_structure(problem.table)
    use_compact = structure is not None and problem.formulation != "per-layer"
    if problem.formulation == "compact" and structure is None:
        raise ValueError("the compact formulation needs one run of identical layers between at most one "
                         "first and one last layer")
    model = _build_model(problem, structure if use_compact else None)
    start = None
    if use_compact and problem.objective == "time":
        found = heuristic_start(problem, structure)
        start = _start_values(model.lp, found) if found is not None else None
    status, gap, backend = _run_solver(model.lp, problem, start)
    formulation = "compact" if use_compact else "per-layer"
    if status not in ("optimal", "time_limit"):
        return StageSolution(status=status, formulation=formulation, backend=backend,
                             solve_time_s=time.perf_counter() - started)
    chunks, options = model.assignment()
    objective, chunk_time, rank_mem = evaluate_assignment(problem, chunks, options)
    if problem.objective == "memory":
        objective = max(rank_mem)
    binding = tuple(name for name, constraint in model.lp.constraints.items()
                    if name.startswith("mem_") and problem.mem_limit_bytes is not None
                    and abs(constraint.slack or 0.0) <= 1e-4)  # GiB rows: within ~100 KiB of the limit
    return StageSolution(status=status, objective_s=objective, gap=gap, chunk_of_layer=chunks,
                         option_of_layer=options, chunk_time_s=chunk_time, rank_mem_bytes=rank_mem,
                         formulation=formulation, backend=backend,
                         solve_time_s=time.perf_counter() - started, binding=binding,
                         model_objective=float(model.lp.objective.value()))


def _start_values(lp, start) -> dict[str, float]:
    """Variable name -> value of a heuristic start (integer decisions only; HiGHS completes it)."""
    counts, pinned_options = start
    values = {f"n_{c}_{o}": float(n) for c, row in enumerate(counts) for o, n in enumerate(row)}
    for layer, option in pinned_options.items():
        names = [name for name in lp.variablesDict() if name.startswith(f"w_{layer}_")]
        values.update({name: float(name == f"w_{layer}_{option}") for name in names})
    return values


@contextlib.contextmanager
def _quiet_stdout():
    """Point file descriptor 1 at /dev/null (C-level prints included), then restore it."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _run_solver(lp, problem: StageProblem, start: dict[str, float] | None = None) -> tuple[str, float, str]:
    """Solve with HiGHS (highspy, in process) or CBC; return (real status, relative gap, backend).

    `start`: values of some integer variables by name, handed to HiGHS as a partial solution."""
    import pulp

    class _HighsWithStart(pulp.HiGHS):
        def callSolver(self, lp_):
            if start:
                import numpy as np

                index = {var.name: var.index for var in lp_.variables()}
                names = [name for name in start if name in index]
                lp_.solverModel.setSolution(len(names), np.array([index[n] for n in names], dtype=np.int32),
                                            np.array([start[n] for n in names], dtype=np.float64))
            super().callSolver(lp_)

    options = {} if problem.cutoff_s is None else {"objective_bound": float(problem.cutoff_s)}
    highs = _HighsWithStart(msg=False, timeLimit=problem.time_limit_s, threads=1, gapRel=problem.mip_rel_gap,
                            **options)
    if problem.backend == "highs" and highs.available():
        with _quiet_stdout():  # HiGHS prints its banner on stdout once per process, despite msg=False
            lp.solve(highs)
        info = lp.solverModel.getInfo()
        model_status = lp.solverModel.getModelStatus()
        import highspy

        if model_status == highspy.HighsModelStatus.kOptimal:
            return "optimal", max(0.0, float(info.mip_gap)) if info.mip_gap < 1e30 else 0.0, "highs"
        if model_status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible,
                            highspy.HighsModelStatus.kObjectiveBound):
            # With a cutoff, "infeasible" means nothing beats the cutoff.
            return ("infeasible" if problem.cutoff_s is None else "cutoff"), 0.0, "highs"
        if lp.sol_status == pulp.LpSolutionIntegerFeasible:
            return "time_limit", float(info.mip_gap), "highs"
        return "no_solution", 0.0, "highs"
    with tempfile.TemporaryDirectory(prefix="meshplan-ilp-") as tmp:
        cbc = pulp.PULP_CBC_CMD(msg=False, timeLimit=problem.time_limit_s, gapRel=problem.mip_rel_gap, keepFiles=False)
        cbc.tmpDir = tmp
        lp.solve(cbc)
    if lp.sol_status == pulp.LpSolutionOptimal:
        return "optimal", 0.0, "cbc"
    if lp.sol_status == pulp.LpSolutionIntegerFeasible:
        return "time_limit", float("nan"), "cbc"  # CBC through pulp does not report its bound
    if lp.status == pulp.LpStatusInfeasible or lp.sol_status == pulp.LpSolutionInfeasible:
        return "infeasible", 0.0, "cbc"
    return "no_solution", 0.0, "cbc"


def plan(spec, cluster, gpus, global_batch, seq=None, **kwargs):
    """The fastest plan that fits: see `planner.search.search_plan` for the arguments."""
    from planner.search import search_plan

    return search_plan(spec, cluster, gpus, global_batch, seq, **kwargs)
