"""Peak live tensor memory of one training step on CPU, where there are no allocator statistics.

`torch.distributed._tools.mem_tracker.MemTracker` counts every tensor storage (parameters,
gradients, optimizer states, activations, temporaries, FSDP's resized all-gather buffers) as it
is created and freed. Only the global peak is used, so this subclass runs it without its module
tracker: torch's ModTracker puts gradient hooks on every module's inputs, closures over autograd
nodes that keep spent micro-batches' tensors (a pipeline stage's received input, say) alive
until Python's collector runs, which a run without the tracker does not do. Meta tensors (a released receive
buffer's placeholder) occupy nothing and are not counted.

MemTracker sees only tensors created inside its context and those of the modules and optimizers
given to `track_external`. A receive buffer a pipeline stage keeps from step to step would
escape both: c10d receives fill it (returning no tensor) and autograd consumes it. This tracker
therefore also counts, on entry, the receive buffers the pipeline stages that run the tracked
modules hold then. meshplan's stages hold none between steps
(`executor.parallel.pipeline.LeanBuffersStage`): they allocate each buffer when its receive is
posted, inside the tracked step.
"""
from __future__ import annotations

import gc
import sys

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker


class _NoModuleHooks(ModTracker):
    """A ModTracker that installs no module hooks: nothing here reads per-module statistics."""

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        return None


class StepMemTracker(MemTracker):
    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _NoModuleHooks()
        self._external_modules: list[torch.nn.Module] = []

    def track_external(self, *external) -> None:
        self._external_modules += [obj for obj in external if isinstance(obj, torch.nn.Module)]
        super().track_external(*external)

    def __enter__(self):
        if self._depth == 0:
            self.track_pipeline_buffers()
        return super().__enter__()

    def track_pipeline_buffers(self) -> None:
        """Count the receive buffers of every `PipelineStage` whose module is tracked (as "Other")."""
        stage_module = sys.modules.get("torch.distributed.pipelining.stage")
        if not self._external_modules or stage_module is None:  # no pipeline was ever built here
            return
        modules = {id(module) for module in self._external_modules}
        stages = [obj for obj in gc.get_objects()
                  if isinstance(obj, stage_module._PipelineStageBase) and id(getattr(obj, "submod", None)) in modules]
        for stage in stages:
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
                for info in infos:
                    buffer = getattr(info, "buffer", None)
                    if isinstance(buffer, torch.Tensor) and buffer.device.type != "meta":
                        self._track(_MemRefType.OTH, buffer)

    def peak_bytes(self) -> int:
        """Largest total of live tensor bytes seen, summed over devices (meta tensors occupy none)."""
        return int(sum(snapshot.get("Total", 0) for device, snapshot in self.get_tracker_snapshot("peak").items()
                       if torch.device(device).type != "meta"))
