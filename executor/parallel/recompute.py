"""Activation recomputation of one layer with `torch.utils.checkpoint` (full or selective)."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from meshplan.planner.contracts.errors import MeshplanError


def _attention_core_policy(ctx, op, *args, **kwargs):
    """Selective recomputation (Megatron-LM): recompute only the attention core, keep the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _attention_ops():
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE



def _attention_ops() -> set:
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_attention_math")
    return {getattr(aten, name).default for name in names if hasattr(aten, name)}



def apply_recompute(module: nn.Module, mode: str) -> None:
    """Activation checkpointing of one layer: "full" recomputes its whole forward in backward,
    "selective" only the attention core. The forward is replaced on the instance (no wrapper
    module), so parameter names and checkpoints do not change."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise MeshplanError(f"unknown recompute mode {mode!r}; use none, selective or full")
    # see transformer.Attention.merged_heads_by_reference and RMSNorm.output_by_reference
    for sub in module.modules():
        for flag in ("merged_heads_by_reference", "output_by_reference"):
            if hasattr(sub, flag):
                setattr(sub, flag, False)
    original = module.forward
    context_fn = (partial(create_selective_checkpoint_contexts, _attention_core_policy)
                  if mode == "selective" else None)

    def checkpointed_forward(*args, **kwargs):
        if context_fn is None:
            return checkpoint(original, *args, use_reentrant=False, **kwargs)
        return checkpoint(original, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = checkpointed_forward
