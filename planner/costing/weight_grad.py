"""The backward split into its input-gradient (I) and weight-gradient (W) parts.

The zero-bubble schedules run a chunk's backward as two actions: I computes the gradient of the
chunk's input, which the previous chunk waits for, and W the gradients of its weights, which
nothing downstream needs until the optimizer. The split is derived from the layer's FLOPs:

- a Linear (y = x A) has two equally sized backward GEMMs, dgrad (dy A^T) for I and wgrad
  (x^T dy) for W, each as many FLOPs as its forward GEMM: W FLOPs = the forward's Linear FLOPs;
- the attention core (QK^T, softmax, x V) has no weights: its whole backward is I;
- recomputation, the TP and context-parallel collectives of the backward and the ZeRO-3
  parameter gathers all happen in I (autograd replays the forward and gathers the parameters
  before the first backward kernel; torch's W only runs the weight GEMMs of the saved graph);
- the memory-bound (non-GEMM) part of the backward time follows the same share.

So W's share of a layer's backward compute is (forward FLOPs - attention-core forward FLOPs) /
(backward FLOPs actually run), about half for a Linear-dominated block and less at long
sequences. The attention core's forward FLOPs come from the causal count the profile records:
a causal kernel skips (s - 1) / 2s of the s x s products, so the core is 2 s / (s - 1) times
the skipped FLOPs. The embedding (a gather, no GEMMs) has no I and no W time.

Memory: torch's I (`stage_backward_input`) keeps the whole autograd graph (retain_graph=True),
so every tensor the chunk saved, not only the Linears' inputs that W reads, lives until W ends.

Read by the cost tables (the ILP), the simulator and the search's step factors
(`simulation.split_backward` plays the I and W actions).
"""
from __future__ import annotations

from meshplan.planner.contracts.attention import is_fused
from meshplan.planner.contracts.graph import LayerProfile

# W's share of the backward for costs built without a model graph (the step factors): a block
# dominated by its Linears, whose dgrad and wgrad GEMMs are equal.
DEFAULT_WEIGHT_SHARE = 0.5


def attention_core_fwd_flops(layer: LayerProfile, seq: int) -> float:
    """Forward FLOPs per sample of the attention core (QK^T and x V), from the causal count."""
    if seq < 2 or not 0 < layer.causal_fwd_flops < layer.fwd_flops:
        return 0.0
    return (layer.fwd_flops - layer.causal_fwd_flops) * 2.0 * seq / (seq - 1)


def weight_grad_share(layer: LayerProfile, seq: int, attention: str = "flash") -> float:
    """Fraction of the layer's backward compute time that is W (see the module docstring)."""
    core = attention_core_fwd_flops(layer, seq)
    skipped = (layer.fwd_flops - layer.causal_fwd_flops) if is_fused(attention) and core else 0.0
    backward = layer.bwd_flops - 2.0 * skipped  # what the kernels run (causal flash skips half)
    if backward <= 0:
        return 0.0
    return min(1.0, max(0.0, (layer.fwd_flops - core) / backward))


def model_weight_share(graph) -> float:
    """W's share of the whole model's backward (layers weighted by backward FLOPs), rounded to
    0.01 so that the step factors the search derives from it are shared between candidates."""
    shares = [(weight_grad_share(layer, graph.seq, graph.attention), layer.bwd_flops) for layer in graph.layers]
    total = sum(flops for _, flops in shares)
    return round(sum(share * flops for share, flops in shares) / total, 2) if total else DEFAULT_WEIGHT_SHARE
