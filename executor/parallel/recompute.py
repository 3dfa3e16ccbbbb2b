"""Activation recomputation of one layer with `torch.utils.checkpoint` (full or selective)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from meshplan.planner.contracts.errors import MeshplanError


class _CheckpointAttentionCore(TorchFunctionMode):
    """Selective recomputation (Korthikanti et al. 2022, Megatron-LM): every attention core the
    layer calls (`scaled_dot_product_attention`) runs under its own checkpoint, which keeps only
    the core's inputs (q, k, v and a mask, which autograd keeps for the core anyway) and recomputes
    its output and softmax statistics (math attention: the scores) in backward. Everything else
    in the layer saves exactly what it saves without recomputation, so selective never keeps more
    than none: no whole-layer checkpoint caching each op's output, and under sequence parallelism
    the regions keep their input's shard (`models.tensor_parallel.GatherKeepShard`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.utils.checkpoint import checkpoint

        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def apply_recompute(module: nn.Module, mode: str) -> None:
    """Activation checkpointing of one layer: "full" recomputes its whole forward in backward,
    "selective" only the attention core. The forward is replaced on the instance (no wrapper
    module), so parameter names and checkpoints do not change."""
    from torch.utils.checkpoint import checkpoint

    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise MeshplanError(f"unknown recompute mode {mode!r}; use none, selective or full")
    original = module.forward
    if mode == "selective":
        def core_checkpointed_forward(*args, **kwargs):
            with _CheckpointAttentionCore():
                return original(*args, **kwargs)

        module.forward = core_checkpointed_forward
        return
    # see transformer.Attention.merged_heads_by_reference and RMSNorm.output_by_reference: a
    # reference would keep a tensor of the recomputed forward alive across it
    for sub in module.modules():
        for flag in ("merged_heads_by_reference", "output_by_reference"):
            if hasattr(sub, flag):
                setattr(sub, flag, False)

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward
