"""Concurrent traffic on one link: a fair-share correction to the played step.

The engine plays each stream as if it had its links to itself. On a real rank, the data-parallel
reduction overlaps the backward (whose tensor-parallel collectives use NVLink) and, under
pipelining, the boundary transfers (NVLink or a NIC). When two flows share a link they split its
bandwidth (NCCL channels on one NIC or NVLink port get a fair share each); the link's work is
conserved, so the overlapped seconds o of the uncontended play must be paid again. With two flows
at half rate each, each finishes o/2 later:

    dp_delay      = (o_tp + o_pp) / 2      the reduction (and the optimizer after it) ends later
    compute_delay = o_tp / 2               TP collectives block compute: the rank's compute ends later

o_tp counts the tensor-parallel traffic inside each overlapped action as spread evenly over it
(its TP seconds over its duration, times the overlapped time), and only when the DP group's
traffic runs on NVLink (a group inside one node). o_pp counts the rank's own sends and receives
that overlap a reduction on the same link (a transfer's share of the delay is not propagated to
the peer: in steady state the peer's own compute is its slack). Send and receive directions are
counted separately only through the transfers' own intervals: links are full duplex.
Parameter prefetches of ZeRO-3 are left out (they are small against a whole reduction).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple


class Delays(NamedTuple):
    compute_s: float  # added to the rank's compute end
    dp_s: float  # added to the rank's data-parallel stream end


def _overlap_s(a_start: float, a_end: float, b_start: float, b_end: float) -> float:
    return max(0.0, min(a_end, b_end) - max(a_start, b_start))


def rank_delays(dp_intervals, runs, chunks, transfers, dp_link: str, pp_link: str) -> Delays:
    """Fair-share delays of one rank. `runs`: the rank's played actions; `chunks`: per-chunk
    durations (`fwd_s`, `bwd_s`, `fwd_tp_s`, `bwd_tp_s`); `transfers`: the rank's (start, end)
    send and receive intervals; links are "nvlink", "nic" or "" (no such traffic)."""
    if not dp_intervals or not dp_link:
        return Delays(0.0, 0.0)
    covered = _coverage(dp_intervals)
    o_tp = o_pp = 0.0
    if dp_link == "nvlink":
        for run in runs:
            chunk = chunks[run.action.chunk]
            duration = run.end_s - run.start_s
            tp_s = chunk.fwd_tp_s if run.action.kind == "F" else chunk.bwd_tp_s
            if duration > 0 and tp_s > 0:
                o_tp += tp_s / duration * covered(run.start_s, run.end_s)
    if pp_link == dp_link:
        o_pp = sum(covered(start, end) for start, end in transfers)
    return Delays(o_tp / 2, (o_tp + o_pp) / 2)


def _coverage(intervals):
    """A function (a, b) -> the summed overlap of [a, b] with every one of `intervals`.

    The reduction stream's intervals are disjoint (one stream, one reduction at a time), so after
    sorting, the overlap is the stream's busy time up to b less its busy time up to a: a binary
    search each, instead of a pass over every interval (a step's m reductions against its 2m
    transfers per boundary would be quadratic). Overlapping intervals are summed one by one."""
    ordered = sorted(intervals)
    if any(ordered[i][1] > ordered[i + 1][0] for i in range(len(ordered) - 1)):
        return lambda a, b: sum(_overlap_s(start, end, a, b) for start, end in ordered)
    starts = [start for start, _ in ordered]
    busy_before = [0.0]  # busy time of the intervals before index i
    for start, end in ordered:
        busy_before.append(busy_before[-1] + (end - start))

    def busy_until(t: float) -> float:
        i = bisect_right(starts, t)  # intervals starting at or before t
        if i == 0:
            return 0.0
        start, end = ordered[i - 1]
        return busy_before[i - 1] + (min(t, end) - start)

    return lambda a, b: max(0.0, busy_until(b) - busy_until(a)) if b > a else 0.0


def link_kind(group_size: int, stride: int, gpus_per_node: int) -> str:
    """The link a group's traffic leaves a GPU on: "" for no group, NVLink inside a node."""
    if group_size <= 1:
        return ""
    return "nvlink" if (group_size - 1) * stride + 1 <= gpus_per_node else "nic"


def stream_links(config, gpus_per_node: int) -> tuple[str, str]:
    """(dp_link, pp_link) of a configuration: the links its data-parallel reduction and its
    pipeline transfers leave a GPU on (`link_kind`; pipeline neighbours are dp cp tp ranks apart)."""
    dp_link = link_kind(config.data_ranks, config.stride("cp"), gpus_per_node)  # dp x cp ranks, tp apart
    pp_link = link_kind(2, config.stride("pp"), gpus_per_node) if config.pp > 1 else ""
    return dp_link, pp_link
