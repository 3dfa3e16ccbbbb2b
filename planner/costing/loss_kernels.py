"""The loss kernels' memory traffic: bytes moved per logit by the cross-entropy an engine runs, and
the fp32 copies of the logits torch's eager cross-entropy backward holds (`ce_backward_fp32_copies`).

The output layer's logits are the largest activation a language model makes (tokens x vocab), and
the kernels that turn them into a loss are memory-bound: their time is the bytes they read and
write. Elsewhere the memory-bound time of a layer is priced by the bytes it saves for backward
(`compute_time.compute_times_s`, `elementwise_bytes_per_activation_byte`, fitted on the A100 fit
set, whose 51,200-entry vocabulary keeps the loss a small share of a step). Where the engine's
loss code is known, its kernels are counted instead, one tensor pass at a time.

Megatron-Core (megatron/core/tensor_parallel/cross_entropy.py and
megatron/core/fusions/fused_cross_entropy.py), on the bf16 logits of the vocab-parallel output
Linear; fp32 elements are 4 bytes, bf16 2:

- "none", `_VocabParallelCrossEntropy` (Megatron-LM's default). Forward: the logits cast to fp32
  (read 2, write 4), their max (read 4), the max subtracted in place (read 4, write 4), exp into a
  buffer (read 4, write 4), its sum (read 4), the division that leaves the softmax saved for
  backward (read 4, write 4): 38. Backward: the saved softmax scaled in place by the loss
  gradient (read 4, write 4), then the cast's backward to bf16 (read 4, write 2): 14.
- "native", --cross-entropy-loss-fusion: the same steps as three compiled functions (`jit_fuser`),
  each one kernel: cast and max (read 2, write 4), subtract, exp and sum (read 4, write 4),
  divide (read 4, write 4): 22. Backward as unfused: 14.
- "te", --cross-entropy-fusion-impl te: Transformer Engine's parallel cross-entropy, a Triton
  kernel that reads the bf16 logits once for the running max and sum (2) and again to write the
  gradient in their place (read 2, write 2): 6. Backward: that gradient scaled in place by the
  loss gradient (read 2, write 2): 4.

torch's cross-entropy as torchtitan and meshplan's executor run it on a GPU,
`cross_entropy(logits.float(), labels)` on the bf16 logits (`TORCH_LOSS_ENGINES`):

- "eager", unsharded: the cast to fp32 (read 2, write 4); log_softmax's CUDA kernel, whose fp32
  row (a vocabulary of 128K is 512 KB) does not fit shared memory, reads it for the max, again for
  the sum of exponentials and once more to write the log-probs (4 + 4 + 4 + 4): 22. Backward:
  nll_loss's zeroed gradient (write 4; its scatter is per token), log_softmax's backward reads the
  gradient for its sum, then it and the log-probs to write its output (4 + 4 + 4 + 4), the cast's
  backward to bf16 (read 4, write 2): 26.
- "loss_parallel", the logits split over TP (torch/distributed/tensor/parallel/loss.py, one op at a
  time): the cast (2 + 4), amax (4), the shift (4 + 4), exp (4 + 4) and its sum (4), the log-probs
  (4 + 4): 38. Backward, `_nll_loss_and_log_softmax_backward`: the zeroed mask (4), exp of the
  log-probs (4 + 4), their sum with the mask (4 + 4 + 4), the product with the per-token gradient
  (4 + 4), the cast back (4 + 2): 38.
- "compiled" (`engine_rules.compiles_loss`; Inductor, whose graphs tests/planner/costing/
  test_loss_kernels.py reads): the forward's reduction reads the bf16 logits for the max and again
  for the sum of exponentials (2 + 2), the backward's one pointwise kernel reads them and writes
  their bf16 gradient (2 + 2): 4 and 4.

The per-token reductions (max, sum and target logit all-reduced over the TP group) are vocab
times smaller and left out.
"""
from __future__ import annotations

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.engine_rules import CE_FUSION_ENGINES, compiles_loss
from meshplan.planner.contracts.graph import LayerProfile
from meshplan.planner.costing.activation_memory import sharded_bytes
from meshplan.planner.costing.device_time import DTYPE_BYTES, memory_time_s
from meshplan.planner.costing.tp_split import is_split

# (forward, backward) bytes per logit of each Megatron-Core cross-entropy (`ParallelConfig.cross_entropy_fusion`)
MEGATRON_CE_BYTES_PER_LOGIT = {"none": (38.0, 14.0), "native": (22.0, 14.0), "te": (6.0, 4.0)}
# Engines whose loss is torch's cross-entropy on the fp32 cast of bf16 logits, and its (forward,
# backward) bytes per logit as each runs it (`torch_ce_kind`); counted on a GPU, in bf16 or fp8 runs.
TORCH_LOSS_ENGINES, TORCH_LOSS_PRECISIONS = ("torchtitan", "meshplan"), ("bf16-mixed", "fp8")
TORCH_CE_BYTES_PER_LOGIT = {"eager": (22.0, 26.0), "loss_parallel": (38.0, 38.0), "compiled": (4.0, 4.0)}

# torch's eager cross-entropy on fp32 logits (`cross_entropy(logits.float(), labels)`: torchtitan's
# loss, meshplan's executor): the fp32 tensors of the rank's logits its backward holds at once
# beside the saved log-probs. Unsharded, nll_loss's dense gradient and log_softmax's backward
# output. Under TP torch's `loss_parallel` (torchtitan's default, `disable_loss_parallel = false`)
# fuses both backwards into `_nll_loss_and_log_softmax_backward`
# (torch/distributed/tensor/parallel/loss.py), which builds the one-hot mask (`zeros_like`),
# exp(log-probs) and their sum before the product replaces them: one more. Measured with torch's
# MemTracker on the op sequence itself (tests/planner/costing/test_loss_kernels.py).
CE_BACKWARD_FP32_COPIES = 2
LOSS_PARALLEL_BACKWARD_FP32_COPIES = 3


def ce_backward_fp32_copies(loss_parallel: bool) -> int:
    """How many fp32 copies of the rank's logits torch's eager cross-entropy backward holds beside
    the saved log-probs (module constants above)."""
    return LOSS_PARALLEL_BACKWARD_FP32_COPIES if loss_parallel else CE_BACKWARD_FP32_COPIES


def torch_ce_moved_bytes_per_logit(kind: str) -> float:
    """Bytes per logit torch's cross-entropy run as `kind` moves, forward and backward together
    (`TORCH_CE_BYTES_PER_LOGIT`): what `estimate`'s compile hint and `--compile-loss`'s help name."""
    return sum(TORCH_CE_BYTES_PER_LOGIT[kind])


def torch_ce_held_bytes_per_logit(kind: str, compute_bytes: float) -> tuple[float, float]:
    """(kept for backward, held beside it in backward) bytes per logit of torch's cross-entropy on
    `compute_bytes` logits run as `kind` (`torch_ce_kind`: torchtitan's head in `engine_memory`;
    `gpu_check`'s loss_memory section names its modes alike). Eager: the fp32 log-probs, and
    `ce_backward_fp32_copies` fp32 copies. Compiled (Inductor's partitioner and fusion, read in
    tests/planner/costing/test_loss_kernels.py): the logits themselves, and their gradient in their
    dtype; the partitioner's two fp32 values per token (max, log-sum-exp) are per token, not per logit."""
    if kind == "compiled":
        return compute_bytes, compute_bytes
    return 4.0, 4.0 * ce_backward_fp32_copies(kind == "loss_parallel")


def counts_loss_kernels(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile | None = None) -> bool:
    """Whether the layer's loss kernels are counted (`loss_times_s`) rather than priced by the
    bytes it saves: a language model's output layer under an engine whose loss code is counted
    (`engine_rules.CE_FUSION_ENGINES`), or whose loss is torch's (`TORCH_LOSS_ENGINES`) on a GPU
    profile (`cluster` with SMs: a CPU's kernels are another library's, which calibration measures)
    with bf16 logits."""
    if layer.kind != "head":
        return False
    if config.engine in CE_FUSION_ENGINES:
        return True
    return (config.engine in TORCH_LOSS_ENGINES and config.precision in TORCH_LOSS_PRECISIONS
            and cluster is not None and cluster.device.num_sms > 0)


def torch_ce_kind(layer: LayerProfile, config: ParallelConfig) -> str:
    """How torch's cross-entropy runs on the output layer's logits, for its time
    (`TORCH_CE_BYTES_PER_LOGIT`) and its memory (`torch_ce_held_bytes_per_logit`): compiled, under
    `loss_parallel` where TP splits the vocabulary (torchtitan's default and meshplan's executor),
    or eager."""
    if compiles_loss(config):
        return "compiled"
    return "loss_parallel" if is_split(layer, config.tp) else "eager"


def loss_bytes_per_logit(layer: LayerProfile, config: ParallelConfig) -> tuple[float, float]:
    """(forward, backward) bytes per logit of the engine's cross-entropy kernels."""
    if config.engine in CE_FUSION_ENGINES:
        return MEGATRON_CE_BYTES_PER_LOGIT[config.cross_entropy_fusion]
    return TORCH_CE_BYTES_PER_LOGIT[torch_ce_kind(layer, config)]


def num_logits(layer: LayerProfile, config: ParallelConfig, vocab_scale: float, profile_dtype: str) -> float:
    """Logits of one micro-batch on one rank: the output layer's output elements (in the profile's
    dtype), /tp where the vocabulary is split; `vocab_scale`: its TP padding (`tp_split.vocab_scale`),
    as the layer's FLOPs take it (`compute_time.compute_times_s`)."""
    tp = config.tp if is_split(layer, config.tp) else 1
    return layer.output_bytes / DTYPE_BYTES.get(profile_dtype, 2) * config.rank_microbatch * vocab_scale / tp


def logits_saved_bytes(layer: LayerProfile, config: ParallelConfig, act_scale: float, vocab_scale: float) -> float:
    """What the output layer saves inside its vocab-parallel region (the logits and what the profile's
    loss keeps of them): the bytes whose traffic `loss_times_s` counts instead."""
    return sharded_bytes(layer, config, act_scale * vocab_scale)


def loss_times_s(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile, vocab_scale: float,
                 profile_dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of the engine's cross-entropy kernels on one micro-batch."""
    fwd_bytes, bwd_bytes = loss_bytes_per_logit(layer, config)
    logits = num_logits(layer, config, vocab_scale, profile_dtype)
    return memory_time_s(fwd_bytes * logits, cluster), memory_time_s(bwd_bytes * logits, cluster)
