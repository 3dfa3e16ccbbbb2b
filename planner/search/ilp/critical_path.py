r"""The exact step of a fixed pipeline schedule: the longest path of its action graph.

A schedule fixes, per pipeline rank, the order of its actions (`simulation.schedules.rank_actions`).
Each action (F, B, or a split backward's I and W, of chunk c and micro-batch j) is a node of a
DAG with two kinds of edges:

    rank order      the previous action of the same rank (and, under a blocking gradient
                    reduction, the end of the reductions launched before it on that rank)
    data            F(c, j) needs F(c-1, j), B/I(c, j) needs B/I(c+1, j), each plus one boundary
                    transfer P when the two chunks sit on different ranks (a V's tip hands over
                    locally); a DualPipeV "F;B" pair publishes its forward only when the pair ends

A node's end is max(ends of its predecessors [+ P]) + its duration, and the durations are sums of
the per-layer costs of the chunk, so the step is linear in the assignment along any fixed path:
this module evaluates it exactly, one pass over a topological order that depends on the schedule
alone (cached), and reports which chunks' actions lie on the critical path, which is where moving
a layer can shorten the step (`planner.search.ilp.refine`). The event engine
(`planner.simulation.event_engine`) plays the same schedule by events; tests hold the two equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from meshplan.planner.contracts.config import chunk_rank

_KINDS = "FBIW"


@dataclass(frozen=True)
class ChunkTimes:
    """Per chunk and micro-batch: forward, whole backward and its weight-gradient (W) part;
    per chunk and step: the gradient reduction that blocks the rank under `blocking` grad sync."""

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    weight_s: tuple[float, ...]
    reduce_s: tuple[float, ...]

    def __post_init__(self):
        sizes = {len(self.fwd_s), len(self.bwd_s), len(self.weight_s), len(self.reduce_s)}
        if len(sizes) != 1:
            raise ValueError(f"one time per chunk in every field, got lengths {sorted(sizes)}")
        for c, (bwd, weight) in enumerate(zip(self.bwd_s, self.weight_s)):
            if not 0.0 <= weight <= bwd + 1e-12:
                raise ValueError(f"chunk {c}: W part {weight} s outside its backward [0, {bwd}] s")


@dataclass(frozen=True)
class CriticalPath:
    """Per rank: when its compute and its blocking reductions end; and, on the longest path to the
    rank `critical_rank`, how many actions of each kind each chunk has and how many transfers."""

    compute_end_s: tuple[float, ...]
    reduce_end_s: tuple[float, ...]
    critical_rank: int
    node_end_s: tuple[float, ...]  # every action's end, in `action_nodes` order
    on_path: tuple[tuple[int, int, int, int], ...]  # per chunk: (F, B, I, W) actions on the path
    transfers_on_path: int


@dataclass(frozen=True)
class _Graph:
    """A schedule's actions (rank by rank, in each rank's order), a topological order of them,
    and their rank-order and data predecessors."""

    order: tuple[int, ...]
    rank: tuple[int, ...]
    kind: tuple[int, ...]  # index into "FBIW"
    chunk: tuple[int, ...]
    microbatch: tuple[int, ...]
    rank_prev: tuple[int, ...]  # previous node of the same rank, -1 for its first
    data_prev: tuple[int, ...]  # the node whose end publishes this node's input, -1 for none
    remote: tuple[bool, ...]  # the input crosses ranks (a transfer)
    releases: tuple[bool, ...]  # the last micro-batch's B or W of its chunk: a reduction may start
    last_node: tuple[int, ...]  # per rank


@lru_cache(maxsize=64)
def _graph(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int) -> _Graph:
    from meshplan.planner.simulation.schedules import schedule_actions

    # One stage plays forward, backward, ... whatever the schedule (the executor accumulates so).
    place = "1f1b" if num_stages == 1 else schedule
    orders = schedule_actions(place, num_stages, num_microbatches, virtual_stages)
    flat = [action for order in orders for action in order]  # node n: rank-major, in rank order
    rank = [r for r, order in enumerate(orders) for _ in order]
    first = [0] * (num_stages + 1)  # first node of each rank
    for r, order in enumerate(orders):
        first[r + 1] = first[r] + len(order)
    num_chunks = num_stages * virtual_stages
    width = num_microbatches
    # the node whose end sends F(c, j)'s output / B or I(c, j)'s input gradient, at c * m + j
    sends_fwd, sends_bwd = [-1] * (num_chunks * width), [-1] * (num_chunks * width)
    for n, a in enumerate(flat):
        if a.kind == "F":
            sends_fwd[a.chunk * width + a.microbatch] = n + 1 if a.overlap else n  # a pair sends when it ends
        elif a.kind in ("B", "I"):
            sends_bwd[a.chunk * width + a.microbatch] = n
    rank_of_chunk = [chunk_rank(place, num_stages, c) for c in range(num_chunks)]
    last_mb, last_chunk = num_microbatches - 1, num_chunks - 1
    rank_prev, data_prev, remote, releases = [], [], [], []
    for n, a in enumerate(flat):
        kind, chunk = a.kind, a.chunk
        if kind == "F" and chunk > 0:
            source, other = sends_fwd[(chunk - 1) * width + a.microbatch], chunk - 1
        elif (kind == "B" or kind == "I") and chunk < last_chunk:
            source, other = sends_bwd[(chunk + 1) * width + a.microbatch], chunk + 1
        else:
            source, other = -1, chunk
        rank_prev.append(n - 1 if n > first[rank[n]] else -1)
        data_prev.append(source)
        remote.append(source >= 0 and rank_of_chunk[other] != rank_of_chunk[chunk])
        releases.append((kind == "B" or kind == "W") and a.microbatch == last_mb)  # one of the two per micro-batch
    kinds = [_KINDS.index(a.kind) for a in flat]
    return _Graph(order=tuple(_topological(rank_prev, data_prev)), rank=tuple(rank), kind=tuple(kinds),
                  chunk=tuple(a.chunk for a in flat), microbatch=tuple(a.microbatch for a in flat),
                  rank_prev=tuple(rank_prev), data_prev=tuple(data_prev), remote=tuple(remote),
                  releases=tuple(releases), last_node=tuple(first[r + 1] - 1 for r in range(num_stages)))


def _topological(rank_prev: list[int], data_prev: list[int]) -> list[int]:
    """Kahn's order of the DAG whose nodes have these (at most two) predecessors; a cycle is a
    schedule bug."""
    count = len(rank_prev)
    # a node's end publishes its own output and, closing a DualPipeV pair, its forward's too
    consumers: list[list[int]] = [[] for _ in range(count)]
    missing = [0] * count
    for node in range(count):
        missing[node] = (rank_prev[node] >= 0) + (data_prev[node] >= 0)
        if data_prev[node] >= 0:
            consumers[data_prev[node]].append(node)
    ready = [node for node in range(count) if missing[node] == 0]
    order = []
    while ready:
        node = ready.pop()
        order.append(node)
        if node + 1 < count and rank_prev[node + 1] == node:
            missing[node + 1] -= 1
            if missing[node + 1] == 0:
                ready.append(node + 1)
        for succ in consumers[node]:
            missing[succ] -= 1
            if missing[succ] == 0:
                ready.append(succ)
    if len(order) != count:
        raise AssertionError(f"the schedule's action graph has a cycle ({count - len(order)} nodes on it)")
    return order


def critical_path(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int, times: ChunkTimes,
                  p2p_s: float, blocking: bool = False, rank_extra_s=None) -> CriticalPath:
    """The longest path of the schedule's action graph under `times` (see the module docstring).

    `blocking`: each chunk's reduction (`times.reduce_s`) starts after its last micro-batch's
    backward (B, or W of a split backward) once the rank's earlier reductions are done, and the
    rank's next action waits for it. `rank_extra_s[r]`: what rank r adds after its compute ends
    (its exposed reduction, optimizer, ...); the critical rank is the one whose compute end (or
    blocking reductions' end) plus that is latest."""
    g = _graph(schedule, num_stages, num_microbatches, virtual_stages)
    durations = (times.fwd_s, times.bwd_s, tuple(b - w for b, w in zip(times.bwd_s, times.weight_s)),
                 times.weight_s)
    count = len(g.kind)
    end = [0.0] * count
    cause = [0] * count  # 0: rank order (or start), 1: data, 2: a blocking reduction
    reduce_free = [0.0] * num_stages
    blocked = [0.0] * num_stages
    reduce_s = times.reduce_s
    for node in g.order:
        rank, prev, source = g.rank[node], g.rank_prev[node], g.data_prev[node]
        start, why = (end[prev] if prev >= 0 else 0.0), 0
        if blocking and blocked[rank] > start:
            start, why = blocked[rank], 2
        if source >= 0:
            ready = end[source] + (p2p_s if g.remote[node] else 0.0)
            if ready > start:
                start, why = ready, 1
        finish = start + durations[g.kind[node]][g.chunk[node]]
        end[node], cause[node] = finish, why
        if blocking and g.releases[node]:
            reduce_free[rank] = max(finish, reduce_free[rank]) + reduce_s[g.chunk[node]]
            blocked[rank] = reduce_free[rank]
    compute_end = tuple(end[n] for n in g.last_node)
    extra = rank_extra_s or [0.0] * num_stages
    critical = max(range(num_stages), key=lambda r: (max(compute_end[r], reduce_free[r]) + extra[r], -r))
    counts = [[0, 0, 0, 0] for _ in times.fwd_s]
    transfers, node = 0, g.last_node[critical]
    while node >= 0:  # back along the causes; a blocking reduction's wait is the rank's own work
        counts[g.chunk[node]][g.kind[node]] += 1
        if cause[node] == 1:
            transfers += g.remote[node]
            node = g.data_prev[node]
        else:
            node = g.rank_prev[node]
    return CriticalPath(compute_end, tuple(reduce_free), critical, tuple(end), tuple(map(tuple, counts)), transfers)


@lru_cache(maxsize=64)
def action_nodes(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int):
    """(rank, kind, chunk, microbatch) of every action, in the order of `CriticalPath.node_end_s`
    (rank by rank, each in its rank's order)."""
    g = _graph(schedule, num_stages, num_microbatches, virtual_stages)
    return tuple(zip(g.rank, (_KINDS[k] for k in g.kind), g.chunk, g.microbatch))
