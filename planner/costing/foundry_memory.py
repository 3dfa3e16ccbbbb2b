"""MosaicML llm-foundry's memory (engine "llm-foundry": Composer's trainer on its MPT-style models), per
rank, as `engine_memory` dispatches it.

What llm-foundry runs (`scripts/train/benchmarking/submit_benchmarks.py`, `llmfoundry/models/mpt/
modeling_mpt.py`, `llmfoundry/models/layers/attention.py`): PyTorch FSDP (v1) with
`mixed_precision: DEFAULT` (its benchmark tables' "MP Mode" column; Composer's `get_mixed_precision`:
bf16 parameters and buffers, gradients reduced in fp32), `limit_all_gathers: true`,
non-reentrant activation checkpointing of whole blocks, and no pipeline, context or expert
parallelism. Its loss is flash-attn's fused cross-entropy on the bf16 logits.

Model states (FSDP's flat parameters): fp32 sharded parameters, gradients and Adam moments,
16/d; a sharding strategy that keeps parameters gathered between forward and backward
(SHARD_GRAD_OP, ZeRO 1-2) also keeps the bf16 unsharded copy (+2); NO_SHARD (ZeRO 0) keeps the
fp32 parameters and their bf16 copy, fp32 gradients and moments (4 + 2 + 4 + 8). Transient: with
`limit_all_gathers` at most two units' bf16 parameters are gathered at once (the running unit and
the prefetched one), 2 x 2 bytes per parameter of the unit; in backward the unit's bf16 gradient
meets its fp32 copy, the reduce-scatter's input under DEFAULT's fp32 reduce_dtype, 2 + 4 (the
larger of the two, as torchtitan's FSDP2 rule in `engine_memory`).

Activations per token of a block (b = 2, h hidden, hq = heads x head_dim, f the MLP width, a
heads; TP, llm-foundry's `tp_config`, splits attention and MLP t ways, the norms stay whole):
each LayerNorm keeps its input and its output (the next Linear's input), 2 x 2bh; the fused
Wqkv's output holds Q, K and V, which the Triton / flash attention keeps as views of that one
storage, with its output (also out_proj's input, a view) and fp32 log-sum-exp: (b(hq + 2hkv) +
b hq + 4a)/t; the MLP keeps fc1's output and the activation's output (GELU: 2bf; SwiGLU: 4bf),
/t. Activation checkpointing of the block keeps its input (b h); of the attention module alone
(`activation_checkpointing_target`, priced as selective recomputation) drops the attention's
terms and rebuilds them in backward. The head keeps the final norm's input and output and, for
the fused cross-entropy, the bf16 logits (bV /t), whose bf16 gradient (bV /t) it writes in
backward.

FP8 (`precision: amp_fp8`, Composer's `te.fp8_autocast` over MPT's Transformer Engine Linears,
`fc_type: te`): a TE Linear under fp8 saves the fp8 cast of its input (or its fp8 transpose), one
byte an element, and not the bf16 input (Transformer Engine `transformer_engine/pytorch/module/
linear.py`, `_Linear.forward` at commit 3ec878759cc601d088dfa5c0a4772acf4317b190: `saved_inputmat =
inputmat` or `saved_inputmat_t = inputmat_t` under fp8, `inputmat_no_fp8` only without it). So a
norm's bf16 output, which only the next Linear kept, becomes that Linear's fp8 copy (h per norm);
out_proj keeps an fp8 copy of the attention output beside the bf16 one the attention kernel keeps
(+hq /t); the MLP's activation output, fc2's input, is kept in fp8 (f /t); fc1's output stays
bf16 (the activation's backward reads it). The head's Linear (the tied embedding, `F.linear`) is
not a TE module: bf16 as above.
"""
from __future__ import annotations

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing.device_time import DTYPE_BYTES
from meshplan.planner.costing.fp8 import FP8_BYTES
from meshplan.planner.costing.precision import COMPUTE_DTYPE
from meshplan.planner.costing.tp_split import is_split, vocab_scale

ENGINE = "llm-foundry"
# How many FSDP units' parameters `limit_all_gathers` lets be gathered at once.
GATHERED_UNITS = 2
# Bytes per element of the gradient reduce-scatter: DEFAULT's fp32 reduce_dtype.
REDUCE_BYTES = 4.0


def foundry_state_bytes(num_params: float, ranks: int, zero: int, precision: str) -> dict[str, float]:
    """params / grads / optimizer bytes of `num_params` on one rank, FSDP over `ranks` (docstring)."""
    wide = precision == "fp32"
    compute = 0.0 if wide else 2.0  # DEFAULT's bf16 copy; fp32 training computes on the fp32 parameters
    if zero == 0 or ranks == 1:
        return {"params": (4.0 + compute) * num_params, "grads": 4.0 * num_params, "optimizer": 8.0 * num_params}
    gathered = (4.0 if wide else 2.0) if zero <= 2 else 0.0
    return {"params": num_params * (4.0 / ranks + gathered), "grads": num_params * 4.0 / ranks,
            "optimizer": num_params * 8.0 / ranks}


def foundry_gather_bytes(layer: LayerProfile, config: ParallelConfig, params: float) -> float:
    """A unit's transient gathered parameters and gradient reduction (docstring), under ZeRO 3."""
    if config.zero < 3 or config.data_ranks == 1 or layer.kind not in ("block", "other"):
        return 0.0
    compute = 4.0 if config.precision == "fp32" else 2.0
    reduced = compute + (REDUCE_BYTES if compute < REDUCE_BYTES else 0.0)  # the gradient and its fp32 copy
    return max(GATHERED_UNITS * compute, reduced) * params


def foundry_per_token(layer: LayerProfile, config: ParallelConfig, info: ModelInfo) -> tuple[float, float]:
    """(saved, working) bytes per token of the layer on one rank (docstring)."""
    t = config.tp if is_split(layer, config.tp) else 1
    b = DTYPE_BYTES[COMPUTE_DTYPE[config.precision]]
    h = info.hidden
    if layer.kind == "embedding":
        return 0.0, 0.0
    if layer.kind == "head":
        vocab = (info.padded_vocab or info.vocab) * vocab_scale(layer, config.tp, info) / t
        return 2 * b * h + b * vocab, b * vocab
    head_dim = info.attention_head_dim
    hq, hkv = info.num_heads * head_dim, (info.num_kv_heads or info.num_heads) * head_dim
    gated = info.family != "gpt"
    fp8 = config.precision == "fp8"
    linear_in = FP8_BYTES if fp8 else b  # a TE Linear's kept input (docstring)
    norms = 2 * (b + linear_in) * h
    out_proj_copy = FP8_BYTES * hq if fp8 else 0.0
    attention = (b * (hq + 2 * hkv) + b * hq + out_proj_copy + 4.0 * info.num_heads) / t
    mlp = ((3 if gated else 1) * b + linear_in) * float(info.mlp_width) / t
    if config.recompute == "full":
        return b * h, norms + attention + mlp
    if config.recompute == "selective":
        return norms + mlp, attention
    return norms + attention + mlp, 0.0
