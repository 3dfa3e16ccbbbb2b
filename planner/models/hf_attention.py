"""Attention of Hugging Face models: which implementation transformers runs, the mask meshplan
passes, and what the profile notes of it (`planner.models.hf`).

transformers runs SDPA where the model class supports it. Where it does not (GPT-OSS's per-head
sinks, Gemma-2's logit soft-capping) it runs eager attention, which meshplan's executor trains
with; a profile on the meta device traces such a model through `FUSED_PROFILE_ATTENTION`
instead, the fused kernel the engines run."""
from __future__ import annotations


def attention_implementation(model_class, device: str = "cpu") -> str:
    """SDPA where transformers supports it for the architecture; where it does not, on the meta
    device (profiling) `FUSED_PROFILE_ATTENTION`, elsewhere (training) its eager attention."""
    if getattr(model_class, "_supports_sdpa", False):
        return "sdpa"
    if device == "meta":
        _register_fused_profile_attention()
        return FUSED_PROFILE_ATTENTION
    return "eager"


# The attention a profile traces for an architecture transformers runs only eagerly or through
# its own kernels (GPT-OSS: per-head attention sinks; Gemma-2: logit soft-capping): torch SDPA on
# the layer's mask, so the profiler costs it as the fused kernel the engines run (causal, each
# query's sliding window; no s x s scores kept), as it costs every SDPA layer. Eager attention
# would keep the fp32 scores of every head (3 GiB a GPT-OSS-120B layer at 4K tokens) and count
# both matmuls over all s x s entries. What SDPA leaves out costs no GEMM: a sink is one logit per
# head in the softmax's denominator (Transformer Engine's and FlashAttention-3's kernels take it as
# such), soft-capping a tanh per score inside the kernel.
FUSED_PROFILE_ATTENTION = "meshplan_profile_fused"  # no "sdpa" in it: transformers checks names for that


def _register_fused_profile_attention() -> None:
    """Name `_fused_profile_attention` to transformers (registering it again replaces it with itself)."""
    from transformers import AttentionInterface

    AttentionInterface.register(FUSED_PROFILE_ATTENTION, _fused_profile_attention)


def _fused_profile_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                             **_):
    """transformers' SDPA attention, the architecture's extra arguments (sinks, soft-cap) dropped."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal)


def profile_mask(seq: int, device):
    """The `attention_mask` meshplan passes: on the meta device a ready 4-D causal mask (transformers'
    own mask code cannot run there); on a real device none, so that transformers builds every
    layer type's mask itself (a sliding window where the layer has one) and SDPA runs the causal
    kernel where the mask is purely causal. The profiler costs the first as the second does
    (`planner.profiling.tracing`: causal attention unless a layer's window is shorter than the
    sequence)."""
    import torch

    if torch.device(device).type != "meta":
        return None
    return torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None]


def has_attention(model) -> bool:
    """Whether any module of the model is an attention module (by transformers' class names)."""
    return any("Attention" in type(module).__name__ for module in model.modules())


def fused_note(attn: str) -> tuple[str, ...]:
    """The profile note of an architecture profiled through `FUSED_PROFILE_ATTENTION`."""
    if attn != FUSED_PROFILE_ATTENTION:
        return ()
    return ("attention: transformers runs this architecture eagerly (sinks or soft-capping); profiled as the "
            "fused kernel the engines run (SDPA on the layer's mask: no s x s scores kept, each query's keys only)",)


def window_notes(attn: str, layers: list) -> tuple[str, ...]:
    """What the profile does with the layers' sliding windows: SDPA layers cost the keys each query
    sees (`tracing.seen_entries`); eager attention is plain matmuls, counted over every entry."""
    windows = sorted({value for layer in layers for module in layer.modules()
                      for value in (getattr(module, "sliding_window", None),)
                      if isinstance(value, int) and not isinstance(value, bool) and value > 0})
    if not windows:
        return ()
    sizes = ", ".join(f"{w:,}" for w in windows)
    if attn == "eager":
        return (f"sliding windows ({sizes} tokens) under eager attention: its matmuls are counted over all "
                "s x s entries, neither the causal half nor the window taken off",)
    return (f"sliding windows ({sizes} tokens): each query costs the min(position, window) keys it sees",)
