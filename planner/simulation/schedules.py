"""Pipeline schedules: the ordered compute actions each pipeline rank runs in one training step.

The orders are the ones torch 2.13's `torch.distributed.pipelining` schedules execute (the
executor runs `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`, and the zero-bubble and
V-shaped schedules of `planner.simulation.zero_bubble`); a multi-process test records what those
classes actually call and compares, another compares with their `pipeline_order`. They are generated directly, in
O(pp * microbatches * virtual_stages), without importing torch: building torch's own interleaved
table for large pipelines takes seconds, far too slow for a planner that simulates many plans.

Notation: p = pipeline ranks, m = micro-batches, v = virtual stages (model chunks per rank).
Model chunk c runs on rank `c % p` as its virtual stage `c // p` (Megatron-LM's interleaving),
except under the V-shaped schedules (`contracts.schedule.Schedule.chunk_rank`). Which schedules
exist, and which (p, m, v) each runs, is `contracts.schedule`'s: `rank_actions` checks there and
picks the generator the description's `actions` names (`GENERATORS`).

- GPipe (`ScheduleGPipe._step_microbatches`): all m forwards, then all m backwards, in order.
- 1F1B (`Schedule1F1B._step_microbatches`): rank k runs w = min(m, p - k) warm-up forwards,
  then alternates one backward and one forward until the forwards run out, then drains the
  backwards. At most w micro-batches are in flight on rank k.
- Interleaved 1F1B (`ScheduleInterleaved1F1B._calculate_single_rank_operations`, Narayanan et
  al. 2021): micro-batches go round in groups of `r = m // max(1, m // p)` (a plan's
  `microbatch_group_size` instead: Megatron-Core's `microbatch_group_size_per_vp_stage`, whose
  warm-up `get_pp_rank_microbatches` counts the same way; a smaller r holds fewer); rank k runs
  w = min((v - 1) * r + 2 * (p - 1 - k), m * v) warm-up forwards (chunk of step s: (s // r) % v),
  then forward/backward pairs (backward chunk of step s: v - 1 - ((s - w) // r) % v, deepest
  chunk first), then the remaining w backwards.
"""
from __future__ import annotations

from functools import lru_cache

from meshplan.planner.contracts.schedule import Schedule, default_microbatch_group, interleaved_warmup, schedule_spec
from meshplan.planner.costing.boundary_buffers import kept_send_bytes, receive_buffer_bytes
from meshplan.planner.simulation import zero_bubble
from meshplan.planner.simulation.actions import Action, new_action
from meshplan.planner.simulation.replay_memo import memoised


def _check(spec: Schedule, num_stages: int, num_microbatches: int, virtual_stages: int, rank: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("virtual_stages", virtual_stages)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if not 0 <= rank < num_stages:
        raise ValueError(f"rank {rank} is outside the pipeline of {num_stages} stages")
    spec.check(num_stages, num_microbatches, virtual_stages)


def rank_actions(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int,
                 rank: int, microbatch_group: int | None = None) -> list[Action]:
    """The compute actions pipeline rank `rank` runs, in execution order; `microbatch_group`
    (interleaved 1F1B only) replaces its default group of micro-batches per round."""
    spec = schedule_spec(schedule)
    _check(spec, num_stages, num_microbatches, virtual_stages, rank)
    if microbatch_group is not None:
        if spec.actions != "interleaved" or num_microbatches % microbatch_group:
            raise ValueError(f"a micro-batch group of {microbatch_group} needs interleaved 1F1B and divides its "
                             f"{num_microbatches} micro-batches; got schedule {schedule}")
        return _interleaved(num_stages, num_microbatches, virtual_stages, rank, microbatch_group)
    return GENERATORS[spec.actions](num_stages, num_microbatches, virtual_stages, rank)


def _gpipe(num_stages: int, num_microbatches: int, virtual_stages: int, rank: int) -> list[Action]:
    return ([new_action("F", rank, mb) for mb in range(num_microbatches)]
            + [new_action("B", rank, mb) for mb in range(num_microbatches)])


def _one_f_one_b(num_stages: int, num_microbatches: int, virtual_stages: int, rank: int) -> list[Action]:
    warmup = min(num_microbatches, num_stages - rank)
    actions = [new_action("F", rank, mb) for mb in range(warmup)]
    next_fwd, next_bwd = warmup, 0
    while True:  # steady state: one backward, then one forward
        actions.append(new_action("B", rank, next_bwd))
        next_bwd += 1
        if next_fwd == num_microbatches:
            break
        actions.append(new_action("F", rank, next_fwd))
        next_fwd += 1
    actions.extend(new_action("B", rank, mb) for mb in range(next_bwd, num_microbatches))
    return actions


def _interleaved(num_stages: int, num_microbatches: int, virtual_stages: int, rank: int,
                 per_round: int | None = None) -> list[Action]:
    p, v = num_stages, virtual_stages
    per_round = per_round or default_microbatch_group(num_stages, num_microbatches)
    total = num_microbatches * virtual_stages
    warmup = interleaved_warmup(num_stages, num_microbatches, virtual_stages, rank, per_round)
    next_fwd_mb, next_bwd_mb = [0] * v, [0] * v
    actions: list[Action] = []
    # written flat (no helper per action): the search generates it for every rank of every shape it replays
    for step in range(total + warmup):
        if step < total:  # warm-up, then the steady state: one forward, then one backward
            local = (step // per_round) % v
            actions.append(new_action("F", local * p + rank, next_fwd_mb[local]))
            next_fwd_mb[local] += 1
        if step >= warmup:
            local = v - 1 - ((step - warmup) // per_round) % v
            actions.append(new_action("B", local * p + rank, next_bwd_mb[local]))
            next_bwd_mb[local] += 1
    return actions


# `Schedule.actions` -> generator(num_stages, num_microbatches, virtual_stages, rank).
GENERATORS = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved": _interleaved,
    "zb-interleaved": zero_bubble.zb_interleaved,
    "zbv": zero_bubble.zbv,
    "dualpipev": zero_bubble.dualpipev,
}


def warmup_live(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int,
                rank: int) -> tuple[int, ...]:
    """Per virtual stage, the micro-batches whose forwards rank `rank` runs before its first
    backward (of any kind): one of its peaks of live activations, from each order's warm-up rule,
    without generating the order (the search's cheap memory bound, `search.bounds`; a test checks
    it against the generated orders). Interleaved orders run their warm-up and one more forward
    first, forward s on virtual stage (s // r) % v; the V-shaped ones run 2p - 1 - k forwards of the V's first chunk and k + 1 of its
    second before their first backward (DualPipeV's last rank one more of the first), as many as
    the m micro-batches allow."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    actions = schedule_spec(schedule).actions
    if actions == "gpipe":
        return (m,)
    if actions == "1f1b":
        return (min(m, p - rank),)
    if actions in ("zbv", "dualpipev"):
        # DualPipeV's last rank opens its steady state with one more forward of the V's first chunk
        extra = actions == "dualpipev" and rank == p - 1 and m > p
        return min(m, 2 * p - 1 - rank + extra), min(m, rank + 1)
    per_round = default_microbatch_group(p, m)
    # the warm-up, then the steady state's first forward ahead of its first backward
    forwards = min(m * v, interleaved_warmup(p, m, v, rank, per_round, hops=2 if actions == "interleaved" else 1) + 1)
    cycles, rest = divmod(forwards, per_round * v)
    return tuple(cycles * per_round + min(per_round, max(0, rest - local * per_round)) for local in range(v))


@lru_cache(maxsize=256)
def schedule_actions(schedule: str, num_stages: int, num_microbatches: int,
                     virtual_stages: int = 1, microbatch_group: int | None = None) -> tuple[tuple[Action, ...], ...]:
    """`rank_actions` for every pipeline rank, indexed by rank (cached: the planner replays the
    same few schedules for every candidate it solves)."""
    return tuple(tuple(rank_actions(schedule, num_stages, num_microbatches, virtual_stages, rank, microbatch_group))
                 for rank in range(num_stages))


def max_in_flight(actions: list[Action] | tuple[Action, ...]) -> int:
    """Most micro-batch chunks whose forward ran and whose B or W has not (activations held)."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else (-1 if action.frees_activations else 0)
        peak = max(peak, live)
    return peak


@memoised
def backwards_before_last_forward(schedule: str, num_stages: int, num_microbatches: int,
                                  virtual_stages: int, microbatch_group: int | None = None
                                  ) -> tuple[tuple[int, ...], ...]:
    """Per rank and virtual stage: micro-batches whose activations were freed (B, or W after a
    split backward) before the rank's last forward. Counts only grow, so that moment has the
    most of each at once: a multi-chunk schedule's sends kept until the step ends
    (`costing.boundary_buffers.kept_send_bytes`) weigh most at the rank's last forward peak."""
    out = []
    for actions in schedule_actions(schedule, num_stages, num_microbatches, virtual_stages, microbatch_group):
        done = [0] * virtual_stages
        last_forward = max(i for i, action in enumerate(actions) if action.kind == "F")
        for action in actions[:last_forward]:
            if action.frees_activations:
                done[action.chunk // num_stages] += 1
        out.append(tuple(done))
    return tuple(out)


def held_boundary_bytes(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int, rank_of_chunk,
                        boundary_bytes, kept_sends: bool = True, microbatch_group: int | None = None) -> list[float]:
    """Per pipeline rank: the boundary tensors torch pipelining holds besides activations, the
    receive buffers in transit and a multi-chunk schedule's kept sends (`costing.boundary_buffers`'
    two rules; the simulator and the ILP both call this). `kept_sends` False: the
    receive buffers alone, a lower bound that replays no schedule."""
    received = receive_buffer_bytes(rank_of_chunk, boundary_bytes, num_stages)
    if not kept_sends or not schedule_spec(schedule).multi_chunk:
        return received
    done = backwards_before_last_forward(schedule, num_stages, num_microbatches, virtual_stages, microbatch_group)
    kept = kept_send_bytes(rank_of_chunk, boundary_bytes, lambda c: done[rank_of_chunk(c)][c // num_stages],
                           num_stages, schedule)
    return [a + b for a, b in zip(received, kept)]
