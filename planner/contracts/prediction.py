"""`Prediction`: what the simulator (and so `estimate`) says about one training step of a plan.

`to_json()` gives the keys (docs/architecture.md) of `estimate --json` and `simulate --json`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

INTERVAL_KINDS = ("forward", "backward", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "zero_gather",
                  "send", "recv", "optimizer", "idle")


@dataclass(frozen=True)
class Interval:
    """One busy (or idle) span on one rank's stream."""

    rank: int  # pipeline rank
    stream: str  # "compute", "tp", "cp", "ep", "dp", "p2p"
    kind: str  # one of INTERVAL_KINDS
    start_s: float
    end_s: float
    microbatch: int = -1
    chunk: int = -1  # model chunk (pipeline stage x virtual stage)

    def __post_init__(self):
        if self.kind not in INTERVAL_KINDS:
            raise ValueError(f"interval kind must be one of {INTERVAL_KINDS}, got {self.kind!r}")
        if self.end_s < self.start_s:
            raise ValueError(f"interval ends ({self.end_s}) before it starts ({self.start_s})")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one rank at its peak, by kind."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    # Of params + grads + optimizer: the routed experts' states (mixtures of experts; / ep under
    # expert parallelism). Not added again to the total.
    experts: float = 0.0
    # Of buffers: what the engine's caching allocator holds fragmented beside the activations and
    # buffers it allocates and frees (`costing.engine_memory.allocator_reserve_fraction`; none
    # under meshplan's executor). Not added again to the total.
    fragmented: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def to_json(self) -> dict[str, float]:
        """The design's keys (params, grads, optimizer, activations, buffers, total), and
        `experts` for mixtures of experts only, `fragmented` under an engine's allocator only."""
        out = {**asdict(self), "total": self.total}
        for optional in ("experts", "fragmented"):
            if not out[optional]:
                del out[optional]
        return out


@dataclass(frozen=True)
class Prediction:
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hw_tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: float
    memory: tuple[MemoryBreakdown, ...]  # indexed by pipeline rank
    bubble_fraction: float
    fits: bool
    # Seconds of the step by cause on the busiest rank: compute, recompute, tp_comm, dp_comm,
    # pp_comm, bubble, optimizer (exposed time only: what overlaps is not counted twice).
    breakdown: dict[str, float] = field(default_factory=dict)
    timeline: tuple[Interval, ...] = ()
    # Per pipeline rank: [(time_s, live bytes)] steps of the memory curve over the step.
    memory_timeline: tuple[tuple[tuple[float, float], ...], ...] = ()
    # Offloaded model states in host memory on the heaviest node, all its GPUs summed
    # (`costing.offload.host_state_bytes_per_node`); `fits` counts them too. 0: nothing offloaded.
    host_state_bytes_per_node: float = 0.0

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: executed FLOPs (causal attention as run, recomputation
        included; `costing.flops`) over the peak, the share of the device the step really uses."""
        if self.model_tflops_per_gpu <= 0:
            return 0.0
        return self.mfu * self.hw_tflops_per_gpu / self.model_tflops_per_gpu

    def to_json(self, include_timeline: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hw_tflops_per_gpu": self.hw_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_bytes": [m.to_json() for m in self.memory],
            "bubble_fraction": self.bubble_fraction,
            "fits": self.fits,
            "breakdown": dict(self.breakdown),
        }
        if self.host_state_bytes_per_node:  # only when offloading: the keys of other plans stay as they were
            out["host_state_bytes_per_node"] = self.host_state_bytes_per_node
        if include_timeline:
            out["timeline"] = [asdict(i) for i in self.timeline]
            out["memory_timeline"] = [list(map(list, rank)) for rank in self.memory_timeline]
        return out
