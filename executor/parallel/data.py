"""Data parallelism per ZeRO stage: DDP, FSDP2 `replicate` or `fully_shard`; which one a plan gets
is `planner.costing.state_memory.dp_method` (the memory model prices the same choice)."""
from __future__ import annotations

from torch import nn

from meshplan.executor.parallel.stages import StageModule


def apply_dp(stage: StageModule, dp_mesh, zero: int, method: str, mp_policy=None,
             ignored_params: set | None = None) -> nn.Module:
    """Data parallelism of one chunk per ZeRO stage; returns the module to run.

    ZeRO-1: `fully_shard(reshard_after_forward=False)` with gradients reduce-scattered once, after
    the last micro-batch (full parameters and gradients during the step, optimizer state sharded);
    ZeRO-2: the same with a reduce-scatter per micro-batch (gradients sharded);
    ZeRO-3: `fully_shard(reshard_after_forward=True)` (parameters sharded between uses too).
    `ignored_params` (ZeRO-0): parameters DDP / replicate leave alone (the experts under expert
    parallelism, reduced over their own group); ZeRO 1-3 skip parameters an inner unit holds.
    """
    if method == "none":
        return stage
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if ignored_params:
            names = [name for name, param in stage.named_parameters() if param in ignored_params]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(stage, names)
        return DistributedDataParallel(stage, process_group=dp_mesh.get_group())
    kwargs = {"mesh": dp_mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if method == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        if ignored_params:
            kwargs["ignored_params"] = set(ignored_params)
        for block in stage.blocks.values():
            replicate(block, **kwargs)
        replicate(stage, **kwargs)
        return stage
    from torch.distributed.fsdp import fully_shard

    for block in stage.blocks.values():
        fully_shard(block, reshard_after_forward=zero == 3, **kwargs)
    fully_shard(stage, reshard_after_forward=zero == 3, **kwargs)
    return stage


def mixed_precision(precision: str):
    """bf16-mixed: FSDP2's policy (bf16 compute weights cast once per gather, bf16 activations
    and residual stream, fp32 gradient reduction, fp32 master weights); None for fp32.
    `state_memory.dp_method` wraps every bf16-mixed layout in `replicate` or `fully_shard`, so
    the policy always has a wrapper to act through."""
    import torch

    if precision != "bf16-mixed":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
