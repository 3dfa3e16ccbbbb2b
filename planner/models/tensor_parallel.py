"""The Megatron-LM tensor-parallel layout of a zoo transformer block, defined once.

The executor applies it to every block it trains (`executor.parallel.tensor.apply_tp`) and
calibration times the same layout (`planner.calibration.microbench`), so the overhead that
calibrate measures is the overhead of the plans `train` runs. Column-parallel q/k/v (and gate/up),
row-parallel o/down; with sequence parallelism the residual stream is sharded along the sequence,
the norms run as `SequenceParallel` and attention/MLP inputs are all-gathered.

Sequence parallelism as Megatron-LM runs it: the column Linears of a region need the gathered
(b, s, h) input for their weight gradients, but keeping it would cost t times the shard that SP
exists to keep. `GatherKeepShard` gathers the input, lets the Linears save only a reference to
the shard (saved-tensor hooks), and gathers it again, once per region, when the backward first
needs it: one extra all-gather per region in backward for (t-1)/t of the region's input memory.
"""
from __future__ import annotations

from meshplan.planner.models.saved_reference import SavedOutside, SavedReference


def block_tp_plan(block, sp: bool, keep_shard: bool = True) -> dict:
    """`parallelize_module` plan (module path -> ParallelStyle) of one `transformer.Block`.

    `keep_shard` (with `sp`): the regions save the sequence shard and re-gather it in backward
    (`GatherKeepShard`); off for blocks under full recomputation, which keeps nothing across the
    forward anyway.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    row_output = Shard(1) if sp else Replicate()
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=row_output)}
    # a MoE block splits its shared experts as an MLP (its routed experts: `executor.parallel.expert`)
    mlp_name = "mlp" if hasattr(block, "mlp") else "moe.shared" if getattr(block.moe, "shared", None) else None
    if mlp_name:
        plan.update({f"{mlp_name}.up": ColwiseParallel(), f"{mlp_name}.down": RowwiseParallel(output_layouts=row_output)})
        if getattr(block.get_submodule(mlp_name), "swiglu", False):
            plan[f"{mlp_name}.gate"] = ColwiseParallel()
    if sp:
        gather = (gather_keep_shard_style() if keep_shard
                  else PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)))
        plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(), "attn": gather, "mlp": gather})
    return plan


class _Region(SavedReference):
    """One forward of one column-parallel region: the gathered input (`full`) is saved as a
    reference and re-gathered from its shard, once, when the region's backward first needs it."""

    def __init__(self, shard, full, mesh):
        super().__init__(full)
        # the shard is kept as backward would keep it: by reference where the norm before the
        # region rebuilds its output (`transformer.RMSNorm`), recomputed under checkpointing
        self.shard, self.mesh = SavedOutside(shard), mesh

    def make(self):
        """The gathered input, once per backward (`SavedReference` shares it between the Linears)."""
        import torch.distributed._functional_collectives as funcol

        # functional all-gather concatenates along dim 0: gather (s/t, b, h) slabs, then put
        # the sequence back in dim 1 in the forward's contiguous layout
        slabs = funcol.all_gather_single(self.shard.get().movedim(1, 0).contiguous(), 0, self.mesh)
        self.shard.release()
        return funcol.wait_tensor(slabs).movedim(0, 1).contiguous()


def gather_keep_shard_style():
    """A ParallelStyle: all-gather a region's sequence-sharded input; its Linears save the shard."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class GatherKeepShard(ParallelStyle):
        def _apply(self, module, device_mesh):
            def enter(mod, args):
                x = args[0]
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
                full = x.redistribute(device_mesh, (Replicate(),))
                region = _Region(x._local_tensor.detach(), full._local_tensor, device_mesh)
                hooks = region.saving()
                hooks.__enter__()
                mod._meshplan_saved_hooks = hooks
                return (full,) + tuple(args[1:])

            def leave(mod, args, output):
                mod._meshplan_saved_hooks.__exit__(None, None, None)
                del mod._meshplan_saved_hooks
                return output

            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)
            return module

    return GatherKeepShard()
