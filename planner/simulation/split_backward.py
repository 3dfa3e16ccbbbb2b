"""The backward split into its input-gradient (I) and weight-gradient (W) actions, as the
zero-bubble schedules play them. Which part of a layer's backward is W is a cost rule
(`costing.weight_grad`); this module turns the engine's chunks into I and W parts.
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.costing.weight_grad import DEFAULT_WEIGHT_SHARE


def action_part(chunk, kind: str):
    """The part of a chunk's per-micro-batch work one action does, as a chunk of the same type:
    F and B unchanged; I the backward without the weight GEMMs; W only the weight GEMMs."""
    if kind in ("F", "B"):
        return chunk
    if kind == "I":
        return replace(chunk, bwd_compute_s=chunk.bwd_compute_s - chunk.bwd_weight_s)
    if kind == "W":
        return replace(chunk, bwd_compute_s=chunk.bwd_weight_s, recompute_s=0.0, bwd_tp_s=0.0, bwd_zero_s=0.0,
                       bwd_cp_s=0.0, bwd_ep_s=0.0)
    raise ValueError(f"unknown action kind {kind!r}")


def with_weight_grad(costs, chunks: list) -> list:
    """`chunks` (the engine's, in chunk order) with `bwd_weight_s` set from the layers' shares."""
    shares = costs.weight_grad_share or (DEFAULT_WEIGHT_SHARE,) * len(costs.layer_costs)
    weight_s = [0.0] * len(chunks)
    for cost, chunk, share in zip(costs.layer_costs, costs.chunk_of_layer, shares):
        weight_s[chunk] += share * cost.bwd_compute_s
    return [replace(chunk, bwd_weight_s=seconds) for chunk, seconds in zip(chunks, weight_s)]
