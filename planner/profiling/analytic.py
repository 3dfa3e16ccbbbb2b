"""The zoo's layer graph in closed form: what tracing measures, from the shapes alone, no torch.

`analytic_graph(spec, cfg, seq, dtype, attention)` returns the `ModelGraph` that tracing the
`CausalLM` of `planner.models.transformer` (GPT and Llama families) on the meta device yields,
field by field: the same integers, derived from what the model code runs and what autograd keeps
for it. Tests hold the two equal over a grid of shapes, dtypes, attention kinds and vocabulary
paddings; a change to the zoo's code that changes what it saves fails them until this module
follows.

Conventions are the profiler's (`planner.profiling.tracing`): per sample (batch 1) at sequence
length s; a multiply-add is 2 FLOPs and only matrix products count (FlopCounterMode counts mm,
addmm, bmm and attention, no elementwise op); attention is counted in full at the q heads, and
`causal_fwd_flops` drops the s(s-1)/2 masked score entries a causal kernel skips; saved bytes are
the storages autograd keeps for backward, each once per layer, parameters excluded, classified
as the tracer does (inside the column->row region: TP-sharded; norms and the Linear inputs before
it: replicated; the s x s softmax of math attention: scores; the loss after the head's modules:
sharded, as its logits are vocab-parallel).

Notation below: h hidden, a heads, d the head width (h / a unless the config fixes it),
d_q = a * d (h for GPT and Llama), d_kv = kv_heads * d, f the MLP width, V the padded vocabulary,
p the bytes of one element of the profiled dtype. The block rules follow `transformer.Block` for
every config it builds, Llama-style options included (a fixed head width, q/k RMSNorms, q/k/v
biases, no RoPE when rope_theta is 0): `planner.profiling.analytic_moe` reuses them for the
attention of MoE blocks and for the dense blocks of the `moe` family.
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.attention import is_fused
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import LayerProfile, ModelGraph, ModelInfo
from meshplan.planner.models.config import TransformerConfig
from meshplan.planner.models.registry import zoo_tp_splits

FAMILIES = ("gpt", "llama")  # the zoo families whose code the rules below follow
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32_BYTES = 4  # norm statistics, log-sum-exp, math attention's upcast q/k/v and softmax, the loss
INDEX_BYTES = 8  # int64 token ids, positions and targets


def analytic_graph(spec: str, cfg: TransformerConfig, seq: int, dtype: str = "bf16",
                   attention: str = "flash", tp: int = 1) -> ModelGraph:
    """The layer graph of the zoo model `cfg` at sequence length `seq`, as tracing measures it.

    `tp` pads the vocabulary as `CausalLM(cfg, tp)` does (the profiler builds with tp = 1).
    """
    if cfg.family not in FAMILIES:
        raise ValueError(f"no closed form for the {cfg.family!r} family; trace it (families: {', '.join(FAMILIES)})")
    cfg.check_seq(spec, seq)  # the same refusal as building the model
    elem_bytes = ELEMENT_BYTES[dtype]
    padded_vocab = cfg.padded_vocab(tp)
    splits = zoo_tp_splits(cfg, padded_vocab)
    embed = _embedding_layer(cfg, seq, elem_bytes, padded_vocab, splits["embedding"])
    # Every block is the same module shape, so the same profile; later ones repeat the first.
    first_block = _block_layer(cfg, seq, elem_bytes, attention, splits["block"])
    blocks = [first_block] + [replace(first_block, name=f"blocks.{index}", repeat_of=first_block.name)
                              for index in range(1, cfg.num_layers)]
    head = _head_layer(cfg, seq, elem_bytes, padded_vocab, splits["head"])
    info = ModelInfo(family=cfg.family, num_layers=cfg.num_layers, hidden=cfg.hidden, num_heads=cfg.num_heads,
                     num_kv_heads=cfg.kv_heads, ffn=cfg.ffn_dim, vocab=cfg.vocab, padded_vocab=padded_vocab,
                     tied_embeddings=cfg.tied_embeddings,
                     max_positions=cfg.max_positions if cfg.family == "gpt" else 0, head_dim=cfg.head_dim)
    return ModelGraph(spec=spec, seq=seq, dtype=dtype, attention=attention, layers=(embed, *blocks, head),
                      info=info)


def _linear_flops(tokens: int, in_dim: int, out_dim: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of one Linear: one matmul forward; backward one for the input's
    gradient and one for the weight's (every Linear input needs a gradient: the embedding's
    output already does). Bias gradients are sums, which the counter does not count."""
    fwd = 2 * tokens * in_dim * out_dim
    return fwd, 2 * fwd


def _norm_stats_bytes(cfg: TransformerConfig) -> int:
    """Per token, what a norm keeps besides its input: LayerNorm an fp32 mean and rstd
    (native_layer_norm), the fused RMSNorm one fp32 rstd (`_FusedRMSNorm.forward`)."""
    return 2 * FP32_BYTES if cfg.family == "gpt" else FP32_BYTES


def _norm_saved_bytes(cfg: TransformerConfig, elem_bytes: int) -> int:
    """Per token, what one norm and the Linears after it keep outside the TP region: the norm's
    input and statistics, and for LayerNorm its output (the Linears' common input, one storage).
    The fused RMSNorm's output is kept as a reference and rebuilt in backward from its input
    (`transformer.normed_call`), so it adds nothing."""
    output = elem_bytes * cfg.hidden if cfg.family == "gpt" else 0
    return elem_bytes * cfg.hidden + _norm_stats_bytes(cfg) + output


def _norm_rebuilt_bytes(cfg: TransformerConfig, elem_bytes: int) -> int:
    """Per token and norm, the output rebuilt in backward rather than kept (`_norm_saved_bytes`)."""
    return 0 if cfg.family == "gpt" else elem_bytes * cfg.hidden


def _norm_params(cfg: TransformerConfig) -> int:
    """LayerNorm: weight and bias; RMSNorm: weight only."""
    return 2 * cfg.hidden if cfg.family == "gpt" else cfg.hidden


def _q_dim(cfg: TransformerConfig) -> int:
    """Width of the q Linear's output and the o Linear's input: heads * head_dim."""
    return cfg.num_heads * cfg.head_dim


def _kv_dim(cfg: TransformerConfig) -> int:
    return cfg.kv_heads * cfg.head_dim


def _has_rope(cfg: TransformerConfig) -> bool:
    """`Attention` rotates q and k unless it is GPT's or rope_theta is 0."""
    return cfg.family != "gpt" and bool(cfg.rope_theta)


# ---------------------------------------------------------------------------------------------
# Embedding


def _embedding_layer(cfg, seq: int, elem_bytes: int, padded_vocab: int, split) -> LayerProfile:
    """Token table (V x h) and, for GPT, learned positions (max_positions x h). An embedding
    lookup is no matmul (0 FLOPs both ways); its backward keeps only the int64 indices: the
    tokens, and GPT's position `arange`, a second storage."""
    num_params = padded_vocab * cfg.hidden
    index_tensors = 1
    if cfg.family == "gpt":
        num_params += cfg.max_positions * cfg.hidden
        index_tensors = 2
    return LayerProfile(
        name="embed", kind="embedding", fwd_flops=0, bwd_flops=0, num_params=num_params,
        param_bytes=num_params * elem_bytes, act_tp_sharded_bytes=0,
        act_tp_replicated_bytes=index_tensors * INDEX_BYTES * seq, act_attn_score_bytes=0,
        input_bytes=INDEX_BYTES * seq, output_bytes=elem_bytes * seq * cfg.hidden, tp_split=split)


# ---------------------------------------------------------------------------------------------
# Transformer block


def _attention_params(cfg: TransformerConfig) -> int:
    """q, k, v, o (k and v at kv heads); biases on q, k, v in GPT and with qkv_bias, on o in GPT;
    the q and k RMSNorms (one head_dim weight each) with qk_norm."""
    hidden, q_dim, kv_dim = cfg.hidden, _q_dim(cfg), _kv_dim(cfg)
    params = 2 * hidden * q_dim + 2 * hidden * kv_dim
    if cfg.family == "gpt" or cfg.qkv_bias:
        params += q_dim + 2 * kv_dim
    if cfg.family == "gpt":
        params += hidden
    return params + (2 * cfg.head_dim if cfg.qk_norm else 0)


def _block_params(cfg: TransformerConfig) -> int:
    """Two norms; attention; the MLP: GPT up and down with biases, otherwise gate, up and down
    without."""
    hidden, ffn = cfg.hidden, cfg.ffn_dim
    mlp = 2 * hidden * ffn + ffn + hidden if cfg.family == "gpt" else 3 * hidden * ffn
    return 2 * _norm_params(cfg) + _attention_params(cfg) + mlp


def _attention_core_flops(cfg: TransformerConfig, seq: int) -> int:
    """Forward FLOPs of QK^T and attn @ V, each 2 s^2 d per q head (the meta device runs the math
    path, which expands GQA's K and V to the q heads before its matmuls): 4 s^2 d_q."""
    return 4 * seq * seq * _q_dim(cfg)


def _attention_flops(cfg: TransformerConfig, seq: int) -> tuple[int, int, int]:
    """(forward, backward, causal saving) FLOPs of attention: q and o (h x d_q), k and v
    (h x d_kv), and the core, twice its forward in backward (both operands of both products need
    gradients). A causal kernel skips s(s-1)/2 of the s^2 entries of both products."""
    hidden, q_dim, kv_dim = cfg.hidden, _q_dim(cfg), _kv_dim(cfg)
    fwd, bwd = _linears_flops(seq, [(hidden, q_dim), (hidden, kv_dim), (hidden, kv_dim), (q_dim, hidden)])
    core = _attention_core_flops(cfg, seq)
    # The tracer's rounding: forward attention FLOPs * (s - 1) // (2 s).
    return fwd + core, bwd + 2 * core, core * (seq - 1) // (2 * seq)


def _linears_flops(tokens: int, shapes) -> tuple[int, int]:
    """(forward, backward) FLOPs of Linears of the given (in, out) shapes on `tokens` rows."""
    fwd = bwd = 0
    for in_dim, out_dim in shapes:
        linear_fwd, linear_bwd = _linear_flops(tokens, in_dim, out_dim)
        fwd, bwd = fwd + linear_fwd, bwd + linear_bwd
    return fwd, bwd


def _mlp_flops(cfg: TransformerConfig, tokens: int, width: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of an MLP of `width`: its column Linears (GPT up; gate and up
    otherwise, h x width each) and its down Linear (width x h)."""
    column = 1 if cfg.family == "gpt" else 2
    return _linears_flops(tokens, [(cfg.hidden, width)] * column + [(width, cfg.hidden)])


def _block_flops(cfg: TransformerConfig, seq: int) -> tuple[int, int, int]:
    """(forward, backward, causal saving) FLOPs of one block: attention and the MLP."""
    attention_fwd, attention_bwd, causal_saving = _attention_flops(cfg, seq)
    mlp_fwd, mlp_bwd = _mlp_flops(cfg, seq, cfg.ffn_dim)
    return attention_fwd + mlp_fwd, attention_bwd + mlp_bwd, causal_saving


def _block_replicated_bytes(cfg: TransformerConfig, seq: int, elem_bytes: int) -> int:
    """Outside the TP region, per norm (before attention, before the MLP): `_norm_saved_bytes`
    (the column Linears after it, q, k, v; up, and Llama's gate, share the norm's output)."""
    return 2 * seq * _norm_saved_bytes(cfg, elem_bytes)


def _block_rebuilt_bytes(cfg: TransformerConfig, seq: int, elem_bytes: int) -> int:
    """The two norms' outputs, where they are rebuilt in backward rather than kept."""
    return 2 * seq * _norm_rebuilt_bytes(cfg, elem_bytes)


def _attention_saved_bytes(cfg: TransformerConfig, seq: int, elem_bytes: int, attention: str) -> tuple[int, int]:
    """(TP-sharded, scores) bytes Attention keeps from its q/k norms to the o Linear's input.

    With qk_norm, the fused RMSNorms over each head of q and k keep their inputs (the q and k
    Linears' outputs, s x d_q and s x d_kv) and an fp32 rstd per head and position.
    RoPE (not GPT's, not with rope_theta 0) multiplies q and k by cos and sin tables of shape
    (s, d/2), cast once to the compute dtype and shared by q and k: p * s * d in all.
    flash: what a fused kernel keeps: q (s x d_q) and k, v at kv heads (s x d_kv each), as passed
    (GQA's K and V are not expanded), its output (s x d_q) and an fp32 log-sum-exp per head and
    position.
    math: torch's math path upcasts to fp32 and keeps the scaled q, the scaled K^T and V, each at
    the q heads (GQA expands K and V; in fp32 V is kept as passed, the same size), and the fp32
    softmax of shape (a, s, s), the score tensor both its backward and attn @ V use.
    The o Linear's input, `out.transpose(1, 2).reshape(...)`, is kept as a reference to the
    kernel's output (`transformer.Attention`: a view of it on CUDA flash kernels, a copy that is
    rebuilt in backward where the kernel returns heads-major output): nothing beyond the output
    a flash kernel keeps. Math attention does not keep its output, so the reference holds the
    copy's bytes (s x d_q), counted with the math terms.
    """
    heads, q_dim, kv_dim = cfg.num_heads, _q_dim(cfg), _kv_dim(cfg)
    sharded = elem_bytes * seq * cfg.head_dim if _has_rope(cfg) else 0
    if cfg.qk_norm:
        sharded += elem_bytes * seq * (q_dim + kv_dim) + FP32_BYTES * seq * (heads + cfg.kv_heads)
    if is_fused(attention):
        sharded += elem_bytes * seq * (2 * q_dim + 2 * kv_dim) + FP32_BYTES * heads * seq
        return sharded, 0
    sharded += 3 * FP32_BYTES * seq * q_dim + elem_bytes * seq * q_dim
    return sharded, FP32_BYTES * heads * seq * seq


def _mlp_saved_bytes(cfg: TransformerConfig, seq: int, elem_bytes: int) -> int:
    """TP-sharded bytes of the MLP after its column Linears: GPT's tanh GELU keeps its input (the
    up output) and the down Linear its output; the fused SwiGLU keeps its two inputs (gate and
    up outputs; silu is recomputed in backward) and the down Linear the product."""
    tensors = 2 if cfg.family == "gpt" else 3
    return tensors * elem_bytes * seq * cfg.ffn_dim


def _block_layer(cfg, seq: int, elem_bytes: int, attention: str, split) -> LayerProfile:
    """`blocks.0`: the block's FLOPs, parameters and saved bytes (rules in the functions above)."""
    fwd, bwd, causal_saving = _block_flops(cfg, seq)
    attention_sharded, scores = _attention_saved_bytes(cfg, seq, elem_bytes, attention)
    num_params = _block_params(cfg)
    hidden_bytes = elem_bytes * seq * cfg.hidden  # the residual stream in and out
    return LayerProfile(
        name="blocks.0", kind="block", fwd_flops=fwd, bwd_flops=bwd, num_params=num_params,
        param_bytes=num_params * elem_bytes,
        act_tp_sharded_bytes=attention_sharded + _mlp_saved_bytes(cfg, seq, elem_bytes),
        act_tp_replicated_bytes=_block_replicated_bytes(cfg, seq, elem_bytes), act_attn_score_bytes=scores,
        input_bytes=hidden_bytes, output_bytes=hidden_bytes, tp_split=split, causal_fwd_flops=fwd - causal_saving,
        attn_fwd_flops=_attention_core_flops(cfg, seq), act_rebuilt_bytes=_block_rebuilt_bytes(cfg, seq, elem_bytes))


# ---------------------------------------------------------------------------------------------
# Head and loss


def _head_layer(cfg, seq: int, elem_bytes: int, padded_vocab: int, split) -> LayerProfile:
    """Final norm, output Linear (h x V) and the loss, which runs after the head's modules.

    Replicated: the norm's input and statistics, and the output Linear's input (the norm's
    output) where it is kept (`_norm_saved_bytes`).
    Sharded (the loss on vocab-parallel logits): `lm_loss` upcasts the logits to fp32 (a no-op
    in fp32) and cross entropy keeps its fp32 log-softmax (s x V), the int64 targets and the
    loss's fp32 total weight (one scalar). A tied output weight is the embedding's: counted
    there, `shared_params` here.
    """
    fwd, bwd = _linear_flops(seq, cfg.hidden, padded_vocab)
    table = padded_vocab * cfg.hidden
    num_params = _norm_params(cfg) + (0 if cfg.tied_embeddings else table)
    replicated = seq * _norm_saved_bytes(cfg, elem_bytes)
    sharded = FP32_BYTES * seq * padded_vocab + INDEX_BYTES * seq + FP32_BYTES
    return LayerProfile(
        name="head", kind="head", fwd_flops=fwd, bwd_flops=bwd, num_params=num_params,
        param_bytes=num_params * elem_bytes, act_tp_sharded_bytes=sharded, act_tp_replicated_bytes=replicated,
        act_attn_score_bytes=0, input_bytes=elem_bytes * seq * cfg.hidden,
        output_bytes=elem_bytes * seq * padded_vocab, tp_split=split, causal_fwd_flops=fwd,
        act_rebuilt_bytes=seq * _norm_rebuilt_bytes(cfg, elem_bytes),
        shared_params=table if cfg.tied_embeddings else 0)
