r"""Lower bounds on a candidate's ILP objective, from cheapest to strongest.

The outer search prunes a candidate once a bound shows it cannot beat the `num_rerank`-th best
objective found so far; every bound here is at most the objective of every assignment the ILP
(`ilp.formulation`) accepts, so pruning never removes a plan the re-ranking would have seen.
With T_r the per-micro-batch time of rank r, T_max the slowest, the ILP minimises

    (F - p/v) T_max + (1/v) sum_r T_r + G P + Tail,      F: the schedule's step factor.

- `step_factor_floor`: F without replaying the schedule. Every rank runs its m micro-batches
  of v chunks one after another (3 units each: forward 1, backward 2, however the backward is
  split), and the last pipeline rank cannot start before the p - 1 forwards ahead of it, so
  step >= p - 1 + 3 m v units: F >= m + (p - 1) / (3 v). Exact for GPipe and 1F1B. Where the
  backward is whole (interleaved 1F1B), the last rank's last backward of its first chunk ends
  its work (every other action of the rank precedes it) and p - 1 backwards of the chunks below
  follow it, one per rank: step >= p - 1 + 3 m v + 2 (p - 1), F >= m + (p - 1) / v, Narayanan et
  al.'s bubble, which torch's order plays exactly (its m is a multiple of p; a test holds the
  two equal). A split backward's weight gradients may fill that drain, so those schedules keep
  the first.
- `compute_bound_s` (`solving.lower_bound_s`): sum_r T_r >= S, the sum of every layer's fastest
  option plus the chunks' fixed work, and T_max >= S / p, so the objective is >= F S / p + G P
  plus the average tail; under a pipeline T_max is also at least the last rank's own: the layers
  every assignment puts in the last chunk (the output layer and the multi-token-prediction depths
  before it) at their fastest, plus its chunks' fixed work.
- `reduction_bound_s` (in `search.reduction_bound`): rank r's exposed reduction E_r is at least its gradient reduction D_r less
  its backward B_r (under pipelined ZeRO-2/3, counted from its own end r (B_r / v + P) earlier),
  and the objective's max_r (E_r + tail_r) is at least their average; with a T_max >= S / p
  bound on the pipeline term, every layer contributes min over its options of
  a t_o + (d_o - h b_o + tail_o) / p (a = F / p, h = 1 or 1 + (p - 1) / v), and every chunk pass
  its least exposed gather (`least_heads_s`).
- `memory_bound_s` (the longest run of identical layers, `bound_structure`; any other layer but
  the first and last counts at its fastest time in sum_r T_r, its bytes left out; periodic blocks,
  which have no such run, are bounded on their floor, `bound_table`): memory forces leaner,
  slower options. Rank r holds, at its fullest peak, at least w_r micro-batches of every chunk it
  runs (w_r = max over the schedule's peaks of the least live count over its chunks), so a layer
  of option o costs it s_o + w_r a_o bytes out of a budget B_r (the limit less the pinned
  embedding/head, boundary outputs and the smallest transient buffer it must hold). Relaxing the
  layer counts n_ro to reals, g_r(x) = min sum_o n_ro t_o over sum_o n_ro = x within B_r is
  convex and piecewise linear in x. Then sum_r T_r >= min over x (sum_r x_r = N) of
  sum_r g_r(x_r) + k_r (cheapest slopes first), and T_max >= T*, the least T at which every
  rank's layers at most g_r^-1(T - k_r) add up to N, and T_max >= max_r k_r (a rank runs its pinned
  layers whether or not it holds run layers: the last one, with the head and MTP depths, may hold
  none). With whole layers (at the exact level; the
  first, replay-free refinement keeps g_r(n), cheaper), a rank that holds n of them takes at
  least h_r(n) >= g_r(n), the least time of n layers each at one option within B_r
  (a small exact search over the counts per option, `least_whole_s`: with a handful of layers
  per rank, g_r's fractional mix can be several percent below any whole one), so T_max is at
  least the N-th smallest k_r + h_r(n), n >= 1, and at least min_r h_r(ceil(N/p)) + k_r (some
  rank holds that many). At the exact level, with v > 1 chunks a rank, the interleaved rule
  T_max >= v (t_c) caps a chunk at c(T) = floor((T / v - o) / t_fastest) run layers, and each
  chunk's layers hold that chunk's own live micro-batches (not the rank's least): T_max is at
  least the least T >= T(c(T)), T(c) the N-th smallest k_r + h_r^c(n) of those capped splits
  (`whole_layers.least_chunked_s`; V-shaped ranks hold twice as many micro-batches of one chunk
  as of the other, which the least live count misses); and T_max >= v (ceil(N/C) t_fastest + o) (some chunk does, and
  the interleaved rule charges a chunk v times); 1F1B's cycle adds T_max >= (sum_r T_r + 2P (p-1))/p.
  The bound is (F - p/v) T_max + (1/v) sum_r T_r + G P + the average tail at these; infinite when no
  fractional assignment fits at all.
"""
from __future__ import annotations

import heapq
import math

from meshplan.planner.contracts.schedule import schedule_spec
from meshplan.planner.search.whole_layers import MAX_CHUNKED_LAYERS, least_chunked_s, least_whole_s, undominated

# Relative slack on the memory limit: HiGHS accepts rows a feasibility tolerance over their
# limit (GiB-scaled rows, about 1e-7), so the bound relaxes the limit by more than that.
LIMIT_SLACK = 1e-6


def step_factor_floor(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int) -> float:
    """A lower bound on `solving.pipeline_shape`'s step factor that replays nothing (see above)."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    if p == 1:
        return float(m)
    spec = schedule_spec(schedule)
    if spec.textbook_factor:
        return float(m + p - 1)
    fill = (p - 1) / v if not spec.split_backward else (p - 1) / (3.0 * v)
    return max(m + fill, p / v)


def average_tail_s(table, pp: int, grad_sync: str = "overlap") -> float:
    """The tail is at least the average per-rank optimizer + gather time plus the fixed work, and
    with a blocking reduction after each chunk (grad_sync "after_chunk") the whole reduction too."""
    return table.least_tail_s(grad_sync == "after_chunk") / pp + table.rank_fixed_s


def compute_bound_s(table, shape, grad_sync: str = "overlap", less_s: tuple[float, float] = (0.0, 0.0)) -> float:
    """Compute alone: every layer at its fastest option, and stages as balanced as whole layers
    allow (some rank holds ceil(N / p) of the longest run, some chunk ceil(N / C), which the
    interleaved rule charges v times). `less_s`: (seconds off the sum of every layer's fastest
    option, seconds off a run layer's), for a strategy whose layers are the table's less a cost
    every option of a layer pays alike (`problems._sibling_bound_s`)."""
    chunk_s = table.chunk_overhead_s if shape.num_chunks > 1 else 0.0
    total = table.fastest_sum_s - less_s[0] + chunk_s * shape.num_chunks
    slowest_weight, sum_weight = shape.weights
    pp = shape.num_stages
    slowest = total / pp
    if pp > 1:
        count, fastest_s = _longest_run(table)
        fastest_s -= less_s[1]
        v = shape.virtual_stages
        slowest = max(slowest, -(-count // pp) * fastest_s + v * chunk_s)
        if v > 1:
            slowest = max(slowest, v * (-(-count // shape.num_chunks) * fastest_s + chunk_s))
        # the last rank runs at least the layers pinned to the last chunk (the output layer and
        # the multi-token-prediction depths before it) and its chunks' fixed work
        slowest = max(slowest, _last_chunk_s(table) + v * chunk_s)
    return (slowest_weight * slowest + sum_weight * total + shape.transfers_on_path * table.p2p_s
            + average_tail_s(table, pp, grad_sync))


def _last_chunk_s(table) -> float:
    """The fastest time of the layers every assignment puts in the last chunk
    (`CostTable.last_chunk_layers`), kept on the table: every candidate sharing it asks."""
    found = table.__dict__.get("_last_chunk_s")
    if found is None:
        layers = range(table.num_layers - table.last_chunk_layers, table.num_layers)
        found = sum(table.types[table.layer_type[layer]].min_time_s() for layer in layers)
        table.__dict__["_last_chunk_s"] = found
    return found


def _longest_run(table) -> tuple[int, float]:
    """(layers, fastest option's seconds) of the table's longest run of identical layers (0, 0.0
    without one), kept on the table: every candidate sharing it asks."""
    found = table.__dict__.get("_longest_run")
    if found is None:
        structure = bound_structure(table)
        found = (0, 0.0) if structure is None else (structure[1], table.types[structure[2]].min_time_s())
        table.__dict__["_longest_run"] = found
    return found


def _lean_frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(bytes, seconds) per layer: the lower convex hull from the fastest option down to the
    leanest, bytes decreasing and seconds increasing."""
    hull: list[tuple[float, float]] = []
    for point in sorted(set(points)):  # bytes ascending
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (point[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (point[0] - hull[-2][0])) <= 0:
            hull.pop()
        hull.append(point)
    fastest = min(range(len(hull)), key=lambda i: (hull[i][1], hull[i][0]))
    return hull[fastest::-1]  # from the fastest (most bytes) to the leanest


def _segments(frontier: list[tuple[float, float]], budget: float) -> list[tuple[float, float]]:
    """g_r as (length in layers, seconds per layer) pieces of increasing slope, for one rank."""
    if budget < 0:
        return []
    bytes0, time0 = frontier[0]
    if bytes0 <= 0:
        return [(math.inf, time0)]
    out = [(budget / bytes0, time0)]
    for (c_hi, t_hi), (c_lo, t_lo) in zip(frontier, frontier[1:]):
        # between x = B / c_hi and B / c_lo the rank mixes the two options to fill its budget
        slope = t_hi + (t_lo - t_hi) * c_hi / (c_hi - c_lo)
        end = math.inf if c_lo <= 0 else budget / c_lo
        out.append((end - budget / c_hi, slope))
    return out


def _rank_live(shape, rank: int, replay: bool) -> tuple[int, ...]:
    """Live micro-batches per chunk of `rank` at the peak its memory budget is for: the replayed
    order's fullest, or (not replayed, or a schedule with a textbook bubble factor) the peak at its
    first backward, from the order's warm-up rule: 1F1B's and GPipe's one peak exactly (min(m, p - r)
    and m, which a test holds to their replayed orders)."""
    from meshplan.planner.search.ilp.evaluation import live_vectors
    from meshplan.planner.simulation.schedules import warmup_live

    if replay and not schedule_spec(shape.schedule).textbook_factor:
        return max(live_vectors(shape, rank), key=lambda vec: (min(vec), sum(vec)))
    return tuple(warmup_live(shape.schedule, shape.num_stages, shape.num_microbatches, shape.virtual_stages, rank))


def _rank_setup(table, shape, structure, limit_bytes: float, replay: bool = True):
    """Per rank: (fixed seconds k_r, frontier of the run's options, the run's undominated options,
    byte budget B_r, live micro-batches per chunk at the peak the budget is for), options as
    (bytes, seconds) at the rank's least live count; None when a
    rank's pinned layers alone cannot fit. `replay` False: no schedule is replayed for its live
    micro-batches; each rank holds those of its peak at its first backward
    (`simulation.schedules.warmup_live`, a peak the replay also finds, if not always its fullest)."""
    from meshplan.planner.search.ilp.evaluation import chunk_fixed_bytes, chunk_fixed_s, receive_bytes

    first, count, type_index = structure
    num_chunks, pp = shape.num_chunks, shape.num_stages
    chunk_s, boundary = chunk_fixed_s(table, num_chunks), chunk_fixed_bytes(table, shape)
    run = table.types[type_index].options
    # pinned: the first layer to chunk 0, the last (and the MTP depths before it) to the last chunk
    tail = range(max(first + count, table.num_layers - table.last_chunk_layers), table.num_layers)
    edges = ([(0, 0)] if first > 0 else []) + [(layer, num_chunks - 1) for layer in tail]
    # a chunk without an edge layer holds a run layer or another one (`_other_layers`)
    unpinned_buffer = min(o.buffer_bytes for t in {type_index, *(table.layer_type[i] for i in
                                                                 _other_layers(table, structure))}
                          for o in table.types[t].options)
    out, frontiers = [], {}
    # per edge layer: (its chunk, its options, their least time and least transient buffer)
    edge_options = []
    for layer, chunk in edges:
        options = table.types[table.layer_type[layer]].options
        edge_options.append((chunk, options, min(o.time_s for o in options), min(o.buffer_bytes for o in options)))
    edge_chunks = {chunk for _, chunk in edges}
    # receive buffers in transit; a multi-chunk schedule's kept sends only when its order is
    # replayed (leaving them out keeps the bound below the memory)
    received = receive_bytes(table, shape, kept_sends=replay)
    for rank in range(pp):
        chunks = shape.chunks_on(rank)
        live = _rank_live(shape, rank, replay)
        weight = min(live)
        fixed_s = sum(chunk_s[c] for c in chunks)
        fixed_bytes = sum(n * boundary[c] for n, c in zip(live, chunks)) + received[rank]
        # the largest transient buffer is at least that of a layer the rank surely holds: its
        # pinned edge layers, and a run layer if one of its chunks holds no edge layer
        held_buffers = []
        for chunk, options, least_s, least_buffer in edge_options:
            if chunk in chunks:
                held = live[chunks.index(chunk)]
                fixed_s += least_s
                fixed_bytes += min(o.static_bytes + held * o.act_bytes for o in options)
                held_buffers.append(least_buffer)
        if any(c not in edge_chunks for c in chunks):
            held_buffers.append(unpinned_buffer)
        buffer = max(held_buffers, default=0.0)
        budget = limit_bytes * (1 + LIMIT_SLACK) - fixed_bytes - buffer
        if budget < 0:
            return None
        if weight not in frontiers:  # ranks holding as many micro-batches share their frontier
            points = [(o.static_bytes + weight * o.act_bytes, o.time_s) for o in run]
            frontiers[weight] = (_lean_frontier(points), undominated(points))
        out.append((fixed_s, *frontiers[weight], budget, tuple(live)))
    return out


def _piecewise_s(pieces: list[tuple[float, float]], layers: float) -> float:
    """g_r(layers) from its pieces; infinite past the rank's budget."""
    total = 0.0
    for length, slope in pieces:
        take = min(length, layers)
        total += take * slope
        layers -= take
        if layers <= 0:
            return total
    return math.inf


def _least_sum_s(segments: list[list[tuple[float, float]]], count: int) -> float:
    """min sum_r g_r(x_r) over sum_r x_r = count: the cheapest pieces first (g_r convex)."""
    need, total = float(count), 0.0
    for length, slope in sorted((piece for rank in segments for piece in rank), key=lambda p: p[1]):
        take = min(length, need)
        total += take * slope
        need -= take
        if need <= 0:
            return total
    return math.inf


def _least_slowest_s(fixed_s: list[float], segments: list[list[tuple[float, float]]], count: int) -> float:
    """T*: the least T with sum_r g_r^-1(T - k_r) >= count. That sum of layers hosted is
    piecewise linear and increasing in T; find the piece where it reaches `count`."""
    pieces = []  # (T at which a piece starts, seconds per layer, length in layers)
    for k, rank_pieces in zip(fixed_s, segments):
        start_s = k
        for length, slope in rank_pieces:
            pieces.append((start_s, slope, length))
            start_s += length * slope

    def hosted(t: float) -> float:
        total = 0.0
        for start, slope, length in pieces:
            if t >= start:
                total += length if slope <= 0 else min(length, (t - start) / slope)
        return total
    events = sorted({start for start, _, _ in pieces}
                    | {start + length * slope for start, slope, length in pieces if math.isfinite(length)})
    low, high = 0, len(events) - 1
    if hosted(events[high]) < count:  # only pieces of unbounded length grow past the last event
        rate = sum(1.0 / slope for _, slope, length in pieces if math.isinf(length) and slope > 0)
        return events[high] + (count - hosted(events[high])) / rate if rate > 0 else math.inf
    while low < high:  # the first event by which `count` layers are hosted
        mid = (low + high) // 2
        if hosted(events[mid]) >= count:
            high = mid
        else:
            low = mid + 1
    if low == 0:
        return events[0]
    before, after = events[low - 1], events[low]
    have_before, have_after = hosted(before), hosted(after)
    return before + (count - have_before) * (after - before) / (have_after - have_before)


def _hosted_s(pieces: list[tuple[float, float]], time_s: float) -> float:
    """g_r^-1: the most layers (fractional) a rank's pieces fit in `time_s` seconds."""
    hosted = 0.0
    for length, slope in pieces:
        if time_s <= 0:
            break
        take = length if slope <= 0 else min(length, time_s / slope)
        hosted += take
        time_s -= take * slope
    return hosted


def _least_slowest_whole_s(fixed_s: list[float], segments: list[list[tuple[float, float]]], whole_s, count: int,
                           start_s: float) -> float:
    """T* with whole layers: a rank that holds n of the run's layers takes at least
    `whole_s(rank, n)` = k_r + h_r(n) >= k_r + g_r(n), so T_max is at least the count-th smallest
    of those over ranks r and n >= 1 (h_r nondecreasing in n). From `start_s` (the fractional T*,
    no larger), each rank hosts the most whole layers it fits by then (at most
    floor(g_r^-1(start_s - k_r))); then the ranks' next whole layers are taken in order of the time
    they need until `count` are hosted."""
    if not math.isfinite(start_s):
        return start_s
    hosted, upcoming = 0, []
    for rank, (k, pieces) in enumerate(zip(fixed_s, segments)):
        whole = min(count, math.floor(_hosted_s(pieces, start_s - k) + 1e-9)) if start_s > k else 0
        while whole > 0 and whole_s(rank, whole) > start_s * (1 + 1e-12):
            whole -= 1  # whole layers pack worse than the fractional mix
        hosted += whole
        upcoming.append((whole_s(rank, whole + 1), rank, whole + 1))
    heapq.heapify(upcoming)
    slowest_s = start_s
    while hosted < count:
        slowest_s, rank, whole = heapq.heappop(upcoming)
        if math.isinf(slowest_s):
            return math.inf
        hosted += 1
        heapq.heappush(upcoming, (whole_s(rank, whole + 1), rank, whole + 1))
    return max(slowest_s, start_s)


def _memoised_whole(fn):
    """fn(rank, layers) cached for one bound's evaluation."""
    memo: dict = {}

    def whole_s(rank: int, layers: int) -> float:
        key = (rank, layers)
        if key not in memo:
            memo[key] = fn(rank, layers)
        return memo[key]
    return whole_s


def _capped_whole(ranks, run, cap: int, whole_s):
    """k_r + h_r(n) with at most `cap` layers a chunk (`whole_layers.least_chunked_s`) up to
    MAX_CHUNKED_LAYERS layers; above, the larger of that figure at MAX_CHUNKED_LAYERS and the
    uncapped `whole_s` at n: both below any n-layer assignment, and nondecreasing in n, as the
    count-th smallest rule needs."""
    def capped(rank: int, layers: int) -> float:
        fixed_s, _, _, budget, live = ranks[rank]
        if layers <= MAX_CHUNKED_LAYERS:
            return fixed_s + least_chunked_s(run, live, budget, layers, cap)
        return max(memo(rank, MAX_CHUNKED_LAYERS), whole_s(rank, layers))
    memo = _memoised_whole(capped)
    return memo


def _chunk_capped_slowest_s(ranks, segments, run, shape, count: int, start_s: float, slowest_s: float,
                            fastest_s: float, chunk_s: float, whole_s) -> float:
    """T_max with the interleaved rule's cap: at T_max = T a chunk holds at most
    c(T) = floor((T / v - o) / t_fastest) run layers, so T >= T(c(T)), T(c) the whole-layer T*
    with each rank's layers split over its chunks at most c a chunk, each chunk's layers holding
    its own live micro-batches (`whole_layers.least_chunked_s`). T(c) does not grow with c: from
    `slowest_s` up, the least T with T >= T(c(T))."""
    v = shape.virtual_stages
    for _ in range(16):  # each pass raises T to T(c) or to the next cap's step; a few suffice
        if not math.isfinite(slowest_s):
            return slowest_s
        cap = math.floor((slowest_s / v - chunk_s) / fastest_s + 1e-9)
        if cap * v * len(ranks) < count:  # no split fits: the next step up
            slowest_s = v * ((cap + 1) * fastest_s + chunk_s)
            continue
        capped = _least_slowest_whole_s([r[0] for r in ranks], segments, _capped_whole(ranks, run, cap, whole_s),
                                        count, start_s)
        if capped <= slowest_s * (1 + 1e-12):
            return slowest_s
        slowest_s = min(capped, v * ((cap + 1) * fastest_s + chunk_s))
    return slowest_s


def bound_structure(table) -> tuple[int, int, int] | None:
    """(first layer, length, type) of the table's longest run of identical layers (the earliest
    of equal ones), the run `memory_bound_s` bounds; None when no run is longer than one layer."""
    runs = [(count, -first, type_index) for type_index, first, count in table.runs() if count > 1]
    if not runs:
        return None
    count, first, type_index = max(runs)
    return -first, count, type_index


def bound_table(table) -> tuple[object, tuple[int, int, int] | None]:
    """(the table `memory_bound_s` bounds, its run) for a candidate of `table`: the table and
    `bound_structure`'s run; for periodic blocks (`ilp.envelope.periodic_types`: alternating
    kinds, so no run or a short one), their floor (`ilp.envelope.floor_table`: every block at its
    kinds' least costs, one run of them all), whose bound is below every assignment of the real blocks.
    Without it, a periodic model's candidates had the compute bound only, and most of its ILPs
    were solved to find what memory alone rules out. Kept on the table: its candidates share it."""
    found = table.__dict__.get("_bound_table")
    if found is None:
        from meshplan.planner.search.ilp.envelope import floor_table

        floor = floor_table(table)
        found = (table, bound_structure(table)) if floor is None else (floor, bound_structure(floor))
        table.__dict__["_bound_table"] = found
    return found


def _other_layers(table, structure) -> list[int]:
    """Layers neither in the bounded run nor the model's first or last layers (the output layer and
    the MTP depths pinned beside it: a dense-first model's dense blocks): placed freely, so the bound counts their fastest time in the ranks'
    sum and leaves their bytes out (a relaxation: they only add)."""
    first, count, _ = structure
    return [layer for layer in range(1, table.num_layers - table.last_chunk_layers) if not first <= layer < first + count]


def memory_bound_s(table, shape, limit_bytes: float | None, structure, grad_sync: str = "overlap",
                   replay: bool = True) -> float:
    """The memory-aware bound of the module docstring; the compute bound where it does not apply.
    `structure`: the run it bounds (`bound_structure`); layers outside the run other than the
    first and last add their fastest time to sum_r T_r and nothing else (`_other_layers`).
    `replay` False: weaker, replaying no schedule for its live micro-batches (see `_rank_setup`)."""
    base = compute_bound_s(table, shape, grad_sync)
    if limit_bytes is None or structure is None:
        return base
    ranks = _rank_setup(table, shape, structure, limit_bytes, replay)
    if ranks is None:
        return math.inf
    fixed_s = [rank[0] for rank in ranks]
    segments = [_segments(frontier, budget) for _, frontier, _, budget, _ in ranks]
    if replay:  # whole mixes per rank: worth their search where the bound decides an ILP
        whole_s = _memoised_whole(lambda rank, layers: fixed_s[rank] + least_whole_s(ranks[rank][2], ranks[rank][3],
                                                                                     layers))
    else:  # the first refinement: the fractional mix of n layers, g_r(n)
        whole_s = _memoised_whole(lambda rank, layers: fixed_s[rank] + _piecewise_s(segments[rank], layers))
    count = structure[1]
    total_s = _least_sum_s(segments, count)
    if not math.isfinite(total_s):
        return math.inf
    others_s = sum(table.types[table.layer_type[layer]].min_time_s() for layer in _other_layers(table, structure))
    pp, sum_s = shape.num_stages, total_s + sum(fixed_s) + others_s
    fractional_s = _least_slowest_s(fixed_s, segments, count)
    slowest_s = max(_least_slowest_whole_s(fixed_s, segments, whole_s, count, fractional_s), sum_s / pp)
    # every rank runs at least its pinned edge layers and its chunks' fixed work, whether or not
    # it holds run layers (the last rank with the head and MTP depths may hold none)
    slowest_s = max(slowest_s, max(fixed_s))
    # Whole layers: some rank holds at least ceil(N / p) of the run, and some chunk ceil(N / C),
    # which the interleaved rule T_max >= v t_c (edge layers aside) charges v times.
    most_on_rank, most_in_chunk = -(-count // pp), -(-count // shape.num_chunks)
    slowest_s = max(slowest_s, min(whole_s(rank, most_on_rank) for rank in range(pp)))
    fastest_s = min(o.time_s for o in table.types[structure[2]].options)
    chunk_s = table.chunk_overhead_s if shape.num_chunks > 1 else 0.0
    slowest_s = max(slowest_s, shape.virtual_stages * (most_in_chunk * fastest_s + chunk_s))
    if replay and shape.virtual_stages > 1 and fastest_s > 0 and -(-count // pp) <= MAX_CHUNKED_LAYERS:
        run = [(o.static_bytes, o.act_bytes, o.time_s) for o in table.types[structure[2]].options]
        slowest_s = _chunk_capped_slowest_s(ranks, segments, run, shape, count, fractional_s, slowest_s, fastest_s,
                                            chunk_s, whole_s)
    if shape.transfer_cycle and table.p2p_s > 0:
        # 1F1B's cycle: T_max >= T_r + 2P on every rank but the slowest, so
        # T_max >= (sum_r T_r - T_max) / (p - 1) + 2P
        slowest_s = max(slowest_s, (sum_s + 2 * table.p2p_s * (pp - 1)) / pp)
    slowest_weight, sum_weight = shape.weights
    bound = (slowest_weight * slowest_s + sum_weight * sum_s + shape.transfers_on_path * table.p2p_s
             + average_tail_s(table, pp, grad_sync))
    return max(base, bound)
