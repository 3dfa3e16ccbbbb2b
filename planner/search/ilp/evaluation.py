"""Closed-form evaluation of a stage assignment and a heuristic starting point for the ILP.

`evaluate_assignment` computes the objective and per-rank memory that `planner.search.ilp.formulation`'s ILP
models, directly from an assignment (the ILP's answer is re-scored with it, and tests compare the
two). `pipeline_factor` is the simulated step factor of a schedule. `heuristic_start` builds a feasible compact assignment for the MIP to start from.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from meshplan.planner.simulation.replay_memo import memoised

if TYPE_CHECKING:  # annotations only: planner.search.ilp.formulation imports this module
    from meshplan.planner.costing.tables import CostTable
    from meshplan.planner.search.ilp.formulation import PipelineShape, StageProblem

def live_vectors(shape: PipelineShape, rank: int) -> list[tuple[int, ...]]:
    """Per-virtual-stage live micro-batch counts at each memory peak of `rank` (dominated removed)."""
    return list(_live_vectors(*shape.replay_key, rank))


@memoised
def _live_vectors(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int,
                  rank: int) -> tuple[tuple[int, ...], ...]:
    from meshplan.planner.simulation.schedules import schedule_actions

    # every rank's order at once, cached and shared with the engine's replay of the schedule
    actions = schedule_actions(schedule, num_stages, num_microbatches, virtual_stages)[rank]
    live = [0] * virtual_stages
    peaks: set[tuple[int, ...]] = set()
    last = len(actions) - 1
    for index, action in enumerate(actions):
        kind = action.kind
        local = action.chunk // num_stages  # the virtual stage, in both placements
        if kind == "F":
            live[local] += 1
            if index == last or actions[index + 1].kind != "F":
                peaks.add(tuple(live))
        elif kind == "B" or kind == "W":  # what frees the activations (I keeps them)
            live[local] -= 1
    # Non-dominated peaks: a vector dominated by another has a smaller sum, so looking from the
    # largest sums down, checking against those kept is enough (domination is transitive).
    kept: list[tuple[int, ...]] = []
    for v in sorted(peaks, key=lambda vec: -sum(vec)):
        if not any(all(a >= b for a, b in zip(w, v)) for w in kept):
            kept.append(v)
    return tuple(sorted(kept))


def chunk_fixed_s(table: CostTable, num_chunks: int) -> list[float]:
    """Per-micro-batch time every chunk pays besides its layers (torch pipelining's actions)."""
    return [table.chunk_overhead_s if num_chunks > 1 else 0.0] * num_chunks


def chunk_fixed_bytes(table: CostTable, shape: PipelineShape) -> list[float]:
    """Per-micro-batch bytes every chunk holds besides its layers' activations: the boundary
    output of every chunk but the last, which its stage keeps as the root of its backward (not
    under an engine that frees it: `CostTable.keeps_outputs`)."""
    return list(_chunk_fixed_bytes(shape, table.boundary_bytes if table.keeps_outputs else 0.0))


@lru_cache(maxsize=4096)
def _chunk_fixed_bytes(shape: PipelineShape, boundary_bytes: float) -> tuple[float, ...]:
    num_chunks = shape.num_chunks
    return tuple(boundary_bytes if c < num_chunks - 1 else 0.0 for c in range(num_chunks))


def reduction_windows(shape: PipelineShape, rank: int) -> tuple[tuple[float, float, float], ...]:
    """(b, f, i) of each window a rank's per-micro-batch reductions must fit in (ZeRO-2/3).

    From any backward of the rank to its compute end the rank runs b backwards and f forwards
    and idles i (whole-rank units), and releases b reductions, so the reduction stream ends at
    least b D - b B - f F - i (F + B) after the compute (D, B, F: the rank's reduction, backward
    and forward of one micro-batch). Which backward binds depends on D, B and F (the first: the
    whole step's; in the cool-down, where reductions longer than the backward pile up, the
    drain's idle decides), so each window that can bind is a row
    (`simulation.factors.reduction_windows`)."""
    from meshplan.planner.simulation.factors import reduction_windows as played_windows

    return played_windows(*shape.replay_key)[rank]


def pipelined_every_microbatch(problem: StageProblem) -> bool:
    """ZeRO-2/3 under pipelining: every micro-batch's reduction runs beside the pipeline's own
    transfers and ends on the rank's own clock (`reduction_drain_s`)."""
    return problem.grad_sync == "overlap_every_microbatch" and problem.shape.num_stages > 1


def boundaries_on(shape: PipelineShape, rank: int) -> int:
    """Chunk boundaries whose transfers this rank sends or receives (a V's tip has none)."""
    count = 0
    for c in range(shape.num_chunks - 1):
        a, b = shape.rank_of(c), shape.rank_of(c + 1)
        if a != b:
            count += (a == rank) + (b == rank)
    return count


def reduction_contention_s(problem: StageProblem, rank: int) -> float:
    """c_r: per whole-rank action in a reduction window, the fair-share delay a reduction stream
    sharing the link its boundary transfers use pays (it ends half their time later,
    `simulation.contention`): every action sends or receives one transfer per boundary, so a
    window of b backwards and f forwards is delayed c_r (b + f), c_r = b_r P / 2 (b_r: the
    rank's boundaries)."""
    if not (pipelined_every_microbatch(problem) and problem.dp_shares_pp_link):
        return 0.0
    return boundaries_on(problem.shape, rank) * problem.table.p2p_s / 2


def drain_rank_s(rank: int, bwd_s, virtual_stages: int, p2p_s: float):
    """L_r: rank r's compute ends r backward chunks (and transfers) before rank 0's, which runs
    the pipeline's last backward; a reduction exposed on rank r counts from its own end."""
    return rank * (bwd_s * (1.0 / virtual_stages) + p2p_s)


def exposed_dp_s(grad_sync: str, grad_comm_s: float, first_s: float, fwd_s: float, bwd_s: float,
                 windows: tuple[tuple[float, float, float], ...] = (), contention_s: float = 0.0,
                 wait_s: float = 0.0) -> float:
    """Per-step gradient reduction of one rank that compute does not hide (the maths above);
    `windows`: `reduction_windows` of the rank (ZeRO-2/3: every micro-batch's reduction);
    `contention_s`: `reduction_contention_s`, per action of a window; `wait_s`: T_max - T_r, what
    the rank waits for the slowest every steady-state micro-batch (one per forward of a window)."""
    if grad_sync == "after_chunk":  # torch pipelining: a chunk's reduction blocks the rank
        return max(first_s, grad_comm_s)
    exposed = max(first_s, grad_comm_s - bwd_s)
    if grad_sync == "overlap_every_microbatch":
        exposed = max([exposed] + [b * (grad_comm_s - bwd_s) - f * (fwd_s + wait_s) - i * (fwd_s + bwd_s)
                                   + contention_s * (b + f) for b, f, i in windows])
    return exposed


def rank_tail_s(problem: StageProblem, rank: int, exposed_s: float, bwd_s: float, tail_s: float) -> float:
    """What rank r adds after the pipeline's compute ends: its exposed reduction (counted from its
    own compute end under pipelined ZeRO-2/3, never below zero), optimizer and gathers, fixed work."""
    if pipelined_every_microbatch(problem):
        shape = problem.shape
        exposed_s = max(0.0, exposed_s - drain_rank_s(rank, bwd_s, shape.virtual_stages, problem.table.p2p_s))
    return exposed_s + tail_s + problem.table.rank_fixed_s


def pass_gather_s(table: CostTable, chunk_of_layer, option_of_layer,
                  num_chunks: int) -> tuple[list[float], list[float]]:
    """Per chunk, (forward, backward): the gather its forward's first layer and its backward's
    first (the chunk's last layer) wait for with no layer before them in the chunk to hide it
    (`OptionCost.fwd_head_s`, `bwd_head_s`; the change beside a pinned first or last layer is in
    that layer's option: `tables._fold_pinned_neighbours`)."""
    fwd, bwd = [0.0] * num_chunks, [0.0] * num_chunks
    last = len(chunk_of_layer) - 1
    for layer, (chunk, index) in enumerate(zip(chunk_of_layer, option_of_layer)):
        option = table.option(layer, index)
        if layer == 0 or chunk_of_layer[layer - 1] != chunk:
            fwd[chunk] += option.fwd_head_s
        if layer == last or chunk_of_layer[layer + 1] != chunk:
            bwd[chunk] += option.bwd_head_s
    return fwd, bwd


@dataclass(frozen=True)
class RankSums:
    """Per-chunk and per-rank sums of an assignment that the objective's rows read."""

    chunk_time_s: tuple[float, ...]  # t_c: forward + backward of one micro-batch, heads and fixed work in
    rank_time_s: tuple[float, ...]  # T_r
    grad_comm_s: tuple[float, ...]  # D_r
    fwd_s: tuple[float, ...]  # F_r (heads in)
    bwd_s: tuple[float, ...]  # B_r (heads in)
    after_s: tuple[float, ...]  # Q_r: optimizer and parameter gathers
    never_hidden_s: tuple[float, ...]  # the reduction of the rank's first layer
    slowest_s: float  # T_max


def rank_sums(problem: StageProblem, chunk_of_layer, option_of_layer) -> RankSums:
    """The sums of `evaluate_assignment`'s formulas for one assignment."""
    table, shape = problem.table, problem.shape
    pp, num_chunks = shape.num_stages, shape.num_chunks
    chunk_time = chunk_fixed_s(table, num_chunks)
    grad_comm, fwd, bwd, tail = ([0.0] * pp for _ in range(4))
    for chunk, heads in enumerate(zip(*pass_gather_s(table, chunk_of_layer, option_of_layer, num_chunks))):
        chunk_time[chunk] += sum(heads)
        fwd[shape.rank_of(chunk)] += heads[0]
        bwd[shape.rank_of(chunk)] += heads[1]
    for layer, (chunk, index) in enumerate(zip(chunk_of_layer, option_of_layer)):
        option = table.option(layer, index)
        rank = shape.rank_of(chunk)
        chunk_time[chunk] += option.time_s + _reshard(table, layer, chunk_of_layer, option_of_layer)
        grad_comm[rank] += option.dp_comm_s
        fwd[rank] += option.fwd_s
        bwd[rank] += option.bwd_s
        tail[rank] += option.param_gather_s + option.optimizer_s
    rank_time = [sum(chunk_time[c] for c in shape.chunks_on(r)) for r in range(pp)]
    first = [chunk_of_layer.index(r) for r in range(pp)]  # a rank's first layer: its last gradients
    never_hidden = [table.option(first[r], option_of_layer[first[r]]).dp_comm_s for r in range(pp)]
    slowest = _slowest_rank_s(problem, chunk_of_layer, option_of_layer, chunk_time, rank_time)
    return RankSums(tuple(chunk_time), tuple(rank_time), tuple(grad_comm), tuple(fwd), tuple(bwd), tuple(tail),
                    tuple(never_hidden), slowest)


def exposed_rank_s(problem: StageProblem, sums: RankSums, rank: int) -> float:
    """E_r: rank r's reduction that its compute does not hide, counted from the pipeline's end
    (pipelined ZeRO-2/3: from the rank's own end, `rank_tail_s`)."""
    r = rank
    # only every micro-batch's reduction reads the windows (each a replay of the schedule)
    windows = reduction_windows(problem.shape, r) if problem.grad_sync == "overlap_every_microbatch" else ()
    return exposed_dp_s(problem.grad_sync, sums.grad_comm_s[r], sums.never_hidden_s[r], sums.fwd_s[r],
                        sums.bwd_s[r], windows, reduction_contention_s(problem, r), sums.slowest_s - sums.rank_time_s[r])


def evaluate_assignment(problem: StageProblem, chunk_of_layer, option_of_layer, peaks=None):
    """(objective_s, chunk_time_s, rank_mem_bytes) of one assignment, by the formulas above.

    `peaks`: `live_vectors` of every rank, if already computed."""
    table, shape = problem.table, problem.shape
    sums = rank_sums(problem, chunk_of_layer, option_of_layer)
    exposed = [rank_tail_s(problem, r, exposed_rank_s(problem, sums, r), sums.bwd_s[r], sums.after_s[r])
               for r in range(shape.num_stages)]
    slowest_weight, sum_weight = shape.weights
    objective = (slowest_weight * sums.slowest_s + sum_weight * sum(sums.rank_time_s)
                 + shape.transfers_on_path * table.p2p_s + max(exposed))
    return (objective, sums.chunk_time_s,
            memory_of_assignment(problem, chunk_of_layer, option_of_layer, peaks))


def _slowest_rank_s(problem: StageProblem, chunk_of_layer, option_of_layer, chunk_time, rank_time) -> float:
    """T_max of an assignment: the slowest rank, an interleaved chunk's v t_c, 1F1B's cycle."""
    table, shape = problem.table, problem.shape
    num_chunks, v = shape.num_chunks, shape.virtual_stages
    # Interleaved: T_max >= v t_c, less the first layer's time in the first chunk and the last
    # layer's in the last (the embedding and the head: the played schedule absorbs them).
    even = list(chunk_time)
    last = len(chunk_of_layer) - 1
    if chunk_of_layer[0] == 0:
        even[0] -= table.option(0, option_of_layer[0]).time_s
    if chunk_of_layer[last] == num_chunks - 1:
        even[-1] -= table.option(last, option_of_layer[last]).time_s
    slowest = max(max(rank_time), v * max(even))
    if shape.transfer_cycle and table.p2p_s > 0:  # every rank but the bottleneck waits 2P per micro-batch
        bottleneck = rank_time.index(max(rank_time))
        slowest = max([slowest] + [t + 2 * table.p2p_s for r, t in enumerate(rank_time) if r != bottleneck])
    return slowest


def memory_of_assignment(problem: StageProblem, chunk_of_layer, option_of_layer, peaks=None) -> tuple:
    """Per-rank memory of one assignment: resident states, the largest transient buffer, torch
    pipelining's receive buffers, and the activations (and boundary outputs) of the micro-batches
    live at each of the schedule's peaks."""
    table, shape = problem.table, problem.shape
    pp = shape.num_stages
    chunk_act = chunk_fixed_bytes(table, shape)
    static, buffer = [0.0] * pp, [0.0] * pp
    for layer, (chunk, index) in enumerate(zip(chunk_of_layer, option_of_layer)):
        option = table.option(layer, index)
        chunk_act[chunk] += option.act_bytes
        static[shape.rank_of(chunk)] += option.static_bytes
        buffer[shape.rank_of(chunk)] = max(buffer[shape.rank_of(chunk)], option.buffer_bytes)
    received = receive_bytes(table, shape)
    rank_mem = []
    for r in range(pp):
        rank_peaks = peaks[r] if peaks is not None else live_vectors(shape, r)
        act = max(sum(live[j] * chunk_act[c] for j, c in enumerate(shape.chunks_on(r))) for live in rank_peaks)
        rank_mem.append(static[r] + act + buffer[r] + received[r])
    return tuple(rank_mem)


def receive_bytes(table: CostTable, shape: PipelineShape, kept_sends: bool = True) -> list[float]:
    """Per rank: the receive buffers in transit and, under the multi-chunk schedules, the sends
    kept (`simulation.schedules.held_boundary_bytes`). `kept_sends` False: the buffers alone, a
    lower bound that replays no schedule (for `bounds`)."""
    return list(_receive_bytes(shape, table.boundary_bytes, kept_sends and table.keeps_outputs))


@lru_cache(maxsize=4096)
def _receive_bytes(shape: PipelineShape, boundary_bytes: float, kept_sends: bool) -> tuple[float, ...]:
    from meshplan.planner.simulation.schedules import held_boundary_bytes

    if shape.num_stages == 1:
        return (0.0,)
    return tuple(held_boundary_bytes(shape.schedule, shape.num_stages, shape.num_microbatches, shape.virtual_stages,
                                     shape.rank_of, [boundary_bytes] * (shape.num_chunks - 1), kept_sends))


def _reshard(table: CostTable, layer: int, chunk_of_layer, option_of_layer) -> float:
    """Resharding before `layer` when its (tp, dp) differs from the previous layer's in its chunk."""
    if layer == 0 or chunk_of_layer[layer - 1] != chunk_of_layer[layer] or not table.reshard_s:
        return 0.0
    here, before = table.option(layer, option_of_layer[layer]), table.option(layer - 1, option_of_layer[layer - 1])
    return 2 * table.reshard_s if (here.tp, here.dp) != (before.tp, before.dp) else 0.0


def pipeline_factor(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                    weight_share: float = 0.5) -> float:
    """Step time of balanced stages in units of one rank's per-micro-batch time, as simulated
    (`simulation.factors.step_factor`, forward 1 and backward 2 per chunk, W `weight_share` of it)."""
    from meshplan.planner.simulation.factors import step_factor

    return step_factor(schedule, num_stages, num_microbatches, virtual_stages, weight_share=weight_share)


def heuristic_start(problem: StageProblem, structure: tuple[int, int, int]):
    """A feasible compact assignment to start the MIP from, or None: run layers spread so chunk
    times are even (fastest option), then, rank by rank while over the memory limit, the layer
    in the chunk with the most live micro-batches switched to the leanest option."""
    table, shape = problem.table, problem.shape
    first, count, type_index = structure
    options = table.types[type_index].options
    fast = min(range(len(options)), key=lambda o: (options[o].time_s, o))
    lean = min(range(len(options)), key=lambda o: (options[o].act_bytes, options[o].time_s, o))
    num_chunks, pp = shape.num_chunks, shape.num_stages
    const = chunk_fixed_s(table, num_chunks)
    leading = leading_chunks(first, count, num_chunks)
    for layer, chunk in enumerate(leading):  # the pinned layers before the run
        const[chunk] += table.types[table.layer_type[layer]].min_time_s()
    const[-1] += trailing_min_s(table, first, count)
    pinned = set(leading)
    pinned |= {num_chunks - 1} if first + count < table.num_layers else set()
    # the run starts in the last chunk of the layers before it: none in the chunks before that
    closed = set(range(leading[-1])) if leading else set()
    peaks = [live_vectors(shape, r) for r in range(pp)]
    weight = [max(live[c // pp] for live in peaks[shape.rank_of(c)]) for c in range(num_chunks)]
    counts = [[0] * len(options) for _ in range(num_chunks)]
    for c in range(num_chunks):
        if c not in pinned:
            counts[c][fast] = 1
    if sum(map(sum, counts)) > count:
        return None

    def chunk_s(c):
        return const[c] + sum(n * options[o].time_s for o, n in enumerate(counts[c]))
    times = [chunk_s(c) for c in range(num_chunks)]  # kept equal to chunk_s(c), chunk by chunk
    open_chunks = [c for c in range(num_chunks) if c not in closed]
    for _ in range(count - sum(map(sum, counts))):  # extra layers where they hold fewest micro-batches
        c = min(open_chunks, key=lambda c: (times[c] + options[fast].time_s, weight[c], c))
        counts[c][fast] += 1
        times[c] = chunk_s(c)
    pinned_options = {layer: min(range(len(table.types[table.layer_type[layer]].options)),
                                 key=lambda o: table.types[table.layer_type[layer]].options[o].act_bytes)
                      for layer in range(table.num_layers) if not first <= layer < first + count}
    if problem.mem_limit_bytes is None:
        return counts, pinned_options
    return _fit_memory(problem, structure, counts, times, weight, chunk_s, pinned_options, peaks, (fast, lean))


def _fit_memory(problem: StageProblem, structure: tuple[int, int, int], counts, times, weight, chunk_s,
                pinned_options, peaks, fast_lean: tuple[int, int]):
    """`heuristic_start`'s repair: while a rank is over the memory limit, switch one layer of its
    chunk with the most live micro-batches (preferring chunks with room below the slowest) from
    its option to the leanest; `counts` and `times` are updated in place. The assignment, or
    None when a rank cannot be brought under the limit."""
    table, shape, limit = problem.table, problem.shape, problem.mem_limit_bytes
    first, count, type_index = structure
    options, (fast, lean) = table.types[type_index].options, fast_lean
    state = _CountMemory(problem, counts, first, pinned_options, peaks)
    for _ in range(count + 1):
        memory = state.memory
        if any(abs(m - limit) <= 1e-9 * limit for m in memory):  # too close to call in another summation order
            chunks, chosen = expand_counts(counts, first, table.num_layers, shape.num_chunks, pinned_options)
            memory = memory_of_assignment(problem, chunks, chosen, peaks)
        over = [r for r in range(shape.num_stages) if memory[r] > limit]
        if not over:
            return counts, pinned_options
        movable = [c for c in shape.chunks_on(over[0]) if any(counts[c][o] for o in range(len(options)) if o != lean)]
        if not movable:
            return None
        slowest = max(times)
        extra = options[lean].time_s - options[fast].time_s
        # Prefer chunks with room below the slowest, then the most live micro-batches.
        c = min(movable, key=lambda c: (times[c] + extra > slowest, -weight[c], c))
        o = next(o for o in range(len(options)) if o != lean and counts[c][o])
        counts[c][o] -= 1
        counts[c][lean] += 1
        times[c] = chunk_s(c)
        state.moved(c, o, lean)
    return None


class _CountMemory:
    """`memory_of_assignment` of a compact assignment kept from its counts as layers change
    option (equal up to rounding; `heuristic_start` rechecks exactly near the limit)."""

    def __init__(self, problem: StageProblem, counts, first: int, pinned_options: dict[int, int], peaks):
        table, shape = problem.table, problem.shape
        self.shape, self.counts, self.peaks = shape, counts, peaks
        pp, num_chunks = shape.num_stages, shape.num_chunks
        self.options = table.types[table.layer_type[first]].options
        self.chunk_act = chunk_fixed_bytes(table, shape)
        self.static, self.pinned_buffer = [0.0] * pp, [0.0] * pp
        count = sum(map(sum, counts))
        for layer, index in pinned_options.items():
            chunk = pinned_chunk(layer, first, count, num_chunks)
            option = table.option(layer, index)
            rank = shape.rank_of(chunk)
            self.chunk_act[chunk] += option.act_bytes
            self.static[rank] += option.static_bytes
            self.pinned_buffer[rank] = max(self.pinned_buffer[rank], option.buffer_bytes)
        for c, row in enumerate(counts):
            rank = shape.rank_of(c)
            for o, n in enumerate(row):
                if n:
                    self.chunk_act[c] += n * self.options[o].act_bytes
                    self.static[rank] += n * self.options[o].static_bytes
        self.memory = [self._rank(r) for r in range(pp)]

    def _rank(self, rank: int) -> float:
        chunks = self.shape.chunks_on(rank)
        buffer = self.pinned_buffer[rank]
        for c in chunks:
            for o, n in enumerate(self.counts[c]):
                if n:
                    buffer = max(buffer, self.options[o].buffer_bytes)
        act = max(sum(live[j] * self.chunk_act[c] for j, c in enumerate(chunks)) for live in self.peaks[rank])
        return self.static[rank] + act + buffer

    def moved(self, chunk: int, old: int, new: int) -> None:
        """One layer of `chunk` went from option `old` to `new` (counts already updated)."""
        rank = self.shape.rank_of(chunk)
        self.chunk_act[chunk] += self.options[new].act_bytes - self.options[old].act_bytes
        self.static[rank] += self.options[new].static_bytes - self.options[old].static_bytes
        self.memory[rank] = self._rank(rank)


def trailing_min_s(table: CostTable, first: int, count: int) -> float:
    """Least time of the layers after a compact run of `count` layers from `first`, all pinned to
    the last chunk (the head, and multi-token-prediction depths before it:
    `CostTable.last_chunk_layers`)."""
    return sum(table.types[table.layer_type[layer]].min_time_s() for layer in range(first + count, table.num_layers))


def leading_chunks(first: int, count: int, num_chunks: int) -> tuple[int, ...]:
    """The chunk of each of the `first` layers before a compact run of `count` layers
    (`formulation.pinned_structure`): the first layer in chunk 0, and the blocks after it (a
    dense-first mixture of experts' dense blocks) N // C to a chunk from chunk 0 on, so no chunk
    holds more of them than the run's share."""
    share = max(1, count // num_chunks)
    return tuple(max(0, layer - 1) // share for layer in range(first))


def pinned_chunk(layer: int, first: int, count: int, num_chunks: int) -> int:
    """The chunk of a layer outside a compact run: `leading_chunks` before it, the last chunk after."""
    return leading_chunks(first, count, num_chunks)[layer] if layer < first else num_chunks - 1


def compact_counts(assignment, structure: tuple[int, int, int], num_layers: int, num_chunks: int,
                   num_options: int):
    """(counts, pinned_options) of a (chunk_of_layer, option_of_layer) assignment, the inverse of
    `expand_counts`, or None where the assignment is not one the compact ILP accepts (its run layers
    out of chunk order, or a pinned layer off its chunk)."""
    chunks, options = assignment
    first, count, type_index = structure
    if len(chunks) != num_layers or len(options) != num_layers:
        return None
    run = range(first, first + count)
    if any(chunks[a] > chunks[b] for a, b in zip(run, run[1:])):
        return None
    if any(chunks[layer] != pinned_chunk(layer, first, count, num_chunks)
           for layer in range(num_layers) if layer not in run):
        return None
    if any(not 0 <= options[layer] < num_options for layer in run):
        return None
    counts = [[0] * num_options for _ in range(num_chunks)]
    for layer in run:
        counts[chunks[layer]][options[layer]] += 1
    return counts, {layer: options[layer] for layer in range(num_layers) if layer not in run}


def expand_counts(counts, first: int, num_layers: int, num_chunks: int, pinned_options: dict[int, int]):
    """(chunk_of_layer, option_of_layer) of a compact assignment: per chunk and option, how many
    run layers, plus the pinned first and last layers' options."""
    chunks, chosen = [0] * num_layers, [0] * num_layers
    count = sum(map(sum, counts))
    for layer, option in pinned_options.items():
        chunks[layer], chosen[layer] = pinned_chunk(layer, first, count, num_chunks), option
    layer = first
    for c, row in enumerate(counts):
        for o, n in enumerate(row):
            for _ in range(n):
                chunks[layer], chosen[layer] = c, o
                layer += 1
    return chunks, chosen
