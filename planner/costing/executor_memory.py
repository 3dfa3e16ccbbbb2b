"""What `meshplan train` allocates for one layer beyond the model states of
`planner.costing.state_memory` and the saved activations of `planner.costing.activation_memory`:
the loss's fp32 copies, FSDP2's gathered and reduce-scatter buffers. Each rule was measured on CPU (tests/executor/test_memory_prediction.py)."""
from __future__ import annotations

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing.device_time import DTYPE_BYTES
from meshplan.planner.costing.loss_kernels import torch_ce_held_bytes_per_logit, torch_ce_kind

REDUCE_SCATTER_INPUT_BYTES = 4.0  # FSDP2's reduce-scatter input per parameter (fp32 reduce dtype)


def executor_memory_extras(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, zero: int,
                           gathered_bytes: float, fsdp_root: bool, split: bool, vocab_scale: float,
                           profile_dtype: str, unit_params: float = 0.0,
                           compute_bytes: float = 2.0) -> tuple[float, float, float]:
    """(params, grads, transient buffer) bytes that `meshplan train` allocates beyond the model
    states of `state_memory` and the saved activations, per rank. Each was measured on CPU with
    `executor.memory.StepMemTracker` (tests/executor/test_memory_prediction.py):

    - the loss (head): its backward materialises fp32 tensors of the micro-batch's (local)
      logits at once: nll_loss's dense gradient and log_softmax's backward output; under TP,
      `loss_parallel`'s backward builds the one-hot mask, exp(log-probs) and their sum
      (`loss_kernels.torch_ce_held_bytes_per_logit` of `torch_ce_kind`, torchtitan's rule too). A
      transient of the backward's first step, while every activation of the micro-batch is live;
    - (a vocab-parallel embedding's gradient stays sharded, 1/t of the table, as Megatron-LM
      keeps it: `executor.parallel.tensor.vocab_parallel_lookup`; nothing to add);
    - FSDP2 (ZeRO 1-3, dp > 1) without pipelining: each unit's all-gather output stays alive
      until the next unit's all-gather (`comm_ctx.all_gather_state`, kept so the copy-in buffer
      is not reused early): one more unsharded copy of a unit's parameters, transient, during
      every micro-batch's forward (and ZeRO-3's backward). Under torch pipelining ZeRO-1/2
      units are gathered once per step, in the first micro-batch's forward, when few
      activations are live: measured, it never reaches the peak, so it is not added (ZeRO-3
      gathers in every micro-batch's forward: added);
    - ZeRO-3: the stage's root FSDP unit (embedding, head: everything outside the blocks) is
      not resharded after forward (FSDP2 keeps the root gathered for the backward that
      follows), so its unsharded copy is live through forward and backward, like parameters;
    - ZeRO-2/3 (a reduce-scatter after every micro-batch's backward): while a unit's backward
      runs, its unsharded gradient (compute dtype) is live next to the previous unit's fp32
      reduce-scatter input, which FSDP2 keeps until the next reduce-scatter is issued
      (`set_reduce_scatter_max_input_buffers`, one by default): `REDUCE_TRANSIENT` per
      parameter of the unit, during backward, when the forward's gathered copy is gone (the
      larger of the two is the layer's transient). Measured under pipelining, where a backward
      runs while other micro-batches' activations are live: +1.45 MiB per 2-block fp32 stage,
      as this rule says. Without pipelining a micro-batch's backward frees its activations as
      the transient comes, and the forward's end stays the peak: measured, charging it there
      over-predicts (dp2 ZeRO-2 +6.6%, an HF model under ZeRO-3 +20%), so it is not.
    """
    extra_params = extra_grads = extra_buffer = 0.0
    tp, dp, mbs = config.tp, config.data_ranks, config.rank_microbatch
    if layer.kind == "head" and layer.tp_split.kind == "vocab":
        logits = layer.output_bytes / DTYPE_BYTES.get(profile_dtype, 2) * mbs * vocab_scale / (tp if split else 1)
        extra_buffer += logits * torch_ce_held_bytes_per_logit(torch_ce_kind(layer, config), compute_bytes)[1]
    if dp > 1 and zero >= 1:
        # under pipelining a ZeRO-1/2 unit is gathered once per step, in the first micro-batch's
        # forward, far from the peak: not added; ZeRO-3 gathers in every micro-batch's forward
        if config.pp == 1 or zero == 3:
            extra_buffer += gathered_bytes
        if zero >= 2 and config.pp > 1:  # a backward beside other micro-batches' activations
            extra_buffer = max(extra_buffer, unit_params * (compute_bytes + REDUCE_SCATTER_INPUT_BYTES))
        if zero == 3 and fsdp_root:
            extra_params += gathered_bytes
    return extra_params, extra_grads, extra_buffer
