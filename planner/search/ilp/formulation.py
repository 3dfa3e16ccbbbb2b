r"""The stage-assignment ILP for one outer candidate.

The outer search (`planner.search.driver`) fixes the mesh (pp, dp, tp), the schedule with its
micro-batch count m and virtual stages v, the ZeRO stage and SP; `planner.costing.tables` turns that
into a `CostTable`. This module chooses, per layer, its model chunk and its option (recomputation;
with `--layerwise` also tp/dp) by an integer linear program.

Model (p pipeline ranks, v virtual stages, C = p v chunks; chunk c runs on rank c mod p, or for
the V-shaped schedules on rank c for c < p and 2p - 1 - c after: `PipelineShape.rank_of`)::

    layers l = 0..L-1, options o in O(l) with per-micro-batch time f_lo + b_lo, resident bytes
    s_lo, activation bytes a_lo, transient buffer u_lo, per-step DP reduction d_lo, ZeRO
    gather + optimizer q_lo; P = one boundary transfer; live_k(c) = micro-batches chunk c holds
    at the k-th memory peak of its rank under the schedule (planner.simulation.schedules).

    per-layer formulation           x_lco in {0,1}:  sum_co x_lco = 1                  (assign_l)
                                     k_l = sum_co c x_lco,  0 <= k_{l+1} - k_l <= 1     (contig_l)
                                     k_0 = 0,  k_{L-1} = C - 1      (first/last layer, every chunk used)
                                     k_l = C - 1 for the MTP depths before h    (last_chunk_l)
    compact formulation (one run R of N identical layers between an optional first layer e and
    an optional last layer h; e is pinned to chunk 0 and h to chunk C-1, so contiguity holds by
    construction and only counts matter; a few leading layers of other kinds before R are pinned
    with e, from chunk 0 on, a run's share N // C to a chunk, and multi-token-prediction depths
    between R and h with h, `pinned_structure`, `CostTable.last_chunk_layers`):
                                     n_co in Z>=0:  sum_co n_co = N                     (run_total)
                                     sum_o n_co >= 1 for chunks holding neither e nor h (nonempty_c)
    chunk time      t_c = sum f+b of its layers + o (o: torch pipelining's fixed work per action)
                    + h^f(first layer of c) + h^b(last layer of c): a parameter gather that no
                    layer before it in the pass hides (`gathers.gather_exposure_s`; compact:
                    the lowest and highest option used in c, open_co / close_co exact indicators;
                    per-layer: head_l_c >= sum_o h_o x_lco - max_o h_o X_{l-1,c}, and at most it)
    rank time       T_r = sum_{c mod p = r} t_c ;   T_max >= T_r                        (tmax_r)
                    v > 1: T_max >= v (t_c - e_c) (tmax_chunk_c): the interleaved steady state
                    runs one chunk of each rank after another, so a chunk longer than T_max / v
                    stalls like a slower rank; e_c is the first layer's time in chunk 0 and the
                    last layer's in chunk C-1 (embedding, head: the played schedule absorbs them)
                    1F1B: T_max >= T_r + 2 P (1 - z_r), sum_r z_r = 1, z binary (cycle_r): its
                    steady state waits 2 P per micro-batch on every rank but the bottleneck
    exposed DP      E_r >= d_first(r): the rank's first layer produces its gradients last, so its
                    own reduction is never hidden (per-layer E_r >= d_l (X_lr - X_{l-1,r}) with
                    X_lc = sum_o x_lco; compact: the run's d, or the first/last layer's); and by
                    the executor's grad sync (D_r: reduction of the rank's layers, B_r / F_r: its
                    backward / forward of one micro-batch):
                      overlap (during the last backward)       E_r >= D_r - B_r
                      overlap_every_microbatch (ZeRO-2/3)      E_r >= D_r - B_r, and per window k
                        E_r >= b_k (D_r - B_r) - f_k (F_r + T_max - T_r) - i_k (F_r + B_r) + c_r (b_k + f_k)
                      (a window: from one of the rank's backwards to its compute end, b_k backwards
                      releasing b_k reductions, f_k forwards, each after a wait T_max - T_r for the
                      slowest, and i_k idle, in whole-rank units: `evaluation.reduction_windows`;
                      B_r, F_r include the chunk heads; c_r = b_r P / 2 when the reduction shares the
                      transfers' link, b_r boundaries on the rank: `simulation.contention`)
                      after_chunk (pipelining, blocking)       E_r >= D_r
                      pipelined ZeRO-2/3 count E_r from the rank's own compute end, L_r = r (B_r / v + P)
                      before rank 0's: E'_r >= E_r - L_r, E'_r >= 0 (late_dp_r)
                    Tail >= E_r + Q_r + n_r  (n_r: per-rank fixed work, the gradient norm) (tail_r)
    memory          M_rk = S_r + sum_{c on r} live_k(c) (A_c + [c < C-1] Y) + U_r <= limit   (mem_r_k)
                    (Y: the boundary output torch's PipelineStage keeps per micro-batch in flight;
                    R_r = b_r Y, the receive buffers in transit, one per boundary and direction,
                    plus a multi-chunk schedule's input gradients kept until the step ends (Y per
                    backward run before the rank's last forward, per boundary it receives on), is
                    part of S_r: `simulation.schedules.held_boundary_bytes`)
                    U_r >= u_lo y_co, n_co <= N y_co, y binary (largest transient buffer) (buf_*)
    minimise        (F - p/v) T_max + (1/v) sum_r T_r + G P + Tail
                    F = m + (p-1)/v by default: (m-1) slowest stage + sum of stages for 1F1B/GPipe,
                    m T + (p-1) T / v for balanced interleaved stages (Megatron-LM); the search
                    passes F for torch's interleaved schedule as the simulator plays it
                    (`simulation.factors`); G = 2 (C-1) transfers in fill and drain. For balanced
                    stages this is the simulated step; chunks that differ (interleaved, few
                    micro-batches, V-shaped) play otherwise, so the search re-scores its best
                    assignments by the schedule's exact critical path and improves them by moves
                    along it (`refine`), and tests/planner/search hold that objective to the
                    simulated step within 2%.

T_max, E_r and Tail are epigraph variables of a minimisation, so the max() terms are exact. With
`objective="memory"` the same model minimises the peak M instead (M >= M_rk, no limit), which is
how an infeasible request learns the smallest per-GPU memory that would work.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from meshplan.planner.contracts.config import chunk_index, chunk_rank
from meshplan.planner.contracts.schedule import schedule_spec
from meshplan.planner.costing.state_memory import GRAD_SYNC_MODES
from meshplan.planner.costing.tables import CostTable
from meshplan.planner.search.ilp.backend import run_solver, start_values
from meshplan.planner.search.ilp.constraints import build_model
from meshplan.planner.search.ilp.envelope import envelope_table
from meshplan.planner.search.ilp.evaluation import (compact_counts, evaluate_assignment, heuristic_start, leading_chunks,
                                                   live_vectors, pipeline_factor)

__all__ = ["PipelineShape", "StageProblem", "StageSolution", "compact_structure", "evaluate_assignment",
           "heuristic_start", "live_vectors", "pinned_structure", "pipeline_factor", "solve_stages"]

FORMULATIONS = ("auto", "compact", "per-layer")


@dataclass(frozen=True)
class PipelineShape:
    """The pipeline the layers are cut for."""

    num_stages: int
    num_microbatches: int
    virtual_stages: int = 1
    schedule: str = "1f1b"
    # Balanced step time over one rank's per-micro-batch time, as the schedule really plays
    # (`simulation.factors.schedule_factors`); None: the textbook m + (p - 1) / v.
    step_factor: float | None = None
    # Boundary transfers on the critical path in fill and drain: 2 (C - 1) (see
    # `simulation.factors`); 1F1B's steady-state waits are the `transfer_cycle` rows.

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
    def replay_key(self) -> tuple[str, int, int, int]:
        """(schedule, p, m, v): what a replay of the schedule depends on (`simulation.replay_memo`)."""
        return self.schedule, self.num_stages, self.num_microbatches, self.virtual_stages

    def rank_of(self, chunk: int) -> int:
        """Pipeline rank of a chunk (mod p, or mirrored for the V-shaped schedules)."""
        return chunk_rank(self.schedule, self.num_stages, chunk)

    def chunks_on(self, rank: int) -> list[int]:
        """The chunks a rank runs, by virtual stage."""
        return [chunk_index(self.schedule, self.num_stages, rank, local) for local in range(self.virtual_stages)]

    @property
    def transfers_on_path(self) -> float:
        """G: boundary transfers the step waits for in fill and drain."""
        return 2.0 * (self.num_chunks - 1)

    @property
    def transfer_cycle(self) -> bool:
        """1F1B's steady state waits for transfers unless one rank is the bottleneck."""
        return schedule_spec(self.schedule).transfer_cycle and self.num_stages > 1 and self.num_microbatches > 1

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
    # When gradients are reduced, as the executor does it (`costing.state_memory.grad_sync_mode`):
    # "overlap" (during the last micro-batch's backward), "overlap_every_microbatch" (during every
    # micro-batch's backward) or "after_chunk" (after a chunk's last backward, blocking).
    grad_sync: str = "overlap"
    # The reduction's link is the one the boundary transfers use (they share it: `simulation.contention`).
    dp_shares_pp_link: bool = False
    # The link the reduction leaves a GPU on ("nvlink", "nic", "" for none): on NVLink it slows the
    # tensor-parallel collectives (`simulation.contention`), which the exact step charges (`refine`).
    dp_link: str = ""
    backend: str = "highs"  # "highs" or "cbc"
    # Stop when the incumbent is proven within this fraction of optimal. Near-equal stage
    # balances make proving the last 0.1% slow on long interleaved pipelines, and the simulator
    # re-ranks the top candidates anyway.
    mip_rel_gap: float = 2e-3
    # Stop as soon as no assignment can have an objective below this (the outer search passes
    # the objective a candidate must beat to matter); status "cutoff" then.
    cutoff_s: float | None = None
    # A (chunk_of_layer, option_of_layer) assignment an earlier solve of this problem found (the
    # search's screen): the compact ILP starts from it instead of the heuristic assignment, so the
    # second solve prunes against that incumbent from its first node.
    start: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def __post_init__(self):
        if self.objective not in ("time", "memory"):
            raise ValueError(f"objective must be 'time' or 'memory', got {self.objective!r}")
        if self.grad_sync not in GRAD_SYNC_MODES:
            raise ValueError(f"grad_sync must be one of {GRAD_SYNC_MODES}, got {self.grad_sync!r}")
        if self.dp_link not in ("", "nvlink", "nic"):
            raise ValueError(f"dp_link must be 'nvlink', 'nic' or '', got {self.dp_link!r}")
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


# Layers before the run (the first one included) the compact formulation pins to chunks; a
# model with more of them (not one repeated block) is planned per layer.
MAX_LEADING_LAYERS = 8


def pinned_structure(table: CostTable, shape: PipelineShape) -> tuple[int, int, int] | None:
    """The run the compact formulation counts on this pipeline, or None (the per-layer one):
    `compact_structure`'s, or the longest run after a few leading layers of other kinds (a
    dense-first mixture of experts' dense blocks) and before the layers every plan puts in the
    last chunk (`CostTable.last_chunk_layers`: the head, and multi-token-prediction depths before
    it, pinned there as the head is). Those
    leading layers are pinned as the embedding is, from chunk 0 on, at most the run's share of
    layers per chunk (`evaluation.leading_chunks`), and the run starts in the chunk of the last
    of them. Pinning them restricts the per-layer ILP a little (a chunk's share of blocks rounded
    down); the search's exact re-scoring still moves layers across chunk boundaries (`refine`).
    The per-layer ILP of such a table was the slowest of the search: a binary per block,
    chunk and option, and tens of identical blocks to permute."""
    structure = compact_structure(table)
    if structure is not None:
        return structure
    type_index, first, count = max(table.runs(), key=lambda run: (run[2], -run[1]))
    if not 1 <= first <= MAX_LEADING_LAYERS or table.num_layers - (first + count) > table.last_chunk_layers:
        return None
    if first == 1 and table.num_layers - (first + count) <= 1:
        return None  # `compact_structure`'s shape, which it declined
    num_chunks = shape.num_chunks
    # the chunks after the leading layers' last one must each hold a run layer
    if count < num_chunks or (num_chunks > 1 and leading_chunks(first, count, num_chunks)[-1] >= num_chunks - 1):
        return None
    return first, count, type_index


# Relative tolerance on the cutoff: HiGHS may return an objective a feasibility tolerance over it.
CUTOFF_SLACK = 1e-6


def solve_stages(problem: StageProblem) -> StageSolution:
    """Build and solve one candidate's ILP; never raises for infeasibility (status says it).
    Periodic blocks (no identical run, `envelope.periodic_types`) are solved compact on their
    envelope and read back on the real table ("envelope")."""
    started = time.perf_counter()
    structure = pinned_structure(problem.table, problem.shape)
    use_compact = structure is not None and problem.formulation != "per-layer"
    if problem.formulation == "compact" and structure is None:
        raise ValueError("the compact formulation needs one run of identical layers between at most one "
                         "last layer and either one first layer or a few leading ones, pinned from chunk 0 on "
                         "(`pinned_structure`)")
    solved, formulation = problem, "compact" if use_compact else "per-layer"
    if structure is None and problem.formulation == "auto" and problem.objective == "time":
        envelope = _envelope_problem(problem)
        if envelope is not None:
            solved, structure, use_compact, formulation = envelope[0], envelope[1], True, "envelope"
    model = build_model(solved, structure if use_compact else None)
    start = None
    if use_compact and problem.objective == "time":
        found = (compact_counts(problem.start, structure, solved.table.num_layers, solved.shape.num_chunks,
                                len(solved.table.types[structure[2]].options))
                 if problem.start is not None and formulation == "compact" else None)
        found = found or heuristic_start(solved, structure)
        start = start_values(model.lp, found) if found is not None else None
    status, gap, backend = run_solver(model.lp, solved, start)
    if formulation == "envelope" and status not in ("optimal", "time_limit"):
        # the envelope's bytes are its kinds' largest: what does not fit there may per layer
        return solve_stages(replace(problem, formulation="per-layer"))
    if status not in ("optimal", "time_limit"):
        return StageSolution(status=status, formulation=formulation, backend=backend,
                             solve_time_s=time.perf_counter() - started)
    if solved.cutoff_s is not None and model.lp.objective.value() > solved.cutoff_s * (1 + CUTOFF_SLACK):
        # HiGHS keeps a start above its objective bound as its incumbent and calls it optimal
        # when nothing below the bound exists: that is the cutoff's answer
        return StageSolution(status="cutoff", formulation=formulation, backend=backend,
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


def _envelope_problem(problem: StageProblem) -> tuple[StageProblem, tuple[int, int, int]] | None:
    """The problem on the envelope of its periodic blocks (`envelope.envelope_table`) with the
    compact structure of that table, or None. Without a cutoff: the envelope's objective bounds
    the real one from above, so it may exceed a cutoff the real assignment beats."""
    table = envelope_table(problem.table)
    if table is None:
        return None
    solved = replace(problem, table=table, cutoff_s=None)
    structure = pinned_structure(table, problem.shape)
    return (solved, structure) if structure is not None else None
