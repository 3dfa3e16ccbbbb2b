"""Peak live tensor memory of one training step on CPU, where there are no allocator statistics.

`torch.distributed._tools.mem_tracker.MemTracker` counts every tensor storage (parameters,
gradients, optimizer states, activations, temporaries, FSDP's resized all-gather buffers) as it
is created and freed. It refuses a root module that runs forward twice in one tracked region,
which is exactly what gradient accumulation and pipeline schedules do (one forward per
micro-batch); this subclass forgets the root module's per-module statistics before each repeated
forward instead. Per-module breakdowns are not used, only the global peak, which is unaffected.

MemTracker sees only tensors created inside its context and those of the modules and optimizers
given to `track_external`. torch pipelining's receive buffers escape both: each `PipelineStage`
allocates one buffer per micro-batch for its input activation and one for its output's gradient
in the first step and keeps them; c10d receives fill them (returning no tensor) and autograd
consumes them, so MemTracker counted one only if some op happened to return a view of it, and
never before the step touched it, although all of them occupy memory the whole step (a GPU
allocator counts them). This tracker therefore also counts, on entry, the receive buffers of
the pipeline stages that run the tracked modules.
"""
from __future__ import annotations

import gc
import sys

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType


class StepMemTracker(MemTracker):
    def __init__(self) -> None:
        super().__init__()
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
                    if isinstance(buffer, torch.Tensor):
                        self._track(_MemRefType.OTH, buffer)

    def _pre_fw_hook(self, module, inputs):
        name = self._mod_tracker.get_known_fqn(module)
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            parents = set(self._mod_tracker.parents) - {name}
            if parents == {"Global"}:  # a root module again: the next micro-batch
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def peak_bytes(self) -> int:
        """Largest total of live tensor bytes seen, summed over devices."""
        return int(sum(snapshot.get("Total", 0) for snapshot in self.get_tracker_snapshot("peak").values()))
