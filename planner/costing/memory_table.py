"""`meshplan memory`: a model's training memory without a cluster or a batch.

Model states per GPU for each precision recipe, ZeRO stage and data-parallel GPU count, by the
ZeRO paper's recipe (`state_memory.paper_state_bytes`, the cost model's "zero-paper" rule:
bf16-mixed 2 + 2 + 12 bytes per parameter, fp32 4 + 4 + 8, sharded by the stage over the GPUs),
and the activations one sample (micro-batch 1, whole model on one GPU, no tensor parallelism)
saves for backward at each sequence length and recomputation mode (`activation_memory.
activation_bytes`, what the planner charges a layer, plus the largest transient working set).
"""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.activation_memory import activation_bytes
from meshplan.planner.costing.precision import activation_scale
from meshplan.planner.costing.state_memory import paper_state_bytes

MEMORY_PRECISIONS = ("bf16-mixed", "fp32")
ZERO_STAGES = (0, 1, 2, 3)
GPU_COUNTS = (1, 8, 64)
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class StateRow:
    """Model states per GPU of one precision, ZeRO stage and data-parallel GPU count."""

    precision: str
    zero: int
    gpus: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def to_json(self) -> dict:
        return {"precision": self.precision, "zero": self.zero, "gpus": self.gpus, "params": self.params_bytes,
                "grads": self.grads_bytes, "optimizer": self.optimizer_bytes, "total": self.total_bytes}


@dataclass(frozen=True)
class ActivationRow:
    """Activation bytes of one sample through the whole model, by recomputation mode."""

    precision: str
    seq: int | None  # None: a file model (no sequence length)
    bytes_by_recompute: dict[str, float]

    def to_json(self) -> dict:
        return {"precision": self.precision, **({"seq": self.seq} if self.seq is not None else {}),
                "activations": dict(self.bytes_by_recompute)}


def state_rows(num_params: int, gpu_counts=GPU_COUNTS) -> list[StateRow]:
    rows = []
    for precision in MEMORY_PRECISIONS:
        for zero in ZERO_STAGES:
            for gpus in gpu_counts:
                states = paper_state_bytes(float(num_params), gpus, zero, precision)
                rows.append(StateRow(precision, zero, gpus, states["params"], states["grads"], states["optimizer"]))
    return rows


def activation_row(graph, precision: str, seq: int | None) -> ActivationRow:
    """The saved bytes of every layer plus the largest transient, at micro-batch 1 on one GPU."""
    config = ParallelConfig(gpus=1, global_batch=1, precision=precision)
    scale = activation_scale(precision, graph.dtype)
    out = {}
    for mode in RECOMPUTE_MODES:
        kept = [activation_bytes(layer, config, scale, recompute=mode) for layer in graph.layers]
        out[mode] = sum(saved for saved, _ in kept) + max((transient for _, transient in kept), default=0.0)
    return ActivationRow(precision, seq, out)
