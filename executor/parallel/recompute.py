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


def apply_recompute(module: nn.Module, mode: str, early_stop: bool = True) -> None:
    """Activation checkpointing of one layer: "full" recomputes its whole forward in backward,
    "selective" only the attention core. The forward is replaced on the instance (no wrapper
    module), so parameter names and checkpoints do not change. `early_stop` (full only; the plan's
    `engine_rules.early_stop_of`): whether the recomputation stops once it has rebuilt every tensor
    the backward needs, torch's default, or reruns the whole forward as the cost model then prices."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

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
        # torch reads the setting when the forward runs, and the recomputation follows it
        with set_checkpoint_early_stop(early_stop):
            return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward
