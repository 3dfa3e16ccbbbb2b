"""torch pipelining: stages and schedules, with receive buffers that live only while in use and
FSDP's gradient reduction where the plan prices it.

Receive buffers. torch's `PipelineStage` allocates, when the schedule starts, one receive buffer
per micro-batch for its input and one for its output's gradient, and keeps all of them for the
whole run: 2m boundary tensors per stage even though only the micro-batches in flight use theirs.
At m = 512 (the 1T GPT of Narayanan et al. 2021 on 64 stages) that is ~100 GiB per GPU.
meshplan's stages (`LeanBuffersStage`) allocate a buffer when its receive is posted and drop it
after that micro-batch's backward (a split backward's weight half keeps what it needs by
reference), as large-scale runs free their stages' inputs once nothing needs them. A received
input is then the saved input of an in-flight micro-batch and nothing more; what is left in
transit is the rule in `planner.costing.boundary_buffers.receive_buffer_bytes`. The last stage's loss of
each micro-batch is detached after its backward: the schedule keeps the losses until the step
ends, and the spent graph would keep that micro-batch's received input alive through it. The
multi-chunk schedules keep every send's work, and its tensor, until the step ends: the stages
free the storage of an output they sent on once its backward has run (its gradient came back,
so the next stage has it); the input gradients sent back stay
(`planner.costing.boundary_buffers.kept_send_bytes`).

ZeRO-2/3. torch's `PipelineStage.backward_maybe_with_nosync` turns gradient sync and resharding
off for every micro-batch's backward and reduces once, after the stage's last one
(`perform_reduce_grad`): right for ZeRO-0/1, but it makes ZeRO-2 hold the stage's whole fp32
gradient during the step and ZeRO-3 keep its gathered parameters too. `ShardedGradStage` gives
ZeRO-2/3 their own semantics under pipelining, as without it: each micro-batch's full backward
reduce-scatters its gradients into the sharded accumulator (FSDP2's post-backward hooks,
overlapped with the backward), ZeRO-3 also reshards after it; ZeRO-2 keeps the parameters
gathered from the first forward to the step's end. `perform_reduce_grad` then finds nothing left
to reduce (FSDP2's post-backward is idempotent) and reshards. Schedules that split the backward
(zero-bubble) run the input-gradient half first, before any weight gradient exists, so there the
reduction stays deferred and ZeRO-2/3 run as ZeRO-1 (`planner.costing.state_memory.executed_zero`,
which the planner and `executor.checks` read).
"""
from __future__ import annotations

from functools import lru_cache

from meshplan.planner.costing.state_memory import executed_zero


def _release(infos) -> None:
    """Swap each received tensor of a stage's receive infos for a meta placeholder of its shape:
    nothing allocated."""
    import torch

    for info in infos:
        if not info.is_root_arg and info.buffer is not None and info.buffer.device.type != "meta":
            info.buffer = torch.empty_like(info.buffer, device="meta")


def _allocate(infos, device) -> None:
    """Give each meta placeholder `_release` left its storage back, on `device`, before a receive."""
    import torch

    for info in infos:
        if not info.is_root_arg and info.buffer is not None and info.buffer.device.type == "meta":
            info.buffer = torch.empty_like(info.buffer, device=device)


@lru_cache(maxsize=None)
def _lean_stage_class():
    import torch
    from torch.distributed.pipelining import PipelineStage

    class LeanBuffersStage(PipelineStage):
        """A stage whose receive buffers exist from their receive to their micro-batch's backward."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._sent_outputs: dict[int, list] = {}  # micro-batch -> the outputs its forward sent on

        def _prepare_forward_infra(self, *args, **kwargs):
            meta = super()._prepare_forward_infra(*args, **kwargs)
            for infos in self.args_recv_info.values():
                _release(infos)
            return meta

        def _setup_backward_recv_info(self, num_microbatches: int):
            super()._setup_backward_recv_info(num_microbatches)
            for infos in self.grad_recv_info.values():
                _release(infos)

        def get_fwd_recv_ops(self, fwd_chunk_id: int):
            _allocate(self.args_recv_info[fwd_chunk_id], self.device)
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int):
            if self.has_backward and not self.is_last:
                _allocate(self.grad_recv_info[bwd_chunk_id], self.device)
            return super().get_bwd_recv_ops(bwd_chunk_id)

        def get_fwd_send_ops(self, fwd_chunk_id: int):
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            self._sent_outputs[fwd_chunk_id] = [op.tensor for op in ops]
            return ops

        def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, **kwargs):
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, **kwargs)
            # autograd, the send of the input's gradient and a split backward's pending weight
            # half hold what they still need by reference; the stage lets go of its own.
            _release(self.args_recv_info.get(bwd_chunk_id, ()))
            _release(self.grad_recv_info.get(bwd_chunk_id, ()))
            if not full_backward:  # a split backward: its weight half frees the rest
                return
            self._free_sent_output(bwd_chunk_id)
            if isinstance(loss, torch.Tensor) and not loss._is_view():
                # The schedule keeps every micro-batch's loss until the step ends, and with it
                # the spent graph, whose leaf is this micro-batch's received input (and its
                # gradient): detached, only the value is kept.
                loss.detach_()

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            self._free_sent_output(bwd_chunk_id)

        def _free_sent_output(self, chunk_id: int) -> None:
            """Free the storage of the output this micro-batch sent on. The multi-chunk schedules
            keep every send's work, and with it its tensor, until the step ends; but the gradient
            of this output came back, so the next stage has received it, and its backward has
            run, so nothing else reads it."""
            for tensor in self._sent_outputs.pop(chunk_id, ()):
                tensor.untyped_storage().resize_(0)

    return LeanBuffersStage


@lru_cache(maxsize=None)
def _sharded_grad_stage_class():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining._backward import stage_backward

    class ShardedGradStage(_lean_stage_class()):
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
    """One torch `PipelineStage` per chunk this rank holds: a `LeanBuffersStage`, a
    `ShardedGradStage` for ZeRO-2/3."""

    zero = executed_zero(cfg.zero, cfg.data_ranks, cfg.pp, cfg.schedule)
    common = dict(num_stages=cfg.num_model_chunks, device=device, group=group)
    if zero >= 2 and cfg.data_ranks > 1:
        stage_class = _sharded_grad_stage_class()
        return [stage_class(module, stage_index=chunk, reshard_after_backward=zero == 3, **common)
                for module, chunk in zip(modules, chunk_ids)]
    stage_class = _lean_stage_class()
    return [stage_class(module, stage_index=chunk, **common) for module, chunk in zip(modules, chunk_ids)]


def pipeline_schedule(cfg, mesh, modules, chunk_ids, device, loss_fn):
    """The torch schedule the plan names (its description's `torch_class`), over this rank's stages."""
    import torch.distributed.pipelining

    spec = cfg.schedule_spec
    schedule_class = getattr(torch.distributed.pipelining, spec.torch_class)

    stages = make_stages(cfg, modules, chunk_ids, device, mesh["pp"].get_group())

    def stage_loss(logits, targets):
        return loss_fn(logits, (targets,))

    if spec.multi_chunk:  # the V-shaped classes place chunks in a V themselves
        return schedule_class(stages, n_microbatches=cfg.num_microbatches, loss_fn=stage_loss)
    return schedule_class(stages[0], n_microbatches=cfg.num_microbatches, loss_fn=stage_loss)
