"""FLOPs of one training step, counted two ways (Narayanan et al. 2021, Korthikanti et al. 2022).

- Model FLOPs (MFU): forward and backward of every layer as the profiler counts them, attention
  in full, no recomputation: the convention Megatron-LM and PaLM report, comparable across runs.
- Executed (hardware) FLOPs (HFU): what the GPUs actually run. A causal flash kernel skips the
  masked half of the scores (forward s(s-1)/2 products of QK^T and of x V, backward twice as
  many), and recomputation runs forward work again (full: the whole causal forward, less the
  last Linear where torch's early stop leaves it out, `compute_time.early_stop_last_linear`;
  selective: the attention core). At long sequences the two differ most: attention is then most of the
  model FLOPs and half of it is never run, so MFU can exceed what the device can reach.
"""
from __future__ import annotations

from meshplan.planner.costing.compute_time import early_stop_last_linear, selective_recompute_flops
from meshplan.planner.costing.device_time import causal_skipped_flops, infer_seq
from meshplan.planner.costing.gemm import linear_flops


def executed_flops_per_sample(layer, recompute: str, info, dtype: str, attention: str, config=None) -> float:
    """FLOPs the hardware runs for one sample of `layer` in one step (`config`: the engine and
    precision a full recomputation runs under; None: it reruns the whole forward)."""
    skipped = causal_skipped_flops(layer, attention)
    executed = layer.fwd_flops + layer.bwd_flops - 3 * skipped
    if recompute == "full":
        executed += layer.fwd_flops - skipped
        last = early_stop_last_linear(layer, config, info, dtype, recompute) if config is not None else None
        if last is not None:  # the forward FLOPs of the Linear torch's early stop does not rerun
            executed -= linear_flops((last,), infer_seq(layer, info, dtype), 1)
    elif recompute == "selective":
        executed += selective_recompute_flops(layer, info, dtype)
    return float(executed)


def model_flops_per_step(graph, global_batch: int) -> float:
    """Model FLOPs of one step (MFU convention: attention in full, no recomputation)."""
    return float(sum(layer.fwd_flops + layer.bwd_flops for layer in graph.layers)) * global_batch


def executed_flops_per_step(graph, global_batch: int, recomputes, config=None) -> float:
    """Executed FLOPs of one step: `recomputes` gives each layer's recomputation, `config` the
    engine and precision it runs under."""
    return sum(executed_flops_per_sample(layer, recompute, graph.info, graph.dtype, graph.attention, config)
               for layer, recompute in zip(graph.layers, recomputes)) * global_batch
