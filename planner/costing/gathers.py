"""The ZeRO parameter-gather rules: what FSDP2's one-layer-ahead prefetch cannot hide of a
layer's all-gather, per layer and per pass over a model chunk. Read by `LayerCost`, the cost
tables, the ILP and the closed form; the event engine plays the exact recurrence."""
from __future__ import annotations


def gather_exposure_s(gather_s: float, busy_s: float) -> tuple[float, float]:
    """(steady, head): what a layer's parameter all-gather (ZeRO-3; FSDP2's ZeRO-1/2 forward) adds to
    a pass over a model chunk, as FSDP2 prefetches it one layer ahead.

    Gather i runs while layer i-1 computes, so in a run of identical layers each layer exposes
    steady = max(0, g - busy). The pass's first layer has no layer before it in its chunk: its
    gather starts with the pass, and for n identical layers the pass ends at n max(g, busy) +
    min(g, busy) (n g + busy when gathers are the longer, g + n busy when compute is), so the
    first layer of every chunk's forward and the last of its backward add head = min(g, busy).
    The event engine plays the exact recurrence (`simulation.step_costs.pass_end_times`); the ILP charges
    steady per layer and head per chunk pass, equal to it for identical layers.
    """
    return max(0.0, gather_s - busy_s), min(gather_s, busy_s)


def after_other_gather_s(gather_s: float, busy_s: float, prev_busy_s: float) -> float:
    """What a layer's gather adds beyond its steady exposure (negative: saves) when the layer
    before it in the pass is another kind (the embedding before the first block, the head's
    backward before the last block's): prefetch hides it behind that layer's busy time, not its
    own. With it, steady and head per chunk pass equal the engine's recurrence for a run of
    identical layers between two others."""
    return max(0.0, gather_s - prev_busy_s) - max(0.0, gather_s - busy_s)
