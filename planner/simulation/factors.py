"""How a pipeline schedule scales per-micro-batch work into step time, as the simulator plays it.

The stage-assignment ILP is linear: it cannot replay a schedule. Two numbers describe how the
event engine plays (schedule, p, m, v) with balanced unit chunks:

- the step factor F: step time over one rank's per-micro-batch time T (F = m + p - 1 for GPipe
  and 1F1B; torch's interleaved 1F1B idles more than Megatron-LM's (p - 1) / v when m is close
  to p; the zero-bubble schedules fill with W, which depends on the backward's W share);
- the transfer factor G: d step / d P for a boundary transfer time P. GPipe and interleaved 1F1B
  wait for each boundary once each way in fill and drain, G = 2 (C - 1). 1F1B with balanced
  stages also waits about 2 P every micro-batch: a rank's backward needs the gradient its
  successor produced one transfer earlier. A rank slower than the others by more than 2 P
  absorbs that wait, so the ILP models 1F1B's steady state as a cycle
  max(T_max, T_r + 2 P for every rank but the slowest) instead (see `ilp.formulation`).
"""
from __future__ import annotations

import bisect
from functools import lru_cache

from meshplan.planner.simulation.replay_memo import memoised


def _unit_play(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int,
               bwd_over_fwd: float, weight_share: float, record: bool):
    """The engine's play of balanced unit chunks (forward 1, backward `bwd_over_fwd`)."""
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.costing.layer_cost import LayerCost
    from meshplan.planner.simulation.event_engine import _play
    from meshplan.planner.simulation.step_costs import StepCosts, build_chunks
    from meshplan.planner.simulation.split_backward import with_weight_grad

    config = ParallelConfig(gpus=num_stages, global_batch=num_microbatches, pp=num_stages, schedule=schedule,
                            virtual_stages=virtual_stages)
    unit = LayerCost(fwd_compute_s=1.0, bwd_compute_s=bwd_over_fwd, recompute_s=0.0, tp_fwd_comm_s=0.0,
                     tp_bwd_comm_s=0.0, fwd_gather_s=0.0, bwd_gather_s=0.0, dp_grad_comm_s=0.0,
                     dp_param_gather_s=0.0, optimizer_step_s=0.0, param_bytes=0.0, grad_bytes=0.0,
                     optimizer_bytes=0.0, activation_bytes=0.0, buffer_bytes=0.0, output_bytes=0.0)
    num_chunks = num_stages * virtual_stages
    costs = StepCosts(config=config, layer_costs=(unit,) * num_chunks, chunk_of_layer=tuple(range(num_chunks)),
                      weight_grad_share=(weight_share,) * num_chunks)
    return _play(costs, with_weight_grad(costs, build_chunks(costs)), record=record)


def _shared_play(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int, bwd_over_fwd: float,
                 weight_share: float):
    """The recorded unit play that `step_factor` and `reduction_windows` read alike: a schedule
    without a split backward plays the same at every W share, so both read one play."""
    from meshplan.planner.contracts.schedule import schedule_spec

    if not schedule_spec(schedule).split_backward:
        weight_share = REDUCTION_WEIGHT_SHARE
    return _recorded_play(schedule, num_stages, num_microbatches, virtual_stages, bwd_over_fwd, weight_share)


# The W share the reduction windows are played at (their split-backward schedules' W runs late).
REDUCTION_WEIGHT_SHARE = 0.5


@lru_cache(maxsize=8)  # a candidate asks for its step factor and then its windows: one play for both
def _recorded_play(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int, bwd_over_fwd: float,
                   weight_share: float):
    return _unit_play(schedule, num_stages, num_microbatches, virtual_stages, bwd_over_fwd, weight_share, True)


@memoised
def reduction_windows(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                      bwd_over_fwd: float = 2.0) -> tuple[tuple[tuple[float, float, float], ...], ...]:
    """Per rank, (b, f, i) from its backwards to its compute end: the backwards and forwards it
    runs there and the time it idles, in whole-rank micro-batch units (chunk actions / v; idle
    over one micro-batch's forward + backward), as the engine plays balanced unit chunks. A
    reduction released by those backwards has that window to hide in (`ilp.evaluation`).

    Only the windows that can bind are kept: one with no more backwards, and no fewer forwards
    or less idle, than another never binds while D >= B (the last backward's stays for D < B),
    and one on the segment between its neighbours never beats both (steady-state windows differ
    by equal steps): 2-7 a rank."""
    if num_stages == 1:  # F B F B ...: the executor's accumulation, no idle
        every = [tuple((float(k), float(k - 1), 0.0) for k in range(1, num_microbatches + 1))]
    else:
        played = _shared_play(schedule, num_stages, num_microbatches, virtual_stages, bwd_over_fwd,
                              REDUCTION_WEIGHT_SHARE)
        every = [_windows_of(runs, virtual_stages, virtual_stages * (1.0 + bwd_over_fwd)) for runs in played.runs]
    return tuple(_binding(windows) for windows in every)


def _windows_of(runs, virtual_stages: int, unit_s: float) -> tuple[tuple[float, float, float], ...]:
    end_s, busy_s, backwards, forwards, windows = runs[-1].end_s, 0.0, 0, 0, []
    for run in reversed(runs):
        busy_s += run.end_s - run.start_s
        if run.action.kind == "F":
            forwards += 1
            continue
        backwards += 1
        windows.append((backwards / virtual_stages, forwards / virtual_stages,
                        max(0.0, end_s - run.start_s - busy_s) / unit_s))
    return tuple(windows)


def _binding(windows) -> tuple[tuple[float, float, float], ...]:
    first = min(windows)  # the last backward's (fewest backwards): the largest row when D < B
    kept = [first]
    # Windows come by backwards descending, so every one kept before has at least as many: a
    # window is dominated when a kept one has no more forwards and no more idle, which the
    # staircase of kept (forwards ascending, idle strictly descending) answers by bisection.
    forwards: list[float] = []
    idles: list[float] = []
    for window in sorted(windows, key=lambda w: (-w[0], w[1], w[2])):
        b, f, i = window
        if first[0] >= b and first[1] <= f and first[2] <= i:
            continue
        at = bisect.bisect_right(forwards, f)
        if at and idles[at - 1] <= i:
            continue
        kept.append(window)
        end = at
        while end < len(forwards) and idles[end] >= i:  # the points the new one dominates
            end += 1
        forwards[at:end], idles[at:end] = [f], [i]
    out: list[tuple[float, float, float]] = []
    for point in sorted(set(kept)):
        while len(out) >= 2 and _between(out[-2], out[-1], point):
            out.pop()
        out.append(point)
    return tuple(out)


def _between(a, b, c, tol: float = 1e-9) -> bool:
    """b lies on the segment from a to c."""
    ab0, ab1, ab2 = b[0] - a[0], b[1] - a[1], b[2] - a[2]  # unrolled: called ~1e5 times a search
    ac0, ac1, ac2 = c[0] - a[0], c[1] - a[1], c[2] - a[2]
    dot, length = ab0 * ac0 + ab1 * ac1 + ab2 * ac2, ac0 * ac0 + ac1 * ac1 + ac2 * ac2
    limit = tol * max(1.0, length)
    return (abs(ab1 * ac2 - ab2 * ac1) <= limit and abs(ab2 * ac0 - ab0 * ac2) <= limit
            and abs(ab0 * ac1 - ab1 * ac0) <= limit and 0 <= dot <= length)


@memoised
def step_factor(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                bwd_over_fwd: float = 2.0, weight_share: float = 0.5) -> float:
    """F of the schedule with chunks of forward 1 and backward `bwd_over_fwd`, of which the
    zero-bubble schedules run `weight_share` as W (see above)."""
    if bwd_over_fwd <= 0:
        raise ValueError(f"bwd_over_fwd must be positive, got {bwd_over_fwd}")
    if num_stages == 1:
        return float(num_microbatches)
    # Unit chunks have no reduction, optimizer or memory: the step ends with the last action
    # (what `simulate_step` reports for them, without its tails, memory and breakdown).
    played = _shared_play(schedule, num_stages, num_microbatches, virtual_stages, bwd_over_fwd, weight_share)
    step_s = max(runs[-1].end_s for runs in played.runs)
    return step_s / (virtual_stages * (1.0 + bwd_over_fwd))
