"""The simulator's input: a costed configuration (`StepCosts`: one `LayerCost` per layer and the
chunk each layer sits in), and what the event engine (`planner.simulation.event_engine`) reads of
it per model chunk: each chunk's forward and backward durations split by cause, with the ZeRO
gathers that one-layer-ahead prefetch cannot hide (`pass_end_times`), and its gradient buckets.
Durations are precomputed per chunk, so playing a step costs O(pp * microbatches * virtual_stages).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.communication import DDP_BUCKET_BYTES
from meshplan.planner.costing.engine_memory import keeps_stage_outputs
from meshplan.planner.costing.layer_cost import LayerCost
from meshplan.planner.costing.state_memory import GRAD_SYNC_MODES, dp_method, executed_zero


@dataclass(frozen=True)
class StepCosts:
    """A costed configuration, ready to simulate.

    `p2p_time_s[c]` is the time to move one micro-batch's boundary tensor from chunk c to chunk
    c + 1 (and its gradient back); empty means free. FLOPs and tokens are whole-job totals per
    step; `peak_flops_per_s` is one device's peak for the precision (0: MFU reported as 0).
    """

    config: ParallelConfig
    layer_costs: tuple[LayerCost, ...]
    chunk_of_layer: tuple[int, ...]
    p2p_time_s: tuple[float, ...] = ()
    tokens_per_step: float = 0.0
    model_flops_per_step: float = 0.0
    hw_flops_per_step: float = 0.0
    peak_flops_per_s: float = 0.0
    usable_memory_bytes: float = math.inf
    # The host side of offloading (`costing.offload`): a node's GPUs, and the host bytes they leave
    # for offloaded states (`usable_host_memory_bytes`).
    gpus_per_node: int = 1
    usable_host_memory_bytes: float = math.inf
    grad_bucket_bytes: float = DDP_BUCKET_BYTES
    # "overlap": buckets launched during the last micro-batch's backward (DDP's of
    # `grad_bucket_bytes`; FSDP2 without pipelining, one per layer: `_buckets`). "overlap_every_microbatch": the
    # same during every micro-batch's backward (FSDP syncing each micro-batch to keep gradients
    # sharded). "after_chunk": torch pipelining
    # with FSDP/replicate: a chunk's whole reduction starts after its last backward
    # (`perform_reduce_grad`) and the rank's next compute waits for it.
    grad_sync: str = "overlap"
    # Links the data-parallel reduction and the pipeline transfers leave a GPU on ("nvlink",
    # "nic", or "" for none): streams on one link share it (`planner.simulation.contention`).
    dp_link: str = ""
    pp_link: str = ""
    # Per layer: the weight-gradient (W) share of its backward compute, for schedules that split
    # the backward (`planner.simulation.split_backward`); empty: DEFAULT_WEIGHT_SHARE everywhere.
    weight_grad_share: tuple[float, ...] = ()

    def __post_init__(self):
        if self.grad_sync not in GRAD_SYNC_MODES:
            raise ValueError(f"grad_sync must be one of {GRAD_SYNC_MODES}, got {self.grad_sync!r}")
        num_chunks = self.config.num_model_chunks
        if len(self.layer_costs) != len(self.chunk_of_layer):
            raise ValueError(f"{len(self.layer_costs)} layer costs but {len(self.chunk_of_layer)} chunk indices")
        if list(self.chunk_of_layer) != sorted(self.chunk_of_layer):
            raise ValueError("chunk_of_layer must be non-decreasing: chunks hold contiguous layers in order")
        if set(self.chunk_of_layer) != set(range(num_chunks)):
            missing = sorted(set(range(num_chunks)) - set(self.chunk_of_layer))
            raise ValueError(f"every one of the {num_chunks} pipeline chunks needs a layer; "
                             f"chunks {missing[:5]} are empty or indices are out of range")
        if self.p2p_time_s and len(self.p2p_time_s) != num_chunks - 1:
            raise ValueError(f"p2p_time_s needs one entry per chunk boundary ({num_chunks - 1}), "
                             f"got {len(self.p2p_time_s)}")
        if any(t < 0 for t in self.p2p_time_s):
            raise ValueError(f"p2p times must be >= 0, got {min(self.p2p_time_s)}")
        if self.grad_bucket_bytes <= 0:
            raise ValueError(f"grad_bucket_bytes must be positive, got {self.grad_bucket_bytes}")
        if self.weight_grad_share and (len(self.weight_grad_share) != len(self.layer_costs)
                                       or not all(0.0 <= w <= 1.0 for w in self.weight_grad_share)):
            raise ValueError("weight_grad_share needs one fraction in [0, 1] per layer")


@dataclass(frozen=True)
class Chunk:
    """Per-micro-batch durations of one model chunk, split by cause, and its per-layer detail."""

    rank: int
    fwd_compute_s: float
    fwd_tp_s: float
    fwd_zero_s: float  # exposed parameter-gather time in forward (ZeRO-3; FSDP2's ZeRO-1/2)
    bwd_compute_s: float
    recompute_s: float
    bwd_tp_s: float
    bwd_zero_s: float
    activation_bytes: float
    grad_reduce_s: float  # per step: the whole chunk's gradient reduction
    # DP buckets of this chunk: (end offset within the chunk's last backward, reduction seconds)
    buckets: tuple[tuple[float, float], ...] = field(default=())
    fwd_cp_s: float = 0.0  # context-parallel K/V all-gathers in forward (blocking)
    bwd_cp_s: float = 0.0  # their gradients' reduce-scatters in backward
    bwd_weight_s: float = 0.0  # the weight-gradient (W) part of bwd_compute_s
    fwd_ep_s: float = 0.0  # expert-parallel all-to-alls in forward (dispatch, combine; blocking)
    bwd_ep_s: float = 0.0  # their mirrors in backward
    fwd_expert_s: float = 0.0  # the routed experts' part of fwd_compute_s (between dispatch and combine)
    bwd_expert_s: float = 0.0  # the routed experts' part of bwd_compute_s

    @property
    def fwd_s(self) -> float:
        return self.fwd_compute_s + self.fwd_tp_s + self.fwd_zero_s + self.fwd_cp_s + self.fwd_ep_s

    @property
    def bwd_s(self) -> float:
        return self.bwd_compute_s + self.recompute_s + self.bwd_tp_s + self.bwd_zero_s + self.bwd_cp_s + self.bwd_ep_s


def pass_end_times(compute_s: list[float], gather_s: list[float]) -> list[float]:
    """End time of each layer's compute in one pass, with ZeRO-3 gathers prefetched one layer ahead.

    Gather i starts once gather i-1 is done and layer i-1 has started (so at most two layers'
    gathered parameters are live); layer i computes once layer i-1 is done and gather i is.
    Without gathers this is the running sum of `compute_s`.
    """
    ends: list[float] = []
    gather_end = compute_end = prev_compute_start = 0.0
    for compute, gather in zip(compute_s, gather_s):
        gather_end = max(gather_end, prev_compute_start) + gather
        start = max(compute_end, gather_end)
        compute_end = start + compute
        prev_compute_start = start
        ends.append(compute_end)
    return ends


def build_chunks(costs: StepCosts) -> list[Chunk]:
    cfg = costs.config
    by_chunk: list[list[LayerCost]] = [[] for _ in range(cfg.num_model_chunks)]
    for cost, chunk in zip(costs.layer_costs, costs.chunk_of_layer):
        by_chunk[chunk].append(cost)
    chunks = []
    for index, layers in enumerate(by_chunk):
        fwd_busy = [c.fwd_busy_s for c in layers]
        fwd_end = pass_end_times(fwd_busy, [c.fwd_gather_s for c in layers])[-1]
        backward = layers[::-1]
        bwd_busy = [c.bwd_busy_s for c in backward]
        bwd_ends = pass_end_times(bwd_busy, [c.bwd_gather_s for c in backward])
        chunks.append(Chunk(
            rank=cfg.rank_of_chunk(index),
            fwd_compute_s=sum(c.fwd_compute_s for c in layers), fwd_tp_s=sum(c.tp_fwd_comm_s for c in layers),
            fwd_zero_s=fwd_end - sum(fwd_busy),
            fwd_cp_s=sum(c.cp_fwd_comm_s for c in layers), bwd_cp_s=sum(c.cp_bwd_comm_s for c in layers),
            fwd_ep_s=sum(c.ep_fwd_comm_s for c in layers), bwd_ep_s=sum(c.ep_bwd_comm_s for c in layers),
            fwd_expert_s=sum(c.expert_fwd_s for c in layers), bwd_expert_s=sum(c.expert_bwd_s for c in layers),
            bwd_compute_s=sum(c.bwd_compute_s for c in layers), recompute_s=sum(c.recompute_s for c in layers),
            bwd_tp_s=sum(c.tp_bwd_comm_s for c in layers), bwd_zero_s=bwd_ends[-1] - sum(bwd_busy),
            # torch's PipelineStage keeps each in-flight micro-batch's output until its backward;
            # the next stage (another rank) saves it as its input, so it is this rank's cost too
            # (not Megatron-LM's: `engine_memory.keeps_stage_outputs`).
            activation_bytes=sum(c.activation_bytes for c in layers) + (
                layers[-1].output_bytes if index < cfg.num_model_chunks - 1 and keeps_stage_outputs(cfg.engine)
                else 0.0),
            grad_reduce_s=sum(c.dp_grad_comm_s for c in layers),
            buckets=_buckets(backward, bwd_ends, costs)))
    return chunks


def _buckets(backward: list[LayerCost], bwd_ends: list[float], costs: StepCosts) -> tuple[tuple[float, float], ...]:
    """Group layers (backward order) into gradient buckets of about `grad_bucket_bytes`."""
    # ZeRO-2/3 keep only a 1/dp shard of the gradients, but the bucket holds the full gradient
    # before its reduce-scatter.
    cfg = costs.config
    zero = executed_zero(cfg.zero, cfg.data_ranks, cfg.pp, cfg.schedule)
    full = cfg.data_ranks if zero >= 2 else 1
    # FSDP2 (`replicate`, `fully_shard`) reduces each unit's gradients, a layer's, after its backward
    per_layer = dp_method(zero, cfg.data_ranks, cfg.tp, cfg.pp, cfg.precision) != "ddp"
    buckets, filled_bytes, comm_s = [], 0.0, 0.0
    for position, (cost, end_s) in enumerate(zip(backward, bwd_ends)):
        filled_bytes += cost.grad_bytes * full
        comm_s += cost.dp_grad_comm_s
        if per_layer or filled_bytes >= costs.grad_bucket_bytes or position == len(backward) - 1:
            if comm_s > 0:
                buckets.append((end_s, comm_s))
            filled_bytes, comm_s = 0.0, 0.0
    return tuple(buckets)
