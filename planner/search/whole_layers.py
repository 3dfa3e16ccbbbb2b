"""Whole layers within a rank's memory: the least time of n identical layers, each at one of its
options, whose bytes fit a budget, for `bounds.memory_bound_s`.

The bound's g_r(x) mixes options fractionally along their convex hull; with a handful of layers
per rank the best whole mix is several percent slower, and the pipeline term weighs T_max over a
hundred times (F - p/v), so the difference decides whether a candidate needs its ILP at all.

- `least_whole_s(options, budget, n)`: the rank's layers all held at its least live count (the
  rank's weight w_r): an exact search over the counts per option.
- `least_chunked_s(run, live, budget, n, cap)`: a rank of v chunks, chunk j holding live_j
  micro-batches at the rank's peak, at most `cap` of the layers in a chunk (the interleaved rule
  T_max >= v t_c caps a chunk's layers at T_max / v): a layer of option o in chunk j takes
  s_o + live_j a_o bytes. Pareto sets of (bytes, seconds) per layer count, chunk by chunk.

Both are at least the fractional g_r(n), and at most the time of any assignment the ILP accepts
for that rank (its chunks' layer counts and options are one of the mixes searched), so the bound
stays below every ILP objective.
"""
from __future__ import annotations

import math

# Layers per rank above which the chunked search is not run (its Pareto sets grow with the count);
# the bound then keeps the weaker whole-layer figure at the least live count.
MAX_CHUNKED_LAYERS = 12


def undominated(points) -> tuple[tuple[float, float], ...]:
    """(bytes, seconds) options no other option beats on both, fastest first, bytes decreasing."""
    kept: list[tuple[float, float]] = []
    for point in sorted(set(points), key=lambda p: (p[1], p[0])):
        if not kept or point[0] < kept[-1][0]:
            kept.append(point)
    return tuple(kept)


def _slack(budget: float) -> float:
    return 1e-12 * abs(budget)  # float rounding must not refuse a mix that fits


def least_whole_s(options: tuple[tuple[float, float], ...], budget: float, layers: int) -> float:
    """h(n): the least seconds of `layers` whole layers, each at one of `options` ((bytes,
    seconds), `undominated`), whose bytes fit `budget`; inf when none do. The counts per option
    are searched fastest option first, cut off once the rest cannot beat the best found."""
    if layers <= 0:
        return 0.0
    best = math.inf
    last, slack = len(options) - 1, _slack(budget)

    def search(index: int, left: int, left_bytes: float, time_s: float) -> None:
        nonlocal best
        size, seconds = options[index]
        if index == last:
            if left * size <= left_bytes + slack:
                best = min(best, time_s + left * seconds)
            return
        most = left if size <= 0 else min(left, math.floor((left_bytes + slack) / size))
        next_s = options[index + 1][1]
        for count in range(most, -1, -1):  # fewer on this option: more on slower ones
            if time_s + count * seconds + (left - count) * next_s >= best:
                break
            search(index + 1, left - count, left_bytes - count * size, time_s + count * seconds)

    search(0, layers, budget, 0.0)
    return best


def _pareto(points, limit: float) -> list[tuple[float, float]]:
    """The (bytes, seconds) points within `limit` bytes that no other beats on both."""
    kept: list[tuple[float, float]] = []
    for size, seconds in sorted(points):
        if size > limit:
            break
        if not kept or seconds < kept[-1][1]:
            kept.append((size, seconds))
    return kept


def least_chunked_s(run, live: tuple[int, ...], budget: float, layers: int, cap: int) -> float:
    """The least seconds of `layers` whole layers over a rank's chunks, at most `cap` in a chunk,
    a layer of option (static bytes, activation bytes, seconds) in chunk j taking static + live_j x
    activation bytes, all within `budget`; inf when no split fits."""
    if layers <= 0:
        return 0.0
    if cap <= 0 or layers > cap * len(live):
        return math.inf
    limit = budget + _slack(budget)
    counts: dict[int, list[tuple[float, float]]] = {0: [(0.0, 0.0)]}
    for index, held in enumerate(live):
        options = undominated((static + held * act, seconds) for static, act, seconds in run)
        per_count = [[(0.0, 0.0)]]  # Pareto sets of this chunk holding 0..cap layers
        for _ in range(min(cap, layers)):
            per_count.append(_pareto([(b + size, t + seconds) for b, t in per_count[-1] for size, seconds in options],
                                     limit))
        after = len(live) - index - 1  # chunks still to fill: they host at most cap each
        merged: dict[int, list[tuple[float, float]]] = {}
        for have, points in counts.items():
            for more, chunk_points in enumerate(per_count):
                total = have + more
                if total > layers or total + after * cap < layers or not chunk_points:
                    continue
                merged.setdefault(total, []).extend((b1 + b2, t1 + t2) for b1, t1 in points for b2, t2 in chunk_points)
        counts = {total: _pareto(points, limit) for total, points in merged.items()}
        counts = {total: points for total, points in counts.items() if points}
    return min((seconds for _, seconds in counts.get(layers, ())), default=math.inf)
