"""The event engine behind `meshplan simulate`: one training step played action by action.

Input is already costed (`planner.simulation.step_costs.StepCosts`: one `LayerCost` per layer and the
chunk each layer sits in);
`planner.simulation.simulator` builds it from a model graph and a cluster. All data- and tensor-parallel
replicas of a pipeline stage run the same thing at the same time, so one rank per pipeline stage
is simulated.

Per pipeline rank:
- compute stream: the schedule's forward/backward actions in order (`planner.simulation.schedules`; without
  pipelining, forward and backward alternate per micro-batch as the executor accumulates). An
  action's duration is its chunk's compute plus the TP collectives, which block compute, plus
  the ZeRO-3 all-gathers that one-layer-ahead prefetch cannot hide (`step_costs.pass_end_times`,
  precomputed per chunk by `step_costs.build_chunks`).
- p2p stream: a boundary activation (gradient) leaves when its forward (backward) ends and
  arrives `p2p_time_s` later; the receiver's action cannot start before it arrives. Transfers
  overlap compute; transfers do not share a link with each other (1F1B keeps at most one transfer per
  direction in flight per link). torch's `Schedule1F1B` waits for a send together with the next
  receive; in steady state both complete when the peer finishes, so this is not modelled.
- dp stream, `grad_sync="overlap"`: a chunk's gradients are reduced in buckets, reverse layer
  order: DDP's of about `grad_bucket_bytes` each, FSDP2's one per layer (its unit, under
  `replicate` or `fully_shard`: `step_costs._buckets`); a bucket starts when the last
  micro-batch's backward has finished all its layers and the stream is free.
  `"overlap_every_microbatch"`: the same after every micro-batch's backward (ZeRO-2/3 keeping
  gradients sharded while accumulating), each reduction costing the per-step time.
  `grad_sync="after_chunk"` (torch pipelining with FSDP/replicate): a chunk's whole reduction
  starts after its last backward and the rank's next compute waits for it. The rank then runs
  the optimizer and, with ZeRO-1/2, all-gathers the updated parameters. The step ends when the
  slowest rank does.
- contention: streams sharing a link (the reduction with TP collectives on NVLink, or with the
  rank's boundary transfers) split its bandwidth; `planner.simulation.contention` charges the
  fair-share delays to the rank's compute and reduction ends.
- memory: parameters, gradients and optimizer states are resident; a chunk's saved activations
  (and its boundary output, which the pipeline stage keeps for the backward) are allocated when
  its forward starts and freed when its backward (B, or W of a split backward) ends; the largest
  transient buffer of the rank's layers is added at the peak.
- split backward (zero-bubble schedules): I and W are the parts of B that
  `planner.simulation.split_backward` assigns them; a V's tip hands tensors over locally.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from meshplan.planner.contracts.prediction import Interval, MemoryBreakdown, Prediction
from meshplan.planner.simulation.contention import rank_delays
from meshplan.planner.costing.engine_memory import keeps_stage_outputs
from meshplan.planner.costing.offload import host_fits, host_state_bytes_per_node
from meshplan.planner.simulation.schedules import Action, held_boundary_bytes, schedule_actions
from meshplan.planner.simulation.split_backward import action_part, with_weight_grad
from meshplan.planner.simulation.step_costs import Chunk, StepCosts, build_chunks


class _Run(NamedTuple):
    """One played action; the wait before it, split by cause."""

    action: Action
    start_s: float
    end_s: float
    bubble_s: float  # waiting for another rank's compute
    pp_wait_s: float  # waiting for the boundary transfer
    dp_wait_s: float  # compute held back by a gradient reduction (grad_sync "after_chunk")


@dataclass(frozen=True)
class _Played:
    """Every rank's played actions in schedule order, and reductions launched during the play."""

    runs: tuple[tuple[_Run, ...], ...]  # per rank
    fwd_end: tuple[tuple[float, ...], ...]  # [chunk][microbatch]
    bwd_end: tuple[tuple[float, ...], ...]
    dp_intervals: tuple[tuple[tuple[float, float], ...], ...]  # per rank ("after_chunk" only)
    busy_s: tuple[float, ...] = ()  # per rank: the sum of its actions' durations, in order


class _PlayInputs(NamedTuple):
    """What the play reads, per chunk and per rank: each rank's action order, the boundary
    transfer after each chunk, each action kind's seconds per chunk, each chunk's rank and
    gradient-reduction seconds."""

    orders: list
    transfer_s: list[float]
    seconds: dict[str, list[float]]
    chunk_rank: list[int]
    reduce_s: list[float]


def _play_inputs(costs: StepCosts, chunks: list[Chunk]) -> _PlayInputs:
    cfg = costs.config
    # Without pipelining the executor accumulates gradients forward, backward, forward, ...
    # (1F1B's order for one stage) whatever schedule the plan names.
    schedule = "1f1b" if cfg.pp == 1 else cfg.schedule
    orders = schedule_actions(schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages,
                              cfg.microbatch_group_size if cfg.pp > 1 else None)
    seconds = {kind: [action_part(chunk, kind).fwd_s if kind == "F" else action_part(chunk, kind).bwd_s
                      for chunk in chunks] for kind in "FBIW"}
    return _PlayInputs(orders, list(costs.p2p_time_s) or [0.0] * (cfg.num_model_chunks - 1), seconds,
                       [chunk.rank for chunk in chunks], [chunk.grad_reduce_s for chunk in chunks])


def _reduce_after_chunk(intervals: list[tuple[float, float]], end: float, reduce_s: float) -> float:
    """Launch a chunk's whole gradient reduction after its last backward (`grad_sync="after_chunk"`)
    on the rank's dp stream; returns when it ends, which the rank's next compute waits for."""
    reduce_start = max(end, intervals[-1][1] if intervals else 0.0)
    intervals.append((reduce_start, reduce_start + reduce_s))
    return reduce_start + reduce_s


def _publish(done: list[Action], end: float, fwd_end, bwd_end, waiting_for: dict, ready_ranks: deque) -> None:
    """Mark `done` actions' outputs sent at `end` and wake the ranks parked on them (the rare path:
    a DualPipeV "F;B" pair, whose forward's output leaves when the pair ends)."""
    for action in done:
        ends, key = (fwd_end, "F") if action.kind == "F" else (bwd_end, "B")
        ends[action.chunk][action.microbatch] = end
        woken = waiting_for.pop((key, action.chunk, action.microbatch), None)
        if woken is not None:
            ready_ranks.append(woken)


def _play(costs: StepCosts, chunks: list[Chunk], record: bool = True) -> _Played:
    """Run every rank's action list; an action starts when its rank is free and its input is in.

    Split backwards: I publishes the input gradient (as B does), W depends on nothing remote. A
    DualPipeV "F;B" pair runs its two actions back to back and its forward's output is only sent
    when the pair ends (torch posts both sends after the pair). This loop runs once per action
    of the step, so its common path is written out flat. `record` False keeps only each rank's
    last action in `runs` (what a step time needs). Worklist: a rank runs until its next
    action's input is missing, then parks on the action that produces it and is woken when that
    action is published: O(actions) in all."""
    cfg = costs.config
    num_mb, pp = cfg.num_microbatches, cfg.pp
    orders, transfer, seconds, chunk_rank, reduce_s = _play_inputs(costs, chunks)
    last_chunk, last_mb = len(chunks) - 1, num_mb - 1
    after_chunk = costs.grad_sync == "after_chunk"
    fwd_end = [[-1.0] * num_mb for _ in range(cfg.num_model_chunks)]
    bwd_end = [[-1.0] * num_mb for _ in range(cfg.num_model_chunks)]
    runs: list[list[_Run]] = [[] for _ in range(pp)]
    dp_intervals: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    position, free_at, blocked_until, busy = [0] * pp, [0.0] * pp, [0.0] * pp, [0.0] * pp
    held: list[Action | None] = [None] * pp  # the forward of an "F;B" pair, not yet sent
    waiting_for: dict[tuple[str, int, int], int] = {}
    ready_ranks = deque(range(pp))
    new, run = tuple.__new__, _Run  # what _Run(...) does, without its Python-level __new__
    while ready_ranks:
        rank = ready_ranks.popleft()
        order = orders[rank]
        pos, count = position[rank], len(order)
        rank_runs, rank_free, rank_blocked, rank_held = runs[rank], free_at[rank], blocked_until[rank], held[rank]
        rank_busy = busy[rank]
        while pos < count:
            action = order[pos]
            kind, chunk, mb, overlap = action
            # the input: F reads the previous chunk's output, B and I the next chunk's input
            # gradient (W only its own I, earlier on this rank); a neighbour on the same rank
            # (the tip of a V) hands its tensor over without a transfer
            if kind == "F" and chunk > 0:
                dep_end = fwd_end[chunk - 1][mb]
                if dep_end < 0:
                    waiting_for[("F", chunk - 1, mb)] = rank
                    break
                link_s = 0.0 if chunk_rank[chunk - 1] == chunk_rank[chunk] else transfer[chunk - 1]
            elif (kind == "B" or kind == "I") and chunk < last_chunk:
                dep_end = bwd_end[chunk + 1][mb]
                if dep_end < 0:
                    waiting_for[("B", chunk + 1, mb)] = rank
                    break
                link_s = 0.0 if chunk_rank[chunk + 1] == chunk_rank[chunk] else transfer[chunk]
            else:
                dep_end = link_s = 0.0
            free = rank_blocked if rank_blocked > rank_free else rank_free
            arrival = dep_end + link_s
            start = arrival if arrival > free else free
            end = start + seconds[kind][chunk]
            if record or pos == count - 1:
                bubble, link_wait = dep_end - free, start - (dep_end if dep_end > free else free)
                rank_runs.append(new(run, (action, start, end, bubble if bubble > 0.0 else 0.0,
                                           link_wait if link_wait > 0.0 else 0.0, free - rank_free)))
            rank_busy += end - start
            rank_free = end
            if after_chunk and (kind == "B" or kind == "W") and mb == last_mb:
                rank_blocked = _reduce_after_chunk(dp_intervals[rank], end, reduce_s[chunk])
            pos += 1
            if rank_held is None and not overlap:  # the common case: the action publishes itself
                if kind == "W":
                    continue
                ends, key = (fwd_end, "F") if kind == "F" else (bwd_end, "B")
                ends[chunk][mb] = end
                woken = waiting_for.pop((key, chunk, mb), None)
                if woken is not None:
                    ready_ranks.append(woken)
                continue
            # a pair: its forward is held until the pair ends, then both leave together
            published = ([action] if kind != "W" else []) + ([rank_held] if rank_held is not None else [])
            rank_held = action if overlap else None
            _publish([] if overlap else published, end, fwd_end, bwd_end, waiting_for, ready_ranks)
        position[rank], free_at[rank], blocked_until[rank], held[rank] = pos, rank_free, rank_blocked, rank_held
        busy[rank] = rank_busy
    if any(position[rank] < len(order) for rank, order in enumerate(orders)):  # a schedule bug
        raise AssertionError(f"pipeline schedule deadlocked at positions {position}")
    return _Played(tuple(map(tuple, runs)), tuple(map(tuple, fwd_end)), tuple(map(tuple, bwd_end)),
                   tuple(map(tuple, dp_intervals)), tuple(busy))


@dataclass(frozen=True)
class _RankTail:
    """What happens on one rank after its compute: DP reduction, optimizer, parameter gather."""

    compute_end_s: float
    dp_intervals: tuple[tuple[float, float], ...]
    dp_end_s: float
    optimizer_s: float
    param_gather_s: float
    # fair-share delays of concurrent traffic (planner.simulation.contention)
    compute_delay_s: float = 0.0
    dp_delay_s: float = 0.0

    @property
    def end_s(self) -> float:
        return (max(self.compute_end_s + self.compute_delay_s, self.dp_end_s + self.dp_delay_s)
                + self.optimizer_s + self.param_gather_s)


def _rank_tails(costs: StepCosts, chunks: list[Chunk], played: _Played) -> list[_RankTail]:
    cfg = costs.config
    every = costs.grad_sync == "overlap_every_microbatch"
    microbatches = range(cfg.num_microbatches) if every else [cfg.num_microbatches - 1]
    optimizer_s = [0.0] * cfg.pp
    gather_s = [0.0] * cfg.pp
    for cost, chunk in zip(costs.layer_costs, costs.chunk_of_layer):
        optimizer_s[chunks[chunk].rank] += cost.optimizer_step_s
        gather_s[chunks[chunk].rank] += cost.dp_param_gather_s
    tails = []
    for rank in range(cfg.pp):
        intervals = list(played.dp_intervals[rank])
        if costs.grad_sync != "after_chunk":
            ready = []
            for index, chunk in enumerate(chunks):
                if chunk.rank != rank:
                    continue
                for mb in microbatches:
                    bwd_start = played.bwd_end[index][mb] - chunk.bwd_s
                    ready.extend((bwd_start + offset_s, comm_s) for offset_s, comm_s in chunk.buckets)
            free_at = 0.0
            for ready_s, comm_s in sorted(ready):
                start = max(free_at, ready_s)
                free_at = start + comm_s
                intervals.append((start, free_at))
        dp_end = intervals[-1][1] if intervals else 0.0
        compute_end = played.runs[rank][-1].end_s
        if intervals and costs.dp_link:
            # only what overlaps a reduction can be delayed by it (the rest adds zeros)
            first_s, last_s = min(start for start, _ in intervals), max(end for _, end in intervals)
            runs = [run for run in played.runs[rank] if run.end_s > first_s and run.start_s < last_s]
            transfers = ([(start, end) for start, end in _transfers_of(rank, costs, chunks, played)
                          if end > first_s and start < last_s] if costs.pp_link == costs.dp_link else [])
            delays = rank_delays(intervals, runs, chunks, transfers, costs.dp_link, costs.pp_link)
        else:
            delays = rank_delays(intervals, played.runs[rank], chunks, [], costs.dp_link, costs.pp_link)
        tails.append(_RankTail(compute_end, tuple(intervals), dp_end, optimizer_s[rank], gather_s[rank],
                               delays.compute_s, delays.dp_s))
    return tails


def _transfers_of(rank: int, costs: StepCosts, chunks: list[Chunk], played: _Played) -> list[tuple[float, float]]:
    """(start, end) of the boundary transfers this rank sends or receives."""
    if not costs.p2p_time_s or not costs.pp_link:
        return []
    out = []
    for chunk in range(len(chunks) - 1):
        if rank not in (chunks[chunk].rank, chunks[chunk + 1].rank) or chunks[chunk].rank == chunks[chunk + 1].rank:
            continue  # not this rank's boundary, or the tip of a V (no transfer)
        link_s = costs.p2p_time_s[chunk]
        out.extend((end, end + link_s) for end in played.fwd_end[chunk])  # activations forward
        out.extend((end, end + link_s) for end in played.bwd_end[chunk + 1])  # gradients back
    return out


def _memory(costs: StepCosts, chunks: list[Chunk], played: _Played, curves: bool = True):
    """Per rank: breakdown at the peak, and the (time, live bytes) curve over the step (empty
    without `curves`)."""
    cfg = costs.config
    resident = [[0.0, 0.0, 0.0] for _ in range(cfg.pp)]
    buffers, reserved_buffers = [0.0] * cfg.pp, [0.0] * cfg.pp
    experts = [0.0] * cfg.pp
    rank_scale = [1.0] * cfg.pp
    # the caching allocator's fragmentation around what each layer allocates and frees
    # (`LayerCost.reserve_scale`; 1 for meshplan's executor): saved bytes per chunk, as reserved
    reserved_sizes = [chunk.activation_bytes for chunk in chunks]
    for cost, chunk in zip(costs.layer_costs, costs.chunk_of_layer):
        rank = chunks[chunk].rank
        experts[rank] += cost.expert_state_bytes
        resident[rank][0] += cost.param_bytes
        resident[rank][1] += cost.grad_bytes
        resident[rank][2] += cost.optimizer_bytes
        buffers[rank] = max(buffers[rank], cost.buffer_bytes)
        reserved_buffers[rank] = max(reserved_buffers[rank], cost.buffer_bytes * cost.reserve_scale)
        reserved_sizes[chunk] += cost.activation_bytes * (cost.reserve_scale - 1.0)
        rank_scale[rank] = max(rank_scale[rank], cost.reserve_scale)
    if cfg.pp > 1:  # receive buffers in transit, a multi-chunk schedule's kept sends
        last_of_chunk = {chunk: cost for cost, chunk in zip(costs.layer_costs, costs.chunk_of_layer)}
        boundaries = [last_of_chunk[c].output_bytes for c in range(len(chunks) - 1)]
        kept = held_boundary_bytes(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages,
                                   lambda c: chunks[c].rank, boundaries, keeps_stage_outputs(cfg.engine),
                                   cfg.microbatch_group_size)
        buffers = [b + k for b, k in zip(buffers, kept)]
        reserved_buffers = [b + k * scale for b, k, scale in zip(reserved_buffers, kept, rank_scale)]
    sizes = [chunk.activation_bytes for chunk in chunks]
    breakdowns, out = [], []
    for rank in range(cfg.pp):
        base = sum(resident[rank])
        live = peak = reserved_live = reserved_peak = 0.0
        curve = [(0.0, base)]
        for run in played.runs[rank]:
            kind, chunk = run.action.kind, run.action.chunk
            if kind == "F":  # saved activations grow while the forward runs
                live += sizes[chunk]
                reserved_live += reserved_sizes[chunk]
                peak, reserved_peak = max(peak, live), max(reserved_peak, reserved_live)
                if curves:
                    curve.append((run.start_s, base + live))
            elif kind == "B" or kind == "W":  # B, or W after a split backward (I keeps them)
                live -= sizes[chunk]
                reserved_live -= reserved_sizes[chunk]
                if curves:
                    curve.append((run.end_s, base + live))
        params, grads, optimizer = resident[rank]
        # the caching allocator's fragmentation around what the step allocates and frees, counted
        # with the buffers (`engine_memory.layer_transient_scale`; none for meshplan's executor)
        fragmented = max(0.0, reserved_peak - peak) + max(0.0, reserved_buffers[rank] - buffers[rank])
        breakdowns.append(MemoryBreakdown(params=params, grads=grads, optimizer=optimizer,
                                          activations=peak, buffers=buffers[rank] + fragmented, experts=experts[rank],
                                          fragmented=fragmented))
        out.append(tuple(curve) if curves else ())
    return tuple(breakdowns), tuple(out)


def simulate_step(costs: StepCosts, timeline: bool = False) -> Prediction:
    """Play one optimizer step of a costed configuration; see the module docstring for the model."""
    chunks = with_weight_grad(costs, build_chunks(costs))
    played = _play(costs, chunks)
    tails = _rank_tails(costs, chunks, played)
    step_s = max(tail.end_s for tail in tails)
    memory, curves = _memory(costs, chunks, played, curves=timeline)
    peak_bytes = max(m.total for m in memory)
    host_bytes = _host_bytes_per_node(costs, chunks)
    busy = list(played.busy_s)
    busiest = busy.index(max(busy))
    breakdown = _breakdown(chunks, played.runs[busiest], tails[busiest], step_s)
    gpus = costs.config.gpus
    model_flops_per_gpu_s = costs.model_flops_per_step / step_s / gpus if step_s > 0 else 0.0
    return Prediction(
        step_time_s=step_s,
        tokens_per_s=costs.tokens_per_step / step_s if step_s > 0 else 0.0,
        model_tflops_per_gpu=model_flops_per_gpu_s / 1e12,
        hw_tflops_per_gpu=(costs.hw_flops_per_step / step_s / gpus / 1e12) if step_s > 0 else 0.0,
        mfu=model_flops_per_gpu_s / costs.peak_flops_per_s if costs.peak_flops_per_s > 0 else 0.0,
        peak_memory_bytes=peak_bytes,
        memory=memory,
        bubble_fraction=breakdown["bubble"] / step_s if step_s > 0 else 0.0,
        fits=peak_bytes <= costs.usable_memory_bytes and host_fits(host_bytes, costs.usable_host_memory_bytes),
        breakdown=breakdown,
        timeline=_intervals(costs, chunks, played, tails, step_s) if timeline else (),
        memory_timeline=curves if timeline else (),
        host_state_bytes_per_node=host_bytes,
    )


def _host_bytes_per_node(costs: StepCosts, chunks: list[Chunk]) -> float:
    """The offloaded states on the heaviest node (`costing.offload.host_state_bytes_per_node`)."""
    per_rank = [0.0] * costs.config.pp
    for cost, chunk in zip(costs.layer_costs, costs.chunk_of_layer):
        per_rank[chunks[chunk].rank] += cost.host_state_bytes
    return host_state_bytes_per_node(per_rank, costs.config.gpus, costs.gpus_per_node)


def _breakdown(chunks: list[Chunk], runs: tuple[_Run, ...], tail: _RankTail, step_s: float) -> dict[str, float]:
    """Exposed seconds of the busiest rank's step by cause; they add up to the step time."""
    out = dict.fromkeys(("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_comm", "bubble",
                         "optimizer"), 0.0)
    for run in runs:
        chunk = action_part(chunks[run.action.chunk], run.action.kind)  # I and W: their part of B
        if run.action.kind == "F":
            out["compute"] += chunk.fwd_compute_s
            out["tp_comm"] += chunk.fwd_tp_s
            out["cp_comm"] += chunk.fwd_cp_s
            out["ep_comm"] += chunk.fwd_ep_s
            out["dp_comm"] += chunk.fwd_zero_s
        else:
            out["compute"] += chunk.bwd_compute_s
            out["recompute"] += chunk.recompute_s
            out["tp_comm"] += chunk.bwd_tp_s
            out["cp_comm"] += chunk.bwd_cp_s
            out["ep_comm"] += chunk.bwd_ep_s
            out["dp_comm"] += chunk.bwd_zero_s
        out["bubble"] += run.bubble_s
        out["pp_comm"] += run.pp_wait_s
        out["dp_comm"] += run.dp_wait_s
    out["tp_comm"] += tail.compute_delay_s  # TP collectives slowed by a concurrent reduction
    compute_end = tail.compute_end_s + tail.compute_delay_s
    out["dp_comm"] += max(0.0, tail.dp_end_s + tail.dp_delay_s - compute_end) + tail.param_gather_s
    out["optimizer"] += tail.optimizer_s
    out["bubble"] += step_s - tail.end_s  # waiting for slower ranks to finish the step
    return out


def _intervals(costs: StepCosts, chunks: list[Chunk], played: _Played, tails: list[_RankTail], step_s: float):
    """The timeline: each action's pieces in order, transfers, reductions, optimizer, and idle
    spans where the compute stream waits between actions or for the end of the step."""
    out: list[Interval] = []
    last = costs.config.num_model_chunks - 1
    transfer = list(costs.p2p_time_s) or [0.0] * last
    for rank, runs in enumerate(played.runs):
        previous_end = 0.0
        for run in runs:
            if run.start_s > previous_end:
                out.append(Interval(rank, "compute", "idle", previous_end, run.start_s))
            out.extend(_action_intervals(rank, run, chunks, transfer, last))
            previous_end = run.end_s
        tail = tails[rank]
        out.extend(Interval(rank, "dp", "dp_comm", s, e) for s, e in tail.dp_intervals)
        if tail.dp_delay_s > 0:  # the reduction's fair-share slowdown, shown where it ends
            out.append(Interval(rank, "dp", "dp_comm", tail.dp_end_s, tail.dp_end_s + tail.dp_delay_s))
        if tail.compute_delay_s > 0:
            out.append(Interval(rank, "tp", "tp_comm", previous_end, previous_end + tail.compute_delay_s))
            previous_end += tail.compute_delay_s
        opt_start = max(tail.compute_end_s + tail.compute_delay_s, tail.dp_end_s + tail.dp_delay_s)
        if opt_start > previous_end:
            out.append(Interval(rank, "compute", "idle", previous_end, opt_start))
        if tail.optimizer_s > 0:
            out.append(Interval(rank, "compute", "optimizer", opt_start, opt_start + tail.optimizer_s))
        if tail.param_gather_s > 0:
            gather_start = opt_start + tail.optimizer_s
            out.append(Interval(rank, "dp", "dp_comm", gather_start, gather_start + tail.param_gather_s))
        if step_s > tail.end_s:
            out.append(Interval(rank, "compute", "idle", tail.end_s, step_s))
    return tuple(out)


def _action_intervals(rank: int, run: _Run, chunks: list[Chunk], transfer: list[float], last: int) -> list[Interval]:
    """One action's pieces (exposed ZeRO-3 gather, compute, TP collectives) and its transfer."""
    action, chunk = run.action, action_part(chunks[run.action.chunk], run.action.kind)
    if action.kind == "F":
        # expert parallelism: dispatch before the expert GEMMs, combine after (each half the pass's all-to-all time)
        pieces = (("dp", "zero_gather", chunk.fwd_zero_s),
                  ("compute", "forward", chunk.fwd_compute_s - chunk.fwd_expert_s), ("ep", "ep_comm", chunk.fwd_ep_s / 2),
                  ("compute", "forward", chunk.fwd_expert_s), ("ep", "ep_comm", chunk.fwd_ep_s / 2),
                  ("tp", "tp_comm", chunk.fwd_tp_s), ("cp", "cp_comm", chunk.fwd_cp_s))
        peer = action.chunk + 1 if action.chunk < last else None
    else:
        expert_s = min(chunk.bwd_expert_s, chunk.bwd_compute_s)  # W of a split backward keeps only its share
        pieces = (("dp", "zero_gather", chunk.bwd_zero_s), ("compute", "recompute", chunk.recompute_s),
                  ("compute", "backward", chunk.bwd_compute_s - expert_s), ("ep", "ep_comm", chunk.bwd_ep_s / 2),
                  ("compute", "backward", expert_s), ("ep", "ep_comm", chunk.bwd_ep_s / 2),
                  ("tp", "tp_comm", chunk.bwd_tp_s), ("cp", "cp_comm", chunk.bwd_cp_s))
        peer = action.chunk - 1 if action.chunk > 0 and action.kind != "W" else None  # W sends nothing
    out, at = [], run.start_s
    for stream, kind, seconds in pieces:
        if seconds > 0:
            out.append(Interval(rank, stream, kind, at, at + seconds, action.microbatch, action.chunk))
            at += seconds
    if peer is not None and chunks[peer].rank != rank:
        link_s = transfer[min(peer, action.chunk)]
        out.append(Interval(rank, "p2p", "send", run.end_s, run.end_s + link_s, action.microbatch, action.chunk))
        out.append(Interval(chunks[peer].rank, "p2p", "recv", run.end_s, run.end_s + link_s, action.microbatch, peer))
    return out
