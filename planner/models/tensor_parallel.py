"""The Megatron-LM tensor-parallel layout of a zoo transformer block, defined once.

The executor applies it to every block it trains (`executor.parallel.tensor.apply_tp`) and
calibration times the same layout (`planner.calibration.microbench`), so the overhead that
calibrate measures is the overhead of the plans `train` runs. Column-parallel q/k/v (and gate/up),
row-parallel o/down; with sequence parallelism the residual stream is sharded along the sequence,
the norms run as `SequenceParallel` and attention/MLP inputs are all-gathered.
"""
from __future__ import annotations


def block_tp_plan(block, sp: bool) -> dict:
    """`parallelize_module` plan (module path -> ParallelStyle) of one `transformer.Block`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    row_output = Shard(1) if sp else Replicate()
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=row_output),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=row_output)}
    if getattr(block.mlp, "swiglu", False):
        plan["mlp.gate"] = ColwiseParallel()
    if sp:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(), "attn": gather, "mlp": gather})
    return plan
