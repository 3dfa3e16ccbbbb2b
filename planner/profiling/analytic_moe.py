"""Mixture-of-experts layer graphs in closed form: what tracing `models/moe.py` measures, no torch.

`moe_analytic_graph(spec, cfg, seq, dtype, attention)` returns the `ModelGraph` that the profiler
assembles from tracing `MoECausalLM` on the meta device (`registry.build_for_profile`: one dense
and one MoE block, expanded to the full layout), field by field: the same integers, derived from
what the model code runs under the meta device's balanced routing and what autograd keeps for
it. Tests hold the two equal over a grid of shapes, dtypes, attention kinds, sequence lengths and
vocabulary paddings (`tests/planner/profiling/test_analytic_moe.py`).

The embedding, the head and the loss, the attention of every block and the dense SwiGLU blocks
of the first `dense_layers` are the zoo's Llama-style modules: their rules are
`planner.profiling.analytic`'s. What this module adds is the MoE block's `MoE` (router, dispatch,
routed experts, combine, shared experts) and the layout. Conventions are the tracer's
(`planner.profiling.tracing`): per sample at sequence length s, 2 FLOPs a multiply-add, matmuls
only; saved bytes are storages kept for backward, once per layer, parameters excluded, classified
by the TP roles `registry.zoo_tp_splits` gives the MoE block's modules.

Notation: h hidden, E experts, k top_k, f one routed expert's width, F the shared experts' summed
width, s tokens, r = s * k routed copies (balanced on meta: expert e gets the floor or ceiling of
r / E of them, and every sum below is over all r whatever the split), p the bytes of one element.
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.graph import LayerProfile, ModelGraph, ModelInfo
from meshplan.planner.models.config import TransformerConfig
from meshplan.planner.models.registry import moe_info, zoo_tp_splits
from meshplan.planner.profiling import analytic as dense
from meshplan.planner.profiling.analytic import ELEMENT_BYTES, FP32_BYTES, INDEX_BYTES

FAMILIES = ("moe",)  # the zoo family whose code (`planner.models.moe`) the rules below follow


def moe_analytic_graph(spec: str, cfg: TransformerConfig, seq: int, dtype: str = "bf16",
                       attention: str = "flash", tp: int = 1) -> ModelGraph:
    """The layer graph of the zoo MoE model `cfg` at sequence length `seq`, as tracing measures it.

    `tp` pads the vocabulary as `MoECausalLM(cfg, tp)` does (the profiler builds with tp = 1).
    """
    if cfg.family not in FAMILIES:
        raise ValueError(f"no MoE closed form for the {cfg.family!r} family (families: {', '.join(FAMILIES)})")
    cfg.check_seq(spec, seq)  # the same refusal as building the model
    elem_bytes = ELEMENT_BYTES[dtype]
    padded_vocab = cfg.padded_vocab(tp)
    splits = zoo_tp_splits(cfg, padded_vocab)
    embed = dense._embedding_layer(cfg, seq, elem_bytes, padded_vocab, splits["embedding"])
    blocks = _blocks(cfg, seq, elem_bytes, attention, splits)
    head = dense._head_layer(cfg, seq, elem_bytes, padded_vocab, splits["head"])
    info = ModelInfo(family=cfg.family, num_layers=cfg.num_layers, hidden=cfg.hidden, num_heads=cfg.num_heads,
                     num_kv_heads=cfg.kv_heads, ffn=cfg.ffn_dim, vocab=cfg.vocab, padded_vocab=padded_vocab,
                     tied_embeddings=cfg.tied_embeddings, max_positions=0, head_dim=cfg.head_dim, **moe_info(cfg))
    return ModelGraph(spec=spec, seq=seq, dtype=dtype, attention=attention, layers=(embed, *blocks, head),
                      info=info)


def _blocks(cfg: TransformerConfig, seq: int, elem_bytes: int, attention: str, splits) -> list[LayerProfile]:
    """Every block, laid out as `registry.build_for_profile` lays out its collapsed model.

    The collapsed model holds one dense block (`blocks.0`, when `dense_layers` > 0) and one MoE
    block after it (`blocks.1`, or `blocks.0` without dense blocks); every block of the full
    model is a copy of the one of its kind, and names it as `repeat_of` unless it has its name.
    (So with two or more dense blocks the MoE blocks repeat `blocks.1`, the name the MoE block
    has in the collapsed model, as the traced layout says; costs key layer types by that name
    and cost each type from its first layer, a MoE block.)
    """
    dense_kept = min(cfg.dense_layers, 1)
    moe_block = _moe_block_layer(cfg, seq, elem_bytes, attention, splits["moe_block"], f"blocks.{dense_kept}")
    dense_block = dense._block_layer(cfg, seq, elem_bytes, attention, splits["block"]) if dense_kept else None
    layers = []
    for index in range(cfg.num_layers):
        source, name = (dense_block if index < cfg.dense_layers else moe_block), f"blocks.{index}"
        layers.append(source if name == source.name else replace(source, name=name, repeat_of=source.name))
    return layers


# ---------------------------------------------------------------------------------------------
# MoE block: attention (the zoo's) + MoE


def _moe_params(cfg: TransformerConfig) -> tuple[int, int]:
    """(MoE parameters, of which routed experts'): the router Linear (h x E, no bias), the routed
    experts' stacked gate, up (E x h x f each) and down (E x f x h), the shared experts' SwiGLU
    (3 h F) and Qwen2-MoE's shared gate Linear (h x 1)."""
    hidden = cfg.hidden
    experts = 3 * cfg.num_experts * hidden * cfg.expert_ffn
    shared = 3 * hidden * cfg.shared_ffn_dim + (hidden if cfg.shared_expert_gate else 0)
    return hidden * cfg.num_experts + experts + shared, experts


def _moe_flops(cfg: TransformerConfig, seq: int) -> tuple[int, int, int]:
    """(forward, backward, routed experts' forward) FLOPs of `MoE`; every product's input and
    weight need gradients, so backward is twice forward throughout.

    Router: Linear(h -> E) on the s tokens (its softmax, gather and top-k renormalisation do no
    matmul). Routed experts: per expert, (count_e x h) @ (h x f) for gate and up and
    (count_e x f) @ (f x h) for down, r rows in all: the SwiGLU rule on r rows (an expert with no
    rows does no work). Shared experts: the SwiGLU rule of width F on the s tokens, plus the
    shared gate's Linear(h -> 1). Dispatch (index_select) and combine (index_add) do no matmul.
    """
    routed = seq * cfg.top_k
    expert_fwd, _ = dense._mlp_flops(cfg, routed, cfg.expert_ffn)
    shapes = [(cfg.hidden, cfg.num_experts)] + ([(cfg.hidden, 1)] if cfg.shared_expert_gate else [])
    fwd, _ = dense._linears_flops(seq, shapes)
    if cfg.num_shared_experts:
        fwd += dense._mlp_flops(cfg, seq, cfg.shared_ffn_dim)[0]
    fwd += expert_fwd
    return fwd, 2 * fwd, expert_fwd


def _routing_bytes(cfg: TransformerConfig, seq: int, elem_bytes: int) -> int:
    """Replicated bytes the router, dispatch and combine keep (outside every TP role's module).

    Router: the fp32 softmax (s x E, softmax keeps its output), the int64 expert index of each
    copy (s x k, which `gather` keeps), and the top-k renormalisation `weights / weights.sum()`,
    which keeps both operands: the gathered fp32 weights (s x k) and their sums (s).
    Dispatch: `index_select` keeps its int64 index `token_of_copy` (r). Combine: the weights
    reordered to the copies by another `index_select` (its int64 index `order`, r), then
    `expert_out * weight` keeps both operands (the experts' output, r x h, and the weights in the
    compute dtype, r), and `index_add` its source, the weighted output (r x h, `token_of_copy`
    already kept). The router Linear's input is the norm's output, counted with the norm.
    """
    routed, hidden = seq * cfg.top_k, cfg.hidden
    router = FP32_BYTES * seq * cfg.num_experts + INDEX_BYTES * routed + FP32_BYTES * (routed + seq)
    dispatch = INDEX_BYTES * routed
    combine = INDEX_BYTES * routed + elem_bytes * routed * (2 * hidden + 1)
    return router + dispatch + combine


def _moe_saved_bytes(cfg: TransformerConfig, seq: int, elem_bytes: int) -> tuple[int, int, int]:
    """(TP-sharded, replicated, saved inside the routed experts) bytes `MoE` keeps.

    Routed experts (`moe.experts`, a TP region: gate/up column, down row): the gate and up
    products keep their input, the dispatched copies (r x h, replicated as a column Linear's
    input; one storage, split into per-expert views); the fused SwiGLU its two inputs and the
    down products theirs (r x f each, sharded). All four are saved inside the experts.
    Shared experts (`moe.shared`): their fused SwiGLU's two inputs and the down Linear's input
    (s x F each, sharded; the column Linears' input is the norm's output); the shared gate keeps
    its sigmoid's output (s) and the shared output it multiplies (s x h), replicated.
    """
    routed, hidden = seq * cfg.top_k, cfg.hidden
    dispatched = elem_bytes * routed * hidden
    expert_sharded = 3 * elem_bytes * routed * cfg.expert_ffn
    sharded = expert_sharded + 3 * elem_bytes * seq * cfg.shared_ffn_dim
    replicated = dispatched + _routing_bytes(cfg, seq, elem_bytes)
    if cfg.shared_expert_gate:
        replicated += elem_bytes * seq * (1 + hidden)
    return sharded, replicated, dispatched + expert_sharded


def _moe_block_layer(cfg: TransformerConfig, seq: int, elem_bytes: int, attention: str, split,
                     name: str) -> LayerProfile:
    """A MoE block: two RMSNorms (each keeps its input, an fp32 rstd and, once, its output as
    the input of what follows: q, k, v; router and shared experts), the zoo's attention, `MoE`."""
    attention_fwd, attention_bwd, causal_saving = dense._attention_flops(cfg, seq)
    moe_fwd, moe_bwd, expert_fwd = _moe_flops(cfg, seq)
    attention_sharded, scores = dense._attention_saved_bytes(cfg, seq, elem_bytes, attention)
    moe_sharded, moe_replicated, expert_act = _moe_saved_bytes(cfg, seq, elem_bytes)
    moe_params, expert_params = _moe_params(cfg)
    num_params = 2 * dense._norm_params(cfg) + dense._attention_params(cfg) + moe_params
    fwd = attention_fwd + moe_fwd
    hidden_bytes = elem_bytes * seq * cfg.hidden  # the residual stream in and out
    return LayerProfile(
        name=name, kind="block", fwd_flops=fwd, bwd_flops=attention_bwd + moe_bwd, num_params=num_params,
        param_bytes=num_params * elem_bytes, act_tp_sharded_bytes=attention_sharded + moe_sharded,
        act_tp_replicated_bytes=dense._block_replicated_bytes(cfg, seq, elem_bytes) + moe_replicated,
        act_attn_score_bytes=scores, input_bytes=hidden_bytes, output_bytes=hidden_bytes, tp_split=split,
        causal_fwd_flops=fwd - causal_saving, expert_params=expert_params,
        active_expert_params=expert_params * cfg.top_k // cfg.num_experts, expert_fwd_flops=expert_fwd,
        expert_bwd_flops=2 * expert_fwd, expert_act_bytes=expert_act,
        dispatch_bytes=elem_bytes * seq * cfg.top_k * cfg.hidden, attn_fwd_flops=dense._attention_core_flops(cfg, seq),
        act_rebuilt_bytes=dense._block_rebuilt_bytes(cfg, seq, elem_bytes))
