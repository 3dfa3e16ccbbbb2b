"""Attention kernels by name: what `--attention` accepts and whether a kernel is fused.

Fused kernels (every name but `math`) keep no s x s scores for backward and skip the masked half
of causal attention; `math` is torch's unfused path (batched GEMMs, scores saved). Each fused
kernel's speed by sequence length, head dimension and device is in
`planner.costing.attention_kernels`. `flash` is the name meshplan used before kernels were named
(torch SDPA's flash backend, FlashAttention-2): plans and commands that say it keep working.
"""
from __future__ import annotations

from meshplan.planner.contracts.errors import MeshplanError

ATTENTION_KERNELS = {
    "flash2": "FlashAttention-2 (flash-attn 2.x CUDA kernels)",
    "flash3": "FlashAttention-3 (Hopper only: warp-specialised wgmma/TMA kernels)",
    "cudnn": "cuDNN fused attention (Transformer Engine's default on Hopper)",
    "sdpa-flash": "torch scaled_dot_product_attention, flash backend (FlashAttention-2 inside torch)",
    "sdpa-mem-efficient": "torch scaled_dot_product_attention, memory-efficient backend (xformers' cutlass kernel)",
    "triton-alibi": ("llm-foundry's Triton flash attention, which takes an ALiBi bias (flash_attn_triton, "
                     "FlashAttention-1's algorithm)"),
    "math": "unfused attention: batched GEMMs and a softmax, the s x s scores kept for backward",
}
ATTENTION_ALIASES = {"flash": "sdpa-flash"}
ATTENTION_CHOICES = tuple(ATTENTION_KERNELS) + tuple(ATTENTION_ALIASES)


def canonical_attention(name: str) -> str:
    """The kernel an accepted name stands for (`flash` -> `sdpa-flash`)."""
    return ATTENTION_ALIASES.get(name, name)


def is_fused(name: str) -> bool:
    """Whether `name` is a fused (flash-style) kernel: no scores saved, causal half skipped."""
    return canonical_attention(name) in ATTENTION_KERNELS and canonical_attention(name) != "math"


def check_attention(name: str) -> None:
    """MeshplanError naming the accepted kernels unless `name` is one of them."""
    if name not in ATTENTION_CHOICES:
        raise MeshplanError(f"unknown attention kernel {name!r}; use one of {', '.join(ATTENTION_CHOICES)} "
                            f"(flash = sdpa-flash)")


def attention_help() -> str:
    """One line per kernel, for `--help`."""
    return "; ".join(f"{name}: {text}" for name, text in ATTENTION_KERNELS.items()) + "; flash: sdpa-flash"
