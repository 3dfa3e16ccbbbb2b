"""torch pipelining: stages and schedules, with FSDP's gradient reduction where the plan prices it.

torch's `PipelineStage.backward_maybe_with_nosync` turns gradient sync and resharding off for
every micro-batch's backward and reduces once, after the stage's last one (`perform_reduce_grad`):
right for ZeRO-0/1, but it makes ZeRO-2 hold the stage's whole fp32 gradient during the step and
ZeRO-3 keep its gathered parameters too. `ShardedGradStage` gives ZeRO-2/3 their own semantics
under pipelining, as without it: each micro-batch's full backward reduce-scatters its gradients
into the sharded accumulator (FSDP2's post-backward hooks, overlapped with the backward), ZeRO-3
also reshards after it; ZeRO-2 keeps the parameters gathered from the first forward to the step's
end. `perform_reduce_grad` then finds nothing left to reduce (FSDP2's post-backward is
idempotent) and reshards. Schedules that split the backward (zero-bubble) run the input-gradient
half first, before any weight gradient exists, so there the reduction stays deferred and ZeRO-2/3
run as ZeRO-1 (`planner.costing.state_memory.executed_zero`, which the planner and
`executor.checks` read).
"""
from __future__ import annotations

from meshplan.planner.contracts.config import MULTI_CHUNK_SCHEDULES
from meshplan.planner.costing.state_memory import executed_zero


def _sharded_grad_stage_class():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._backward import stage_backward

    class ShardedGradStage(PipelineStage):
        """A stage whose FSDP2 units reduce-scatter every micro-batch's gradients (ZeRO-2/3)."""

        def __init__(self, *args, reshard_after_backward: bool, **kwargs):
            super().__init__(*args, **kwargs)
            self._reshard_after_backward = reshard_after_backward

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
            if backward_type != "full" or not isinstance(self.submod, FSDPModule):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            module = self.submod
            module.set_requires_gradient_sync(True)
            module.set_reshard_after_backward(self._reshard_after_backward or last_backward)
            module.set_is_last_backward(last_backward)
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
            return grads, None

    return ShardedGradStage


def make_stages(cfg, modules, chunk_ids, device, group) -> list:
    """One torch `PipelineStage` per chunk this rank holds (a `ShardedGradStage` for ZeRO-2/3)."""
    from torch.distributed.pipelining import PipelineStage

    zero = executed_zero(cfg.zero, cfg.data_ranks, cfg.pp, cfg.schedule)
    common = dict(num_stages=cfg.num_model_chunks, device=device, group=group)
    if zero >= 2 and cfg.data_ranks > 1:
        stage_class = _sharded_grad_stage_class()
        return [stage_class(module, stage_index=chunk, reshard_after_backward=zero == 3, **common)
                for module, chunk in zip(modules, chunk_ids)]
    return [PipelineStage(module, stage_index=chunk, **common) for module, chunk in zip(modules, chunk_ids)]


def pipeline_schedule(cfg, mesh, modules, chunk_ids, device, loss_fn):
    """The torch schedule the plan names, over this rank's stages."""
    from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                                        ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                                        ScheduleZBVZeroBubble)

    stages = make_stages(cfg, modules, chunk_ids, device, mesh["pp"].get_group())

    def stage_loss(logits, targets):
        return loss_fn(logits, (targets,))

    multi_chunk = dict(zip(MULTI_CHUNK_SCHEDULES, (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                         ScheduleZBVZeroBubble, ScheduleDualPipeV)))
    if cfg.schedule in multi_chunk:  # the V-shaped classes place chunks in a V themselves
        return multi_chunk[cfg.schedule](stages, n_microbatches=cfg.num_microbatches, loss_fn=stage_loss)
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.schedule]
    return schedule_class(stages[0], n_microbatches=cfg.num_microbatches, loss_fn=stage_loss)
