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
(`planner.simulation.engine`) plays the same schedule by events; tests hold the two equal.
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
    """A schedule's actions in a topological order, with their rank-order and data predecessors."""

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
    orders = schedule_actions("1f1b" if num_stages == 1 else schedule, num_stages, num_microbatches,
                              virtual_stages)
    place = "1f1b" if num_stages == 1 else schedule
    ids: dict[tuple[int, int], int] = {}  # (rank, position) -> node
    flat = [(r, i, a) for r, order in enumerate(orders) for i, a in enumerate(order)]
    for index, (r, i, _) in enumerate(flat):
        ids[(r, i)] = index
    publisher: dict[tuple[str, int, int], int] = {}  # ("F" | "B", chunk, mb) -> node whose end sends it
    last_mb = num_microbatches - 1
    for r, order in enumerate(orders):
        for i, a in enumerate(order):
            if a.kind == "F":
                publisher[("F", a.chunk, a.microbatch)] = ids[(r, i + 1)] if a.overlap else ids[(r, i)]
            elif a.kind in ("B", "I"):
                publisher[("B", a.chunk, a.microbatch)] = ids[(r, i)]
    last_chunk = num_stages * virtual_stages - 1
    preds: list[list[int]] = []
    rank_prev, data_prev, remote, releases = [], [], [], []
    for r, i, a in flat:
        prev = ids[(r, i - 1)] if i else -1
        if a.kind == "F" and a.chunk > 0:
            source, other = publisher[("F", a.chunk - 1, a.microbatch)], a.chunk - 1
        elif a.kind in ("B", "I") and a.chunk < last_chunk:
            source, other = publisher[("B", a.chunk + 1, a.microbatch)], a.chunk + 1
        else:
            source, other = -1, a.chunk
        rank_prev.append(prev)
        data_prev.append(source)
        remote.append(source >= 0 and chunk_rank(place, num_stages, other) != chunk_rank(place, num_stages, a.chunk))
        releases.append(a.kind in ("B", "W") and a.microbatch == last_mb)  # one of the two per micro-batch
        preds.append([p for p in (prev, source) if p >= 0])
    order = _topological(preds)
    position = {node: k for k, node in enumerate(order)}

    def renumber(values):
        return tuple(position[v] if v >= 0 else -1 for v in (values[n] for n in order))
    return _Graph(rank=tuple(flat[n][0] for n in order), kind=tuple(_KINDS.index(flat[n][2].kind) for n in order),
                  chunk=tuple(flat[n][2].chunk for n in order),
                  microbatch=tuple(flat[n][2].microbatch for n in order), rank_prev=renumber(rank_prev),
                  data_prev=renumber(data_prev), remote=tuple(remote[n] for n in order),
                  releases=tuple(releases[n] for n in order),
                  last_node=tuple(position[ids[(r, len(o) - 1)]] for r, o in enumerate(orders)))


def _topological(preds: list[list[int]]) -> list[int]:
    """Kahn's order of a DAG given each node's predecessors; a cycle is a schedule bug."""
    succs: list[list[int]] = [[] for _ in preds]
    missing = [len(p) for p in preds]
    for node, ps in enumerate(preds):
        for p in ps:
            succs[p].append(node)
    ready = [node for node, count in enumerate(missing) if count == 0]
    order = []
    while ready:
        node = ready.pop()
        order.append(node)
        for s in succs[node]:
            missing[s] -= 1
            if missing[s] == 0:
                ready.append(s)
    if len(order) != len(preds):
        raise AssertionError(f"the schedule's action graph has a cycle ({len(preds) - len(order)} nodes on it)")
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
    for node in range(count):
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
    """(rank, kind, chunk, microbatch) of every action, in the order of `CriticalPath.node_end_s`."""
    g = _graph(schedule, num_stages, num_microbatches, virtual_stages)
    return tuple(zip(g.rank, (_KINDS[k] for k in g.kind), g.chunk, g.microbatch))
