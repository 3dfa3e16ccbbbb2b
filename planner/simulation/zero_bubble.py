"""Action orders of torch 2.13's zero-bubble and V-shaped pipeline schedules, generated without torch.

The backward of a chunk splits into I (gradient of its input, which the previous chunk waits
for) and W (gradient of its weights, which nothing downstream waits for); B is the two back to
back. These functions reproduce, action for action, the compute order of torch's
`pipeline_order` (a test builds torch's classes and compares over a grid of pp and m):

- zb-interleaved, `ScheduleInterleavedZeroBubble` (ZB1P, Qi et al. 2023): interleaved 1F1B with
  one warm-up forward per hop instead of two, I in place of B, and each W deferred until rank k
  has run k + 1 steady-state steps, so the W's fill what would be the drain bubble. torch's
  `_add_bubbles_to_actions` only inserts idle slots, which the event engine plays by itself.
- zbv, `ScheduleZBVZeroBubble` (ZB-V, Qi et al. 2024 section 6): two chunks per rank in a V
  (chunk0 = rank, chunk1 = 2 pp - 1 - rank); torch builds the order for max(m, 2 pp - 1)
  micro-batches and drops the actions of the extra ones.
- dualpipev, `ScheduleDualPipeV` (DeepSeek-V3's DualPipe folded into a V): its steady state pairs
  the forward of one chunk with the full backward of the other ("F;B"). torch 2.13 runs the pair
  one sub-action after the other on one stream, then posts both sends, so the pair is two
  actions here, the forward marked `overlap=True`: its output leaves when the pair ends.

Notation as in `planner.simulation.schedules`: p = pipeline ranks, m = micro-batches,
v = virtual stages; chunk indices are torch's stage indices (model order).
"""
from __future__ import annotations

from collections import defaultdict

from meshplan.planner.contracts.schedule import default_microbatch_group, interleaved_warmup
from meshplan.planner.simulation.actions import new_action


class _Counter:
    """Next micro-batch index per (chunk, counter name), as torch's per-stage counters."""

    def __init__(self):
        self.next: dict[tuple[int, str], int] = defaultdict(int)

    def take(self, chunk: int, name: str) -> int:
        index = self.next[chunk, name]
        self.next[chunk, name] = index + 1
        return index


def zb_interleaved(num_stages: int, num_microbatches: int, virtual_stages: int, rank: int) -> list:
    """`ScheduleInterleavedZeroBubble._calculate_single_rank_operations` (`_get_1f1b_rank_ops` with
    enable_zero_bubble): w = min((v - 1) r + p - 1 - k, m v) warm-up forwards (r = m // max(1, m // p)),
    then F/I pairs, then the I drain; W of the j-th I runs after the (k + 1 + j)-th pair. Written
    flat (per-virtual-stage counters in lists): the search generates it for every rank of every
    shape it replays."""
    p, v = num_stages, virtual_stages
    per_round = default_microbatch_group(num_stages, num_microbatches)
    total = num_microbatches * virtual_stages
    warmup = interleaved_warmup(num_stages, num_microbatches, virtual_stages, rank, per_round, hops=1)
    next_f, next_i, next_w = [0] * v, [0] * v, [0] * v  # torch's per-stage counters, by virtual stage
    actions: list = []
    backward_locals: list[int] = []
    num_weights = 0
    for step in range(total + warmup):
        if step < total:
            local = (step // per_round) % v
            actions.append(new_action("F", local * p + rank, next_f[local]))
            next_f[local] += 1
        if step < warmup:
            continue
        local = v - 1 - ((step - warmup) // per_round) % v
        actions.append(new_action("I", local * p + rank, next_i[local]))
        next_i[local] += 1
        backward_locals.append(local)
        if step - warmup >= rank:  # torch's num_1f1b_microbatches = rank
            local = backward_locals[num_weights]
            actions.append(new_action("W", local * p + rank, next_w[local]))
            next_w[local] += 1
            num_weights += 1
    for local in backward_locals[num_weights:]:
        actions.append(new_action("W", local * p + rank, next_w[local]))
        next_w[local] += 1
    return actions


def zbv(num_stages: int, num_microbatches: int, virtual_stages: int, rank: int) -> list:
    """`ScheduleZBVZeroBubble._calculate_single_rank_operations`: warm-up, a steady state of
    F0 I0 W0 F1 I1 W1, then a cool-down of I's with the W's at the end (`virtual_stages` is the
    V's 2, checked by the caller)."""
    pp, n_micro = num_stages, max(2 * num_stages - 1, num_microbatches)
    first, second = rank, 2 * pp - 1 - rank
    count = _Counter()
    out: list = []

    def add(kind: str, chunk: int) -> None:
        out.append(new_action(kind, chunk, count.take(chunk, kind)))

    for _ in range(2 * (pp - rank) - 1):
        add("F", first)
    for _ in range(rank):
        add("F", second)
        add("F", first)
    for _ in range(pp - rank):
        add("F", second)
        add("I", second)
        add("W", second)
    while count.next[second, "F"] < count.next[first, "F"] or count.next[first, "F"] < n_micro:
        if count.next[first, "F"] < n_micro:
            add("F", first)
        add("I", first)
        add("W", first)
        add("F", second)
        add("I", second)
        add("W", second)
    for _ in range(rank):
        add("I", first)
        add("I", second)
    for _ in range(pp - rank):
        add("I", first)
        add("W", first)
    for chunk in (second, first):
        while count.next[chunk, "W"] < count.next[chunk, "I"]:
            add("W", chunk)
    return [a for a in out if a.microbatch < num_microbatches]  # drop the padding micro-batches


def dualpipev(num_stages: int, num_microbatches: int, virtual_stages: int, rank: int) -> list:
    """`ScheduleDualPipeV._calculate_single_rank_operations`: eight phases; a full backward B
    counts as both the I and the W of its micro-batch; each I queues its W, which a later
    "pending weight" slot runs (oldest first). `virtual_stages` is the V's 2, checked by the caller."""
    pp, m = num_stages, num_microbatches
    first, second = rank, 2 * pp - 1 - rank
    count = _Counter()
    weights: list[tuple[int, int]] = []
    out: list = []

    def add(kind: str, chunk: int, overlap: bool = False) -> None:
        microbatch = count.take(chunk, "I" if kind in ("I", "B") else kind)
        if kind == "B":
            count.take(chunk, "W")
        elif kind == "I":
            weights.append((chunk, microbatch))
        out.append(new_action(kind, chunk, microbatch, overlap))

    def pending_weight() -> None:
        if weights:
            chunk, microbatch = weights.pop(0)
            count.take(chunk, "W")
            out.append(new_action("W", chunk, microbatch))

    def overlapped(forward: int, backward: int) -> None:
        add("F", forward, overlap=True)
        add("B", backward)

    for _ in range((pp - rank - 1) * 2):
        add("F", first)
    for _ in range(rank + 1):
        add("F", first)
        add("F", second)
    for _ in range(pp - rank - 1):
        add("I", second)
        pending_weight()
        add("F", second)
    for step in range(m - 2 * pp + rank + 1):
        if step == 0 and rank == pp - 1:  # torch does not overlap this pair (shorter bubble)
            add("F", first)
            add("B", second)
        else:
            overlapped(first, second)
        overlapped(second, first)
    for _ in range(pp - rank - 1):
        add("B", second)
        overlapped(second, first)
    split = False
    for step in range(rank + 1):
        split = split or (step == (rank + 1) // 2 and rank % 2 == 1)
        add("I" if split else "B", second)
        split = split or (step == (rank + 1) // 2 and rank % 2 == 0)
        add("I" if split else "B", first)
    for _ in range(pp - rank - 1):
        pending_weight()
        add("I" if split else "B", first)
    for _ in range(rank + 1):
        pending_weight()
    return out
