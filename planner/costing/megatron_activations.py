"""What Megatron-Core keeps for backward of one transformer block, term by term, per token of the
rank's micro-batch, and which of its recompute modules drops each term.

Notation as `engine_memory`'s (Korthikanti et al. 2022, section 4.1): b the compute dtype's bytes,
l the bytes of a Linear's kept input (1 under FP8: Transformer Engine keeps fp8 copies, else b),
h hidden, hq = heads x head_dim, hkv = kv_heads x head_dim, a heads, t the TP degree (sp_t = t
under sequence parallelism, else 1); per-token bytes of a tp group's micro-batch on one rank.

Modules (`megatron/core/transformer/transformer_layer.py`, `.../multi_latent_attention.py`,
`.../moe/experts.py`, Transformer Engine's spec):
- a norm keeps its input (the residual stream, b h /sp_t). Fused into the next Linear (TE
  `LayerNormLinear`: the attention's QKV, a dense MLP's fc1) it also keeps its output (l h /sp_t),
  which only that module's standard checkpoint (`mlp`) drops; a separate `TENorm` (MLA's
  input_layernorm, a MoE layer's pre_mlp_layernorm) keeps its output as the next Linears' input,
  which `layernorm` discards after forward and rebuilds in backward (output-discarding checkpoint).
- GQA attention: flash attention keeps Q, K, V (b(hq + 2hkv)/t), its output (b hq/t, also the
  projection's input; under FP8 the projection keeps an fp8 copy beside it) and the fp32
  log-sum-exp (4a/t). Unfused (`--attention math`): the score terms 5as (2as without dropout)
  /t, dropped by `core_attn`.
- multi-head latent attention (DeepSeek-V2/V3, `MLASelfAttention`): the latent down-projections
  are not TP-split; the up-projections are `LayerNormLinear`s keeping their latent input and
  normed latent ((b + l) x rank /sp_t, for the query's rank and the K/V's); the up-projections'
  outputs after RoPE, the attention's Q, K (a(nope + rope) each) and V (a v_head_dim), b each /t,
  are what `mla_up_proj` discards and rebuilds; the output and log-sum-exp as GQA's.
- dense MLP: fc1's output (b f, 2 b f gated: `bias_swiglu`) and fc2's input (l f), /t, dropped
  with the fused norm's output by `mlp` (a standard checkpoint keeping the MLP's input).
- MoE layer: the router's fp32 logits (4E /sp_t); each routed copy on the expert-TP group's
  ranks (etp of them all-gather the copies they received, or hold the same slice): fc1's input
  (l h, whole on each of the etp ranks), the fp32 routing prob the activation multiplies by
  (4, `activation_func_with_probs`), fc1's output (b 2f/etp, the SwiGLU's input) and fc2's
  input (l f/etp, the SwiGLU's output, which `moe_act` discards and rebuilds): a rank receives
  k/tp of the tp group's token copies (T k etp/tp with its expert-TP group), times the routing
  load factor F (`expert_parallel.load_factor`); the shared experts as a dense MLP of their summed
  width without the norm (`shared_experts`). `moe` checkpoints the whole MoE layer: only its
  input stays (the norm's output, itself dropped by `layernorm`).
GPT's dropout 0.1 adds two 1-byte masks (h /sp_t each).

Selective recomputation drops the terms of `ParallelConfig.selective_modules` (the attention core
alone unless `recompute_modules` names others); what it drops is rebuilt in backward one layer
at a time, beside the layer's backward: the transient working set. Full recomputation keeps the
block's input (b h /sp_t) and rebuilds everything. The time the named modules take again is
`module_recompute`'s, from these terms and the modules' GEMMs.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing.device_time import DTYPE_BYTES
from meshplan.planner.costing.expert_parallel import load_factor
from meshplan.planner.costing.fp8 import FP8_BYTES
from meshplan.planner.costing.precision import COMPUTE_DTYPE
from meshplan.planner.costing.tp_split import is_split

# GPT-3 (and Korthikanti's runs) train with dropout 0.1; Llama-style recipes with none.
DROPOUT_FAMILIES = ("gpt",)
ROUTING_PROB_BYTES = 4.0  # one fp32 routing prob per routed copy (the weighted SwiGLU's)


@dataclass(frozen=True)
class Term:
    """Bytes one saved tensor keeps per token on one rank, and the recompute modules that drop it."""

    name: str
    bytes_per_token: float
    dropped_by: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.bytes_per_token >= 0:
            raise ValueError(f"term {self.name!r} keeps {self.bytes_per_token} bytes per token; it must be >= 0")


def block_terms(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, attention: str,
                seq: float, with_routed: bool = True) -> tuple[Term, ...]:
    """The block's saved tensors per token on one rank under Megatron-Core (module docstring);
    `with_routed` False: without the routed experts' (`routed_expert_terms`). A hybrid's block
    holds what its `TPSplit` records: attention, a Mamba-2 mixer or neither, a dense MLP or not."""
    t = config.tp if is_split(layer, config.tp) else 1
    sp_t = t if config.sp else 1
    b = DTYPE_BYTES[COMPUTE_DTYPE[config.precision]]
    linear_in = FP8_BYTES if config.precision == "fp8" else b
    moe = bool(layer.expert_params)
    mixer = layer.tp_split.mixer
    terms: list[Term] = []
    if mixer == "mamba2":
        terms += mamba2_terms(info, b, linear_in, t, sp_t)
    elif mixer != "none":  # attention (another state-space mixer has no terms of its own: priced as attention)
        terms += _attention_terms(info, config, attention, seq, b, linear_in, t, sp_t)
    if not moe and layer.tp_split.mlp == "none":
        return tuple(terms)
    terms.append(Term("MLP dropout mask", (1.0 * info.hidden if info.family in DROPOUT_FAMILIES else 0.0) / sp_t))
    terms.append(Term("MLP norm input", b * info.hidden / sp_t))
    terms.append(Term("MLP norm output", linear_in * info.hidden / sp_t, ("layernorm",) if moe else ("mlp",)))
    gated = is_gated(layer, info)
    if not moe:
        return tuple(terms) + _mlp_terms("MLP", float(info.mlp_width), gated, b, linear_in, t, ("mlp",))
    shared = float(info.shared_experts_width)
    terms.append(Term("router logits (fp32)", 4.0 * info.num_experts / sp_t, ("moe",)))
    terms += _mlp_terms("shared experts", shared, gated, b, linear_in, t, ("shared_experts", "moe"))
    return tuple(terms) + (routed_expert_terms(layer, config, info) if with_routed else ())


def is_gated(layer: LayerProfile, info: ModelInfo) -> bool:
    """Whether the block's MLPs (and experts) are gated (`TPSplit.gated_mlp`)."""
    return layer.tp_split.gated_mlp(info.family)


def _attention_terms(info: ModelInfo, config: ParallelConfig, attention: str, seq: float, b: float,
                     linear_in: float, t: int, sp_t: int) -> list[Term]:
    h, heads = info.hidden, info.num_heads
    dropout = 1.0 * h if info.family in DROPOUT_FAMILIES else 0.0
    terms = [Term("attention norm input", b * h / sp_t), Term("attention dropout mask", dropout / sp_t)]
    terms += _mla_terms(info, b, linear_in, t, sp_t) if info.kv_lora_rank else _gqa_terms(info, b, linear_in, t, sp_t)
    fp8_copy = linear_in * heads * info.value_head_dim if config.precision == "fp8" else 0.0
    output = b * heads * info.value_head_dim + 4.0 * heads + fp8_copy
    terms.append(Term("attention output and log-sum-exp", output / t))
    if attention == "math":  # unfused softmax (and dropout): Korthikanti's 5as
        terms.append(Term("attention scores", heads * seq * ((2 * b + 1) if dropout else b) / t, ("core_attn",)))
    return terms


def mamba2_terms(info: ModelInfo, b: float, linear_in: float, t: int, sp_t: int) -> list[Term]:
    """Megatron-Core's Mamba-2 layer (`MambaMixer` on its memory-efficient path): the norm fused into
    `in_proj` (TE `LayerNormColumnParallelLinear`) keeps its input and output; mamba_ssm's
    `mamba_split_conv1d_scan_combined` keeps `in_proj`'s output [z | x | B | C | dt] and the scan's
    output before the gate, and rebuilds the conv and the chunk states in backward; the gated
    RMSNorm after it keeps its input and an fp32 rstd per group; `out_proj` keeps its input."""
    inner = info.mamba_heads * info.mamba_head_dim
    in_proj = 2 * inner + 2 * info.mamba_groups * info.mamba_state + info.mamba_heads
    return [Term("Mamba norm input", b * info.hidden / sp_t),
            Term("Mamba norm output", linear_in * info.hidden / sp_t),
            Term("in_proj output (z, x, B, C, dt)", b * in_proj / t),
            Term("scan output before the gate", b * inner / t),
            Term("gated norm input and rstd (fp32)", (b * inner + 4.0 * info.mamba_groups) / t),
            Term("out_proj input", linear_in * inner / t)]


def routed_expert_terms(layer: LayerProfile, config: ParallelConfig, info: ModelInfo) -> tuple[Term, ...]:
    """The routed experts' saved tensors per token of the tp group's micro-batch on the busiest rank."""
    b = DTYPE_BYTES[COMPUTE_DTYPE[config.precision]]
    linear_in = FP8_BYTES if config.precision == "fp8" else b
    etp, f, h = config.expert_tp, float(info.expert_ffn), info.hidden
    gated = is_gated(layer, info)
    copies = info.top_k * load_factor(info) / (config.tp if is_split(layer, config.tp) else 1)
    return (Term("routed experts' fc1 input", copies * etp * linear_in * h, ("moe",)),
            Term("routed experts' routing probs (fp32)", copies * etp * ROUTING_PROB_BYTES, ("moe",)),
            Term("routed experts' fc1 output", copies * b * f * (2 if gated else 1), ("moe",)),
            Term("routed experts' fc2 input", copies * linear_in * f, ("moe_act", "moe")))


def _gqa_terms(info: ModelInfo, b: float, linear_in: float, t: int, sp_t: int) -> list[Term]:
    head_dim = info.attention_head_dim
    hq, hkv = info.num_heads * head_dim, (info.num_kv_heads or info.num_heads) * head_dim
    return [Term("attention norm output", linear_in * info.hidden / sp_t),  # fused into the QKV Linear
            Term("Q, K, V", b * (hq + 2 * hkv) / t)]


def _mla_terms(info: ModelInfo, b: float, linear_in: float, t: int, sp_t: int) -> list[Term]:
    qk_head = info.attention_head_dim  # nope + rope
    terms = [Term("attention norm output", linear_in * info.hidden / sp_t, ("layernorm",))]
    if info.q_lora_rank:
        terms.append(Term("query latent and its norm", (b + linear_in) * info.q_lora_rank / sp_t))
    terms.append(Term("K/V latent and its norm", (b + linear_in) * info.kv_lora_rank / sp_t))
    terms.append(Term("up-projected Q, K, V", b * info.num_heads * (2 * qk_head + info.value_head_dim) / t,
                      ("mla_up_proj",)))
    return terms


def _mlp_terms(name: str, width: float, gated: bool, b: float, linear_in: float, t: int,
               dropped_by: tuple[str, ...]) -> tuple[Term, ...]:
    """fc1's output (the activation's input) and fc2's input of a dense MLP of `width`, /t."""
    if not width:
        return ()
    return (Term(f"{name}: fc1 output", b * width * (2 if gated else 1) / t, dropped_by),
            Term(f"{name}: fc2 input", linear_in * width / t, dropped_by))


def block_per_token(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, attention: str,
                    seq: float) -> tuple[float, float]:
    """(saved, working) bytes per token of one block under the config's recomputation."""
    terms = block_terms(layer, config, info, attention, seq)
    total = sum(term.bytes_per_token for term in terms)
    if config.recompute == "full":
        b = DTYPE_BYTES[COMPUTE_DTYPE[config.precision]]
        sp_t = config.tp if config.sp and is_split(layer, config.tp) else 1
        return b * info.hidden / sp_t, total
    if config.recompute == "selective":
        modules = set(config.selective_modules)
        dropped = sum(term.bytes_per_token for term in terms if modules.intersection(term.dropped_by))
        return total - dropped, dropped
    return total, 0.0
