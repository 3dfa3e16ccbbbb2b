"""Periodic blocks: the compact ILP on their envelope.

A model whose blocks alternate kinds (GPT-OSS: sliding-window and full-attention blocks, one after
the other) has no run of identical layers, so the compact formulation (`formulation`) does not
apply and the per-layer one poses a binary per block, chunk and option: on gpt-oss-120b, 89 such
ILPs took 85 s of a plan. Its blocks repeat with a short period, though, and their kinds differ
in little but attention (a window of 128 tokens against the whole sequence).

`envelope_table` gives every block of such a model one type whose options are, field by field,
the largest of the kinds' (times, bytes, communication): an upper bound of each block whatever
its kind. The compact ILP on that table chooses how many blocks each chunk holds and their
options; `solve_stages` then reads the assignment on the real table (`evaluate_assignment`: the
exact objective and memory of the real blocks, never above the envelope's), and the search's
exact re-scoring (`refine`) moves layers across chunk boundaries from there. Memory is therefore
never under-counted by the envelope; time may be over-counted by the kinds' difference, which
is why the result is reported as its own formulation ("envelope") rather than as optimal for
the per-layer ILP.

It applies when the blocks between the first and the last layer repeat a pattern of at most
`MAX_PERIOD` blocks (twice at least), every kind in it with the same options in the same order (the same recomputation
modes, and tp/dp under `--layerwise`), so that an option index means the same choice for each,
and when the kinds are close: each option's time and its resident plus saved bytes within
`MAX_KIND_GAP` of the largest kind's (gpt-oss-120b's two kinds: 7-10% apart in time, equal in
bytes). Kinds farther apart (Llama 4's dense and MoE blocks, one after the other) would have the
envelope price a light block as a heavy one and steer the cut by it, so they keep the per-layer ILP.

`floor_table` is the other side: every block at its kinds' least costs. Any assignment of the real
blocks is one of the floor's at no more time and no more bytes, so the search's memory-aware bound
(`search.bounds.bound_table`), which needs a run of identical layers, bounds periodic blocks on it.
"""
from __future__ import annotations

from dataclasses import fields, replace

from meshplan.planner.costing.tables import CostTable, LayerType, OptionCost

# The longest pattern of block kinds the envelope covers (GPT-OSS: 2; Gemma 3's five local blocks
# to one global: 6).
MAX_PERIOD = 8
# OptionCost fields that are labels, not costs: equal across the kinds by `periodic_types`.
_LABELS = ("recompute", "tp", "dp")
# How far below the largest kind another kind's option may be, in time and in resident plus saved
# bytes, for the envelope to stand for both (module docstring).
MAX_KIND_GAP = 0.25


def periodic_types(table: CostTable) -> tuple[int, ...] | None:
    """The distinct types of the middle layers (all but the first and the last), in order of first
    appearance, when those layers repeat a pattern of at most `MAX_PERIOD` layers and the types'
    options align and lie close (`_aligned`); None otherwise, or when the middle layers are all one
    type already (the compact formulation's own case)."""
    middle = table.layer_type[1:-1]
    if len(set(middle)) < 2:
        return None
    period = next((p for p in range(2, MAX_PERIOD + 1)
                   if len(middle) >= 2 * p and all(t == middle[i % p] for i, t in enumerate(middle))), None)
    if period is None:
        return None
    kinds = tuple(dict.fromkeys(middle[:period]))
    return kinds if _aligned([table.types[t] for t in kinds]) else None


def _aligned(kinds: list[LayerType]) -> bool:
    """The kinds' options name the same choices in the same order, and their costs are close."""
    count = len(kinds[0].options)
    if any(len(kind.options) != count for kind in kinds) or not all(
            all(getattr(option, label) == getattr(kinds[0].options[i], label) for label in _LABELS)
            for kind in kinds for i, option in enumerate(kind.options)):
        return False
    for i in range(count):
        for cost in (lambda o: o.time_s, lambda o: o.static_bytes + o.act_bytes):
            values = [cost(kind.options[i]) for kind in kinds]
            if min(values) < (1 - MAX_KIND_GAP) * max(values):
                return False
    return True


def envelope_option(options: list[OptionCost]) -> OptionCost:
    """The field-by-field largest of `options` (aligned: the same labels)."""
    return _merged_option(options, max)


def floor_option(options: list[OptionCost]) -> OptionCost:
    """The field-by-field least of `options` (aligned: the same labels)."""
    return _merged_option(options, min)


def _merged_option(options: list[OptionCost], pick) -> OptionCost:
    merged = {f.name: pick(getattr(option, f.name) for option in options)
              for f in fields(OptionCost) if f.name not in _LABELS}
    return replace(options[0], **merged)


def envelope_table(table: CostTable) -> CostTable | None:
    """`table` with its periodic middle layers given one envelope type (module docstring), or
    None when `periodic_types` finds no pattern."""
    return _merged_table(table, envelope_option, "envelope")


def floor_table(table: CostTable) -> CostTable | None:
    """`table` with its periodic middle layers given one type whose options are their kinds'
    least, field by field (`floor_option`), or None when `periodic_types` finds no pattern.
    Every assignment of `table` is one of this table at no more time and no more bytes, so a
    lower bound on its ILP is one on `table`'s: the search's memory-aware bound
    (`bounds.bound_table`), which needs a run of identical layers that periodic blocks lack."""
    return _merged_table(table, floor_option, "floor")


def _merged_table(table: CostTable, merge, name: str) -> CostTable | None:
    pattern = periodic_types(table)
    if pattern is None:
        return None
    kinds = [table.types[t] for t in pattern]
    merged = LayerType(key=f"{name}(" + ", ".join(kind.key for kind in kinds) + ")",
                       options=tuple(merge([kind.options[i] for kind in kinds]) for i in range(len(kinds[0].options))))
    index = len(table.types)
    layer_type = (table.layer_type[0],) + (index,) * (table.num_layers - 2) + (table.layer_type[-1],)
    return replace(table, types=table.types + (merged,), layer_type=layer_type)
