"""The constraint families of the stage-assignment ILP written out in `planner.search.ilp.formulation`'s
docstring, one function per family, every row named after the family (assign_l, contig_l,
run_total, nonempty_c, tmax_r, tmax_chunk_c, cycle_r, tail_r, exposed_dp_every_r_k, mem_r_k, buf_*) so
that an infeasible request can say which family binds; the gather heads' families are in
`gather_heads`. `build_model` assembles them for one candidate.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan.planner.search.ilp.evaluation import (chunk_fixed_bytes, chunk_fixed_s, drain_rank_s, leading_chunks,
                                                   live_vectors, pipelined_every_microbatch, receive_bytes,
                                                   reduction_contention_s, reduction_windows, trailing_min_s)
from meshplan.planner.search.ilp.gather_heads import add_layer_head_terms, add_run_head_terms

if TYPE_CHECKING:  # annotations only: planner.search.ilp.formulation imports this module
    from meshplan.planner.search.ilp.formulation import StageProblem


GIB = float(2 ** 30)  # memory rows in GiB keep the ILP's coefficients within a few orders


class _Model:
    """The pulp problem of one candidate plus the expressions its constraint families share."""

    def __init__(self, problem: StageProblem):
        from meshplan.planner.search.ilp.backend import import_pulp

        pulp = import_pulp()
        self.pulp = pulp
        self.problem = problem
        self.lp = pulp.LpProblem("meshplan_stages", pulp.LpMinimize)
        shape = problem.shape
        self.num_chunks, self.pp = shape.num_chunks, shape.num_stages
        zero = pulp.LpAffineExpression
        self.chunk_time = [zero() for _ in range(self.num_chunks)]
        self.chunk_act = [zero() for _ in range(self.num_chunks)]
        # Time of the model's first and last layer (the embedding and the head), which the
        # interleaved even-chunk rule leaves out of the first and last chunks.
        self.edge_time = [zero() for _ in range(self.num_chunks)]
        self.rank_static, self.rank_grad_comm, self.rank_fwd, self.rank_bwd, self.rank_tail = (
            [zero() for _ in range(self.pp)] for _ in range(5))
        self.rank_buffer: list[list[tuple[float, object]]] = [[] for _ in range(self.pp)]
        # Lower bounds on each rank's exposed gradient reduction, one row per group of
        # (seconds, indicator expression) terms.
        self.rank_first_dp: list[list[list[tuple[float, object]]]] = [[] for _ in range(self.pp)]
        self.decoders: list = []  # callables filling (chunks, options) from the solved values
        self.pinned: dict[int, list[tuple[object, object]]] = {}  # pinned layer -> [(option, pick)]
        # Integrality cuts: (K, t, c) with K >= layers of a run in a chunk (v = 1) or on a rank
        # (times 1/v), so T_max >= v (K t + c).
        self.count_cuts: list[tuple[object, float, float]] = []
        # Tail cuts: (R, s, slack) with R >= run layers on any rank, so Tail >= R s + slack.
        self.tail_cuts: list[tuple[object, float, float]] = []

    def add_edge_terms(self, layer: int, chunk: int, option, amount) -> None:
        """Mark the first or last layer's time in the first or last chunk (see `edge_time`)."""
        last_layer = self.problem.table.num_layers - 1
        if (layer == 0 and chunk == 0) or (layer == last_layer and chunk == self.num_chunks - 1):
            self.edge_time[chunk] += option.time_s * amount

    def add_option_terms(self, chunk: int, option, amount) -> None:
        """Account `amount` (a variable, expression or number) layers of `option` in `chunk`."""
        rank = self.problem.shape.rank_of(chunk)
        terms = ((self.chunk_time[chunk], option.time_s), (self.chunk_act[chunk], option.act_bytes / GIB),
                 (self.rank_static[rank], option.static_bytes / GIB), (self.rank_grad_comm[rank], option.dp_comm_s),
                 (self.rank_fwd[rank], option.fwd_s), (self.rank_bwd[rank], option.bwd_s),
                 (self.rank_tail[rank], option.param_gather_s + option.optimizer_s))
        if isinstance(amount, self.pulp.LpVariable):
            # what `expression += coefficient * variable` adds, without the temporary expressions
            for expression, coefficient in terms:
                if coefficient != 0:
                    expression.addterm(amount, coefficient)
            return
        for expression, coefficient in terms:
            expression += coefficient * amount

    def add_head(self, chunk: int, side: str, amount) -> None:
        """A gather head (`OptionCost.fwd_head_s`, `bwd_head_s`, times its indicator) on `chunk`'s
        forward or backward: chunk time, and the rank's forward or backward the reduction rows read."""
        rank = self.problem.shape.rank_of(chunk)
        self.chunk_time[chunk] += amount
        (self.rank_fwd if side == "fwd" else self.rank_bwd)[rank] += amount

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
    model.pinned[layer] = list(zip(options, pick))
    for option, var in zip(options, pick):
        model.add_option_terms(chunk, option, var)
        model.add_edge_terms(layer, chunk, option, var)
        if option.buffer_bytes:
            model.rank_buffer[model.problem.shape.rank_of(chunk)].append((option.buffer_bytes / GIB, var))
    if layer == 0:  # the first layer of chunk 0
        model.rank_first_dp[0].append([(min(o.dp_comm_s for o in options), 1)])

    def decode(chunks, chosen):
        chunks[layer] = chunk
        chosen[layer] = next(o for o, var in enumerate(pick) if _value(var))
    model.decoders.append(decode)


def _add_run_count_constraints(model: _Model, first: int, count: int, type_index: int) -> list:
    """Compact run: n[c, o] layers of option o in chunk c; totals, non-empty chunks, buffers.
    Returns the counts n[c][o]."""
    table, pulp, num_chunks = model.problem.table, model.pulp, model.num_chunks
    options = table.types[type_index].options
    leading = leading_chunks(first, count, num_chunks)  # the pinned layers before the run
    # the run starts in the chunk of the last layer before it
    counts = [[pulp.LpVariable(f"n_{c}_{o}", lowBound=0, upBound=count if not leading or c >= leading[-1] else 0,
                               cat="Integer")
               for o in range(len(options))] for c in range(num_chunks)]
    model.lp += pulp.lpSum(v for row in counts for v in row) == count, "run_total"
    has_first, has_last = first >= 1, first + count < table.num_layers
    for c in range(num_chunks):
        if not (c in leading or (c == num_chunks - 1 and has_last)):
            model.lp += pulp.lpSum(counts[c]) >= 1, f"nonempty_{c}"
        for o, option in enumerate(options):
            model.add_option_terms(c, option, counts[c][o])
            if option.buffer_bytes:
                used = pulp.LpVariable(f"y_{c}_{o}", cat="Binary")
                model.lp += counts[c][o] <= count * used, f"buf_use_{c}_{o}"
                model.rank_buffer[model.problem.shape.rank_of(c)].append((option.buffer_bytes / GIB, used))
    # Granularity cut: the fullest chunk holds K >= ceil(N / C) layers, each at least the fastest
    # option's time, so T_max >= v K t_min (tmax_chunk_c). Valid for every integer solution; the LP relaxation
    # alone would spread fractional layers evenly, and branching on one K closes that gap.
    chunk_const = _chunk_constants(model, leading, trailing_min_s(table, first, count))
    fastest_s = min(o.time_s for o in options)
    # T_max >= v t_c holds for every chunk, less the pinned first and last layers' own time.
    interleaved = model.problem.shape.virtual_stages > 1
    bounded = list(range(num_chunks))
    fullest = pulp.LpVariable("run_max_per_chunk", lowBound=0, upBound=count, cat="Integer")
    for c in bounded:
        model.lp += pulp.lpSum(counts[c]) <= fullest, f"run_fullest_{c}"
    if bounded:
        pinned_s = [0.0] * num_chunks  # the pinned layers' least time, which tmax_chunk leaves out
        if has_first:
            pinned_s[0] = table.types[table.layer_type[0]].min_time_s()
        pinned_s[-1] += trailing_min_s(table, first, count)
        model.count_cuts.append((fullest, fastest_s, min(chunk_const[c] - pinned_s[c] for c in bounded)))
    if not interleaved:
        model.count_cuts.append((1, 0.0, _fullest_chunk_bound(count, fastest_s, chunk_const)))
    _add_run_rank_count_cuts(model, counts, options, (first, count), chunk_const)
    _add_run_reshard_terms(model, counts, options, count)
    _add_run_first_layer_terms(model, counts, options, count, leading, has_last)
    _add_run_symmetry_constraints(model, set(leading), has_last)

    def decode(chunks, chosen):
        layer = first
        for c in range(num_chunks):  # options grouped, in option order, inside each chunk
            for o in range(len(options)):
                for _ in range(_value(counts[c][o])):
                    chunks[layer], chosen[layer] = c, o
                    layer += 1
        assert layer == first + count, f"decoded {layer - first} of {count} run layers"
    model.decoders.append(decode)
    return counts


def _fullest_chunk_bound(count: int, fastest_s: float, chunk_const: list[float]) -> float:
    """A constant no chunk maximum can beat: with K0 = ceil(N / C), either some chunk holds
    K0 + 1 run layers, or at least N - C (K0 - 1) chunks hold K0, the costliest of which has at
    least the (N - C (K0 - 1))-th smallest fixed time."""
    num_chunks = len(chunk_const)
    base = -(-count // num_chunks)
    at_base = count - num_chunks * (base - 1)
    ordered = sorted(chunk_const)
    return min(base * fastest_s + ordered[at_base - 1], (base + 1) * fastest_s + ordered[0])


def _chunk_constants(model: _Model, leading: tuple[int, ...], trailing_s: float) -> list[float]:
    """Least time of each chunk besides its run layers: fixed pipelining work and the pinned
    layers (`leading`: the chunk of each layer before the run; `trailing_s`: the least time of
    those after it, all in the last chunk)."""
    table, num_chunks = model.problem.table, model.num_chunks
    out = chunk_fixed_s(table, num_chunks)
    for layer, chunk in enumerate(leading):
        out[chunk] += table.types[table.layer_type[layer]].min_time_s()
    out[-1] += trailing_s
    return out


def _add_run_rank_count_cuts(model: _Model, counts, options, run: tuple[int, int], chunk_const: list[float]) -> None:
    """The busiest rank holds R >= ceil(N / p) run layers: T_max >= R t_min, and its per-step
    tail is at least R times a run layer's least exposed reduction plus optimizer work.
    `run`: (its first layer, N)."""
    pulp, table = model.pulp, model.problem.table
    first, count = run
    busiest = pulp.LpVariable("run_max_per_rank", lowBound=0, upBound=count, cat="Integer")
    for r in range(model.pp):
        model.lp += pulp.lpSum(v for c in model.problem.shape.chunks_on(r) for v in counts[c]) <= busiest, \
            f"run_busiest_{r}"
    v = model.problem.shape.virtual_stages
    rank_const = min(sum(chunk_const[c] for c in model.problem.shape.chunks_on(r)) for r in range(model.pp))
    model.count_cuts.append((busiest, min(o.time_s for o in options) / v, rank_const / v))
    overlap = model.problem.grad_sync != "after_chunk"
    # pipelined ZeRO-2/3 count a rank's exposed reduction from its own end: only its optimizer
    # and gathers are sure to reach the tail
    reduction = 0.0 if pipelined_every_microbatch(model.problem) else 1.0
    per_layer = min(reduction * (o.dp_comm_s - (o.bwd_s if overlap else 0.0)) + o.param_gather_s + o.optimizer_s
                    for o in options)
    pinned = [table.types[t] for i, t in enumerate(table.layer_type) if not first <= i < first + count]
    # Pinned layers may lower the busiest rank's sum (their reduction may be shorter than their
    # backward); subtract the most they can.
    slack = sum(min(0.0, min(reduction * (o.dp_comm_s - (o.bwd_s if overlap else 0.0)) for o in lt.options))
                for lt in pinned)
    if overlap:  # the rank's backward also holds a gather head per chunk (`add_head`), each <= one gather
        slack -= reduction * v * max(o.bwd_gather_s for t in table.types for o in t.options)
    model.tail_cuts.append((busiest, per_layer, slack))


def _add_run_symmetry_constraints(model: _Model, leading: set[int], has_last: bool) -> None:
    """Interleaved: order the activations of a rank's chunks against their live micro-batches.

    The contents of two chunks of one rank (neither holding a pinned layer: `leading`, the chunks
    of the layers before the run, and the last chunk with `has_last`) can be swapped
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
                if shape.chunks_on(r)[j] not in leading
                and not (shape.chunks_on(r)[j] == model.num_chunks - 1 and has_last)]
        free.sort(key=lambda j: tuple(-live[j] for live in peaks))
        for a, b in zip(free, free[1:]):
            if all(live[a] >= live[b] for live in peaks):
                model.lp += model.chunk_act[shape.chunks_on(r)[a]] <= model.chunk_act[shape.chunks_on(r)[b]], \
                    f"symmetry_{r}_{a}_{b}"


def _add_run_first_layer_terms(model: _Model, counts, options, count: int, leading: tuple[int, ...],
                               has_last: bool):
    """The first layer of each rank's first chunk is a run layer, except in a chunk of the
    pinned layers before the run (`leading`: its first pinned layer; chunk 0's, the model's
    first layer, is `_add_pinned_layer`'s), and in a last chunk holding only the pinned layers after the run."""
    pulp, table = model.pulp, model.problem.table
    run_dp = min(o.dp_comm_s for o in options)
    for r in range(model.pp):
        opening = model.problem.shape.chunks_on(r)[0]
        if opening in leading:
            layer = leading.index(opening)
            if layer > 0:
                layer_options = table.types[table.layer_type[layer]].options
                model.rank_first_dp[r].append([(min(o.dp_comm_s for o in layer_options), 1)])
            continue
        if r == model.num_chunks - 1 and has_last:  # opened by a run layer, or else the first layer after the run
            last_options = table.types[table.layer_type[len(leading) + count]].options
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
    num_layers, tail = table.num_layers, table.last_chunk_layers
    x: dict[tuple[int, int, int], object] = {}
    chunk_index = []
    for layer in range(num_layers):
        options = table.types[table.layer_type[layer]].options
        # Chunk c needs c layers before it and C-1-c after it; the last `tail` layers (the head and
        # the MTP depths before it) fill only the last chunk between them.
        if layer >= num_layers - tail:
            reachable = range(num_chunks - 1, num_chunks)
        else:
            reachable = range(max(0, num_chunks - num_layers + tail - 1 + layer), min(layer, num_chunks - 1) + 1)
        for c in reachable:
            for o, option in enumerate(options):
                var = x[layer, c, o] = pulp.LpVariable(f"x_{layer}_{c}_{o}", cat="Binary")
                model.add_option_terms(c, option, var)
                model.add_edge_terms(layer, c, option, var)
        model.lp += pulp.lpSum(x[layer, c, o] for c in reachable for o in range(len(options))) == 1, \
            f"assign_{layer}"
        chunk_index.append(pulp.lpSum(c * x[layer, c, o] for c in reachable for o in range(len(options))))
        for r in range(model.pp):
            for o, option in enumerate(options):
                on_rank = [x[layer, c, o] for c in reachable if model.problem.shape.rank_of(c) == r]
                if option.buffer_bytes and on_rank:
                    model.rank_buffer[r].append((option.buffer_bytes / GIB, pulp.lpSum(on_rank)))
    model.lp += chunk_index[0] == 0, "first_layer_chunk"
    model.lp += chunk_index[-1] == num_chunks - 1, "last_layer_chunk"
    for layer in range(num_layers - table.last_chunk_layers, num_layers - 1):  # MTP depths: with the head
        model.lp += chunk_index[layer] == num_chunks - 1, f"last_chunk_{layer}"
    for layer in range(num_layers - 1):
        step = chunk_index[layer + 1] - chunk_index[layer]
        model.lp += step >= 0, f"contig_order_{layer}"
        model.lp += step <= 1, f"contig_step_{layer}"
    _add_layer_reshard_terms(model, x)
    add_layer_head_terms(model, x)
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
    shape, table = problem.shape, problem.table
    for c, fixed_s in enumerate(chunk_fixed_s(table, model.num_chunks)):
        model.chunk_time[c] += fixed_s
    rank_time = [pulp.lpSum(model.chunk_time[c] for c in model.problem.shape.chunks_on(r))
                 for r in range(model.pp)]
    slowest = pulp.LpVariable("t_max", lowBound=0)
    tail = pulp.LpVariable("tail", lowBound=0)
    for r in range(model.pp):
        model.lp += slowest >= rank_time[r], f"tmax_{r}"
    if shape.virtual_stages > 1:  # the interleaved steady state needs equal chunks (see the maths)
        for c in range(model.num_chunks):  # less the embedding's and the head's own time
            model.lp += slowest >= shape.virtual_stages * (model.chunk_time[c] - model.edge_time[c]), \
                f"tmax_chunk_{c}"
    if shape.transfer_cycle and table.p2p_s > 0:  # 1F1B waits 2P per micro-batch but on the bottleneck
        excused = [pulp.LpVariable(f"bottleneck_{r}", cat="Binary") for r in range(model.pp)]
        model.lp += pulp.lpSum(excused) == 1, "bottleneck_one"
        for r in range(model.pp):
            model.lp += slowest >= rank_time[r] + 2 * table.p2p_s * (1 - excused[r]), f"cycle_{r}"
    for k, (fullest, time_s, const_s) in enumerate(model.count_cuts):
        model.lp += slowest >= shape.virtual_stages * (time_s * fullest + const_s), f"granularity_{k}"
    for k, (busiest, per_layer_s, slack_s) in enumerate(model.tail_cuts):
        if per_layer_s > 0:
            model.lp += tail >= per_layer_s * busiest + slack_s, f"tail_granularity_{k}"
    blocking = problem.grad_sync == "after_chunk"
    for r in range(model.pp):
        exposed = pulp.LpVariable(f"exposed_dp_{r}", lowBound=0)
        model.lp += exposed >= model.rank_grad_comm[r] - (0 if blocking else model.rank_bwd[r]), f"exposed_dp_{r}"
        if problem.grad_sync == "overlap_every_microbatch":  # every micro-batch reduces all gradients
            contention_s = reduction_contention_s(problem, r)
            for k, (b, f, i) in enumerate(reduction_windows(problem.shape, r)):
                model.lp += exposed >= b * (model.rank_grad_comm[r] - model.rank_bwd[r]) \
                    - f * (model.rank_fwd[r] + slowest - rank_time[r]) - i * (model.rank_fwd[r] + model.rank_bwd[r]) \
                    + contention_s * (b + f), f"exposed_dp_every_{r}_{k}"
        for k, group in enumerate(model.rank_first_dp[r]):
            model.lp += exposed >= pulp.lpSum(dp_s * indicator for dp_s, indicator in group), f"exposed_first_{r}_{k}"
        if pipelined_every_microbatch(problem) and r > 0:  # counted from the rank's own compute end
            late = pulp.LpVariable(f"late_dp_{r}", lowBound=0)
            model.lp += late >= exposed - drain_rank_s(r, model.rank_bwd[r], shape.virtual_stages, table.p2p_s), \
                f"late_dp_{r}"
            exposed = late
        model.lp += tail >= exposed + model.rank_tail[r] + table.rank_fixed_s, f"tail_{r}"
    slowest_weight, sum_weight = shape.weights
    return (slowest_weight * slowest + sum_weight * pulp.lpSum(rank_time) + shape.transfers_on_path * table.p2p_s
            + tail)


def _add_memory_constraints(model: _Model):
    """Per rank and per memory peak of the schedule: resident + live activations + buffer."""
    problem, pulp = model.problem, model.pulp
    peak = pulp.LpVariable("mem_peak", lowBound=0) if problem.objective == "memory" else None
    if peak is None and problem.mem_limit_bytes is None:
        return None
    received = receive_bytes(problem.table, problem.shape)  # torch pipelining's kept buffers
    for r in range(model.pp):
        buffer = pulp.LpVariable(f"buffer_{r}", lowBound=0)
        for i, (size, used) in enumerate(model.rank_buffer[r]):
            model.lp += buffer >= size * used, f"buf_{r}_{i}"
        fixed_bytes = chunk_fixed_bytes(problem.table, problem.shape)
        for k, live in enumerate(live_vectors(problem.shape, r)):
            chunks = problem.shape.chunks_on(r)
            total = _resident_plus_live(model.rank_static[r], buffer, [(live[j], model.chunk_act[c])
                                                                       for j, c in enumerate(chunks)]) \
                + (sum(live[j] * fixed_bytes[c] for j, c in enumerate(chunks)) + received[r]) / GIB
            if peak is not None:
                model.lp += peak >= total, f"mem_peak_{r}_{k}"
            else:
                model.lp += total <= problem.mem_limit_bytes / GIB, f"mem_{r}_{k}"
    return peak


def _resident_plus_live(static, buffer, scaled):
    """`static + buffer + lpSum(n * act for n, act in scaled)`, term for term and in the same
    order and arithmetic, without pulp's temporary copy of every scaled expression (a rank of a
    deep interleaved pipeline has a row per memory peak, each summing all its chunks)."""
    total = static.copy()
    total.addterm(buffer, 1)
    summed: dict = {}
    constant = 0
    for n, act in scaled:
        if n == 0:  # pulp's n * act is then empty
            continue
        constant += act.constant * n
        for var, coefficient in act.items():
            value = n * coefficient
            if var in summed:
                summed[var] += value
            else:
                summed[var] = value
    total.constant += constant
    for var, coefficient in summed.items():
        total.addterm(var, coefficient)
    return total


def build_model(problem: StageProblem, structure: tuple[int, int, int] | None) -> _Model:
    """The pulp problem of one candidate: the per-layer or (with `structure`) the compact
    formulation, the pipeline-time and memory families, and the objective."""
    model = _Model(problem)
    table = problem.table
    if structure is None:
        _add_layer_assignment_constraints(model)
    else:
        first, count, type_index = structure
        # the first layer, and a few leading ones spread over the first chunks (`formulation.pinned_structure`)
        for layer, chunk in enumerate(leading_chunks(first, count, model.num_chunks)):
            _add_pinned_layer(model, layer, chunk)
        counts = _add_run_count_constraints(model, first, count, type_index)
        for layer in range(first + count, table.num_layers):  # the head, and MTP depths before it
            _add_pinned_layer(model, layer, model.num_chunks - 1)
        add_run_head_terms(model, counts, table.types[type_index].options, count, first)
    time_objective = _add_pipeline_time_constraints(model)
    peak = _add_memory_constraints(model)
    model.lp += (peak if peak is not None else time_objective), "objective"
    return model
