"""The reduction bound on a candidate's ILP objective: compute plus the data-parallel reduction a
rank cannot hide, per layer at once (the maths is `search.bounds`' module docstring, whose
`memory_bound_s` and `compute_bound_s` it stands beside; the search takes the largest)."""
from __future__ import annotations

import math


def reduction_bound_s(table, shape, grad_sync: str = "overlap", replay: bool = False) -> float:
    """Compute and the reduction it cannot hide, per layer at once (the module docstring's
    `reduction_bound_s`); -inf where an exposed gather would count against it. `replay`: with the
    windows of pipelined ZeRO-2/3's every-micro-batch reductions (`_exposure_terms`)."""
    if replay and grad_sync == "overlap_every_microbatch" and shape.num_stages > 1:
        return max(_reduction_bound_s(table, shape, grad_sync, _exposure_terms(shape, grad_sync, False)),
                   _reduction_bound_s(table, shape, grad_sync, _exposure_terms(shape, grad_sync, True)))
    return _reduction_bound_s(table, shape, grad_sync, _exposure_terms(shape, grad_sync, False))


def _reduction_bound_s(table, shape, grad_sync: str, terms) -> float:
    pp = shape.num_stages
    slowest_weight, sum_weight = shape.weights
    weight = slowest_weight / pp + sum_weight  # of sum_r T_r, with T_max >= sum_r T_r / p
    fwd_weight = weight - max(i for _, i, _ in terms) / pp
    bwd_weight = weight - max(b + i + drain for b, i, drain in terms) / pp
    if fwd_weight < 0 or bwd_weight < 0:
        return -math.inf
    per_layer = sum(n * min(weight * o.time_s + (b * o.dp_comm_s - (b + i + drain) * o.bwd_s - i * o.fwd_s
                                                 + o.param_gather_s + o.optimizer_s) / pp
                            for o in table.types[t].options for b, i, drain in terms)
                    for t, n in table.type_counts)
    fwd_heads, bwd_heads = least_heads_s(table, shape.num_chunks)
    pipelined = grad_sync == "overlap_every_microbatch" and pp > 1
    drain_p2p = (pp - 1) / 2 * table.p2p_s if pipelined else 0.0
    return (per_layer + weight * table.chunk_overhead_s * shape.num_chunks + fwd_weight * fwd_heads
            + bwd_weight * bwd_heads + shape.transfers_on_path * table.p2p_s - drain_p2p + table.rank_fixed_s)


def _exposure_terms(shape, grad_sync: str, replay: bool) -> set[tuple[float, float, float]]:
    """(b, i, l) per rank: E_r - L_r >= b (D_r - B_r) - i (F_r + B_r) - l B_r - r P, from a window
    of `evaluation.exposed_dp_s` without forwards (the others wait on the slowest rank) or the
    whole-step one (b 1, i 0), and pipelined ZeRO-2/3's drain L_r (l = r / v, `drain_rank_s`)."""
    pp, v = shape.num_stages, shape.virtual_stages
    if not (grad_sync == "overlap_every_microbatch" and pp > 1):
        return {(1.0, 0.0, 0.0)}
    if not replay:
        return {(1.0, 0.0, r / v) for r in range(pp)}
    from meshplan.planner.search.ilp.evaluation import reduction_windows

    out = set()
    for rank in range(pp):
        windows = [(1.0, 0.0)] + [(b, i) for b, f, i in reduction_windows(shape, rank) if f == 0]
        b, i = max(windows, key=lambda window: window[0] - window[1])
        out.add((b, i, rank / v))
    return out


def least_heads_s(table, num_chunks: int) -> tuple[float, float]:
    """The least exposed gathers of a step's chunk passes, (forward, backward) per micro-batch: the
    first layer opens chunk 0's forward and the last closes the last chunk's backward; every other
    chunk opens and closes with some layer (`evaluation.pass_gather_s`)."""
    def least(layers, attr):
        return min(getattr(o, attr) for t in {table.layer_type[i] for i in layers} for o in table.types[t].options)
    last = table.num_layers - 1
    rest = num_chunks - 1
    fwd = least((0,), "fwd_head_s") + (rest * least(range(1, last + 1), "fwd_head_s") if rest else 0.0)
    bwd = least((last,), "bwd_head_s") + (rest * least(range(last), "bwd_head_s") if rest else 0.0)
    return fwd, bwd
