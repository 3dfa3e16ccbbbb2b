"""The ILP's assignment re-scored by the exact critical path and improved by a local search.

The ILP (`formulation`) is linear in the assignment: it charges the slowest rank, the sum of
ranks and an interleaved chunk's stall (`tmax_chunk_c`) with factors that are exact for equal
chunks. Chunks that differ (layers that do not divide over the chunks, embedding and head), with
few micro-batches or V-shaped schedules, play otherwise. So the search's best assignments are
scored by the step the schedule really plays (`critical_path`: the longest path of its action
graph under the same per-layer costs, fixed work per action and transfers) plus each rank's own
tail after its compute (the ILP's reduction rules, optimizer, gathers, fixed work), and improved
by moves where that path runs:

- boundary moves: the last layer of a chunk to the next chunk, or the first layer of a chunk to
  the previous one (contiguity and non-empty chunks hold by construction; the head and the
  multi-token-prediction depths before it stay in the last chunk, `CostTable.last_chunk_layers`);
- option flips: one layer of a chunk to another of its options (recomputation; layerwise degrees).

Each iteration ranks the moves by the change the current critical path predicts (the step is the
maximum of linear functions, so a move the path does not predict to gain cannot gain) and plays the
most promising few exactly; the first that shortens the step within the memory limit is taken.
The search stops when no move gains or its time budget is spent.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import NamedTuple

from meshplan.planner.search.ilp.critical_path import ChunkTimes, CriticalPath, action_nodes, critical_path
from meshplan.planner.search.ilp.evaluation import (chunk_fixed_s, memory_of_assignment,
                                                    pass_gather_s, rank_sums)

# Moves played exactly per iteration, best predicted first.
TRIES_PER_ROUND = 6
# A move must shorten the step by this fraction to count (float noise is not a gain).
MIN_GAIN = 1e-9


def assignment_times(problem, chunk_of_layer, option_of_layer) -> ChunkTimes:
    """Per chunk: the forward, backward and W of one micro-batch and the step's reduction, from
    the same option costs, chunk heads and fixed work per action the ILP sums (`rank_sums`)."""
    table, num_chunks = problem.table, problem.shape.num_chunks
    fixed = chunk_fixed_s(table, num_chunks)  # a forward and a backward action per chunk
    fwd = [f / 2 for f in fixed]
    bwd = [f / 2 for f in fixed]
    weight, reduce = [0.0] * num_chunks, [0.0] * num_chunks
    for chunk, (fwd_head, bwd_head) in enumerate(zip(*pass_gather_s(table, chunk_of_layer, option_of_layer,
                                                                     num_chunks))):
        fwd[chunk] += fwd_head
        bwd[chunk] += bwd_head
    previous = None
    for layer, (chunk, index) in enumerate(zip(chunk_of_layer, option_of_layer)):
        option = table.option(layer, index)
        fwd[chunk] += option.fwd_s
        bwd[chunk] += option.bwd_s
        weight[chunk] += option.weight_grad_s
        reduce[chunk] += option.dp_comm_s
        if previous is not None and previous[0] == chunk and (previous[1].tp, previous[1].dp) != (option.tp, option.dp):
            fwd[chunk] += table.reshard_s  # one resharding per direction (`evaluation._reshard`)
            bwd[chunk] += table.reshard_s
        previous = (chunk, option)
    return ChunkTimes(tuple(fwd), tuple(bwd), tuple(weight), tuple(reduce))


def exact_step_s(problem, chunk_of_layer, option_of_layer) -> tuple[float, CriticalPath]:
    """The step of an assignment as its schedule plays: the latest rank's end, its compute (or,
    with blocking reductions, their end), then its reduction's exposed rest, optimizer, gathers and
    fixed work; and the critical path."""
    shape, table = problem.shape, problem.table
    sums = rank_sums(problem, chunk_of_layer, option_of_layer)
    blocking = problem.grad_sync == "after_chunk"
    after = [sums.after_s[r] + table.rank_fixed_s for r in range(shape.num_stages)]
    times = assignment_times(problem, chunk_of_layer, option_of_layer)
    path = critical_path(shape.schedule, shape.num_stages, shape.num_microbatches, shape.virtual_stages,
                         times, table.p2p_s, blocking, after)
    if blocking:
        ends = [max(path.compute_end_s[r], path.reduce_end_s[r]) + after[r] for r in range(shape.num_stages)]
    else:
        reductions = _reduction_ends(problem, chunk_of_layer, option_of_layer, times, path)
        ends = [max(path.compute_end_s[r] + compute_delay_s, reduction_end_s) + after[r]
                for r, (reduction_end_s, compute_delay_s) in enumerate(reductions)]
    return max(ends), path


class _Pass(NamedTuple):
    """What `simulation.contention.rank_delays` reads of a played action and of a chunk."""

    action: tuple  # (kind, chunk) as .kind, .chunk
    start_s: float
    end_s: float


class _Kind(NamedTuple):
    kind: str
    chunk: int


class _ChunkTp(NamedTuple):
    fwd_tp_s: float
    bwd_tp_s: float


def _reduction_ends(problem, chunk_of_layer, option_of_layer, times: ChunkTimes,
                    path: CriticalPath) -> list[tuple[float, float]]:
    """Per rank: (when its gradient reduction stream ends, how much later its compute ends), with
    the fair-share delays of the traffic that shares the reduction's link (`simulation.contention`:
    the boundary transfers on the same link, the TP collectives when it is NVLink). A layer's
    reduction is ready when the layer's backward ends, in the last micro-batch's backward or, under
    `overlap_every_microbatch`, in every one's; the stream runs them one at a time in that order."""
    from meshplan.planner.simulation.contention import rank_delays

    shape, table = problem.shape, problem.table
    every = problem.grad_sync == "overlap_every_microbatch"
    fixed = chunk_fixed_s(table, shape.num_chunks)
    # per chunk: (offset of each layer's backward end from the backward's start, its reduction)
    offsets: list[list[tuple[float, float]]] = [[] for _ in range(shape.num_chunks)]
    done = list(pass_gather_s(table, chunk_of_layer, option_of_layer, shape.num_chunks)[1])
    tp = [[0.0, 0.0] for _ in range(shape.num_chunks)]
    for layer in range(len(chunk_of_layer) - 1, -1, -1):
        chunk, option = chunk_of_layer[layer], table.option(layer, option_of_layer[layer])
        done[chunk] += option.bwd_s
        tp[chunk][0] += option.fwd_tp_s
        tp[chunk][1] += option.bwd_tp_s
        at = done[chunk] + (fixed[chunk] / 2 if layer == 0 or chunk_of_layer[layer - 1] != chunk else 0.0)
        if option.dp_comm_s > 0:
            offsets[chunk].append((at, option.dp_comm_s))
    last_mb = shape.num_microbatches - 1
    pp = shape.num_stages
    ready: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    sends: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    runs: list[list[_Pass]] = [[] for _ in range(pp)]
    rank_of = [shape.rank_of(c) for c in range(shape.num_chunks)]
    nodes = action_nodes(shape.schedule, pp, shape.num_microbatches, shape.virtual_stages)
    shares = problem.dp_shares_pp_link and table.p2p_s > 0
    on_nvlink = problem.dp_link == "nvlink" and any(f or b for f, b in tp)
    durations = {"F": times.fwd_s, "B": times.bwd_s, "W": times.weight_s,
                 "I": [b - w for b, w in zip(times.bwd_s, times.weight_s)]}
    for (rank, kind, chunk, microbatch), end in zip(nodes, path.node_end_s):
        if kind in ("B", "I") and (every or microbatch == last_mb):
            start = end - times.bwd_s[chunk]  # the whole backward's start, as the engine counts it
            ready[rank].extend((start + offset, comm) for offset, comm in offsets[chunk])
        if shares and kind != "W":  # the transfer this action sends, seen from both ends
            peer = chunk + 1 if kind == "F" else chunk - 1
            if 0 <= peer < shape.num_chunks and rank_of[peer] != rank:
                interval = (end, end + table.p2p_s)
                sends[rank].append(interval)
                sends[rank_of[peer]].append(interval)
        if on_nvlink:
            runs[rank].append(_Pass(_Kind(kind, chunk), end - durations[kind][chunk], end))
    chunks_tp = [_ChunkTp(f, b) for f, b in tp]
    out = []
    for rank in range(pp):
        free, intervals = 0.0, []
        for at, comm in sorted(ready[rank]):
            start = max(free, at)
            free = start + comm
            intervals.append((start, free))
        delays = rank_delays(intervals, runs[rank], chunks_tp, sends[rank] if shares else [],
                             problem.dp_link or "link", problem.dp_link or "link")
        out.append((free + delays.dp_s, delays.compute_s))
    return out


def _parts(option) -> tuple[float, float, float, float]:
    """A layer's share of its chunk's F, B, I and W actions."""
    return option.fwd_s, option.bwd_s, option.bwd_s - option.weight_grad_s, option.weight_grad_s


def _predicted(path: CriticalPath, layer_parts, source: int, target: int) -> float:
    """Change of the step along the current critical path when a layer of these parts leaves
    chunk `source` for chunk `target` (-1: none; an option flip is a leave and a join)."""
    change = 0.0
    for kind, seconds in enumerate(layer_parts):
        if target >= 0:
            change += path.on_path[target][kind] * seconds
        if source >= 0:
            change -= path.on_path[source][kind] * seconds
    return change


def _moves(problem, chunks: list[int], options: list[int], path: CriticalPath):
    """(predicted change, new chunks, new options) of every boundary move and option flip the
    critical path predicts to gain, best first."""
    table, num_layers = problem.table, len(chunks)
    pinned_from = num_layers - table.last_chunk_layers  # the head and MTP depths stay in the last chunk
    found = []
    for layer in range(num_layers):
        chunk, option = chunks[layer], table.option(layer, options[layer])
        first = layer == 0 or chunks[layer - 1] != chunk
        last = layer == num_layers - 1 or chunks[layer + 1] != chunk
        alone = (first and last) or layer >= pinned_from
        if first and layer > 0 and not alone:  # to the previous chunk
            found.append((_predicted(path, _parts(option), chunk, chunk - 1), layer, chunk - 1, options[layer]))
        if last and layer < num_layers - 1 and not alone:  # to the next chunk
            found.append((_predicted(path, _parts(option), chunk, chunk + 1), layer, chunk + 1, options[layer]))
        if any(path.on_path[chunk]):
            for index, other in enumerate(table.types[table.layer_type[layer]].options):
                if index != options[layer]:
                    gain = _predicted(path, _parts(other), -1, chunk) - _predicted(path, _parts(option), -1, chunk)
                    found.append((gain, layer, chunk, index))
    found = [move for move in found if move[0] < 0]
    found.sort()
    seen, out = set(), []
    for gain, layer, chunk, index in found:
        # identical layers in a chunk make identical flips: play one of them
        key = (table.layer_type[layer], chunks[layer], options[layer], chunk, index)
        if key in seen:
            continue
        seen.add(key)
        new_chunks, new_options = list(chunks), list(options)
        new_chunks[layer], new_options[layer] = chunk, index
        out.append((gain, new_chunks, new_options))
    return out


def refine_assignment(problem, chunk_of_layer, option_of_layer, budget_s: float):
    """(step_s, chunk_of_layer, option_of_layer) after the local search (see the module docstring)
    from an assignment that fits; `budget_s` bounds its wall time."""
    deadline = time.perf_counter() + budget_s
    chunks, options = list(chunk_of_layer), list(option_of_layer)
    step, path = exact_step_s(problem, chunks, options)
    limit = problem.mem_limit_bytes
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for _, new_chunks, new_options in _moves(problem, chunks, options, path)[:TRIES_PER_ROUND]:
            if time.perf_counter() >= deadline:
                break
            if limit is not None and max(memory_of_assignment(problem, new_chunks, new_options)) > limit:
                continue
            new_step, new_path = exact_step_s(problem, new_chunks, new_options)
            if new_step < step * (1 - MIN_GAIN):
                chunks, options, step, path, improved = new_chunks, new_options, new_step, new_path, True
                break
    return step, tuple(chunks), tuple(options)


def refine_solution(problem, solution, budget_s: float):
    """The solution with the refined assignment and its exact step as its objective (time
    objective, pipelined, feasible; anything else unchanged)."""
    if problem.objective != "time" or not solution.feasible or problem.shape.num_stages == 1:
        return solution
    step, chunks, options = refine_assignment(problem, solution.chunk_of_layer, solution.option_of_layer, budget_s)
    sums = rank_sums(problem, chunks, options)
    return replace(solution, objective_s=step, chunk_of_layer=chunks, option_of_layer=options,
                   chunk_time_s=sums.chunk_time_s, rank_mem_bytes=memory_of_assignment(problem, chunks, options))


def refine_best(solved: list, num_keep: int, budget_s: float) -> list:
    """`solved` (the search's feasible candidates in ILP order) with the first `num_keep`
    solutions refined (`refine_solution`), sharing `budget_s` of wall time; the order is kept, so
    the same candidates go on to be simulated."""
    out, deadline = list(solved), time.perf_counter() + budget_s
    head = [index for index, item in enumerate(out[:num_keep]) if item.problem is not None]
    for done, index in enumerate(head):
        share = (deadline - time.perf_counter()) / (len(head) - done)  # unspent time passes on
        out[index] = replace(out[index], solution=refine_solution(out[index].problem, out[index].solution,
                                                                  max(0.0, share)))
    return out
