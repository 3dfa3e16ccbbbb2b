"""Cost model: time and memory of one layer under one strategy, and of a whole configuration.

(Owned by the cost model; the dataclasses below are the contract the simulator and the solver
read. Add fields freely; do not rename.)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    """How one layer runs: mesh degrees it sees, ZeRO stage, recomputation, SP, micro-batch size.

    Mesh order is (pp, dp, tp) with tp innermost: a TP group is `tp` consecutive ranks, a DP group
    is `dp` ranks spaced `tp` apart, pipeline neighbours are `dp * tp` ranks apart.
    """

    tp: int = 1
    dp: int = 1
    zero: int = 0
    recompute: str = "none"  # none | selective | full
    sp: bool = False
    microbatch_size: int = 1
    precision: str = "bf16-mixed"  # bf16-mixed | fp32
    pp: int = 1  # only for which link pipeline transfers cross


@dataclass(frozen=True)
class LayerCost:
    """One layer on one rank. Times are per micro-batch unless marked per step."""

    fwd_compute_s: float  # forward compute
    bwd_compute_s: float  # backward compute (without recomputation)
    recompute_s: float  # extra forward compute during backward (0 without recomputation)
    tp_fwd_comm_s: float  # blocking TP collectives in forward
    tp_bwd_comm_s: float  # blocking TP collectives in backward (incl. the recomputed forward's)
    zero3_gather_s: float  # ZeRO-3 parameter all-gather, once before forward and once before backward
    dp_grad_comm_s: float  # per step: this layer's gradient reduction (all-reduce or reduce-scatter)
    dp_param_gather_s: float  # per step: ZeRO-1/2 all-gather of updated parameters after the optimizer
    optimizer_step_s: float  # per step: this layer's share of the optimizer step
    param_bytes: float  # resident, per rank
    grad_bytes: float  # resident, per rank
    optimizer_bytes: float  # resident, per rank (fp32 master + Adam moments)
    activation_bytes: float  # saved for backward, per in-flight micro-batch
    buffer_bytes: float  # transient peak (gathered ZeRO-3 params, comm buffers, recompute working set)
    output_bytes: float  # boundary tensor sent to the next stage, per micro-batch (after SP sharding)
