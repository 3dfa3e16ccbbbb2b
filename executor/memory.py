"""Peak live tensor memory of one training step on CPU, where there are no allocator statistics.

`torch.distributed._tools.mem_tracker.MemTracker` counts every tensor storage (parameters,
gradients, optimizer states, activations, temporaries, FSDP's resized all-gather buffers) as it
is created and freed. Only the global peak is used, so this subclass runs it without its module
tracker: torch's ModTracker puts gradient hooks on every module's inputs, closures over autograd
nodes that keep spent micro-batches' tensors (a pipeline stage's received input, say) alive
until Python's collector runs, which a run without the tracker does not do. Meta tensors (a released receive
buffer's placeholder) occupy nothing and are not counted.

MemTracker sees only tensors created inside its context and those of the modules and optimizers
given to `track_external`. meshplan's pipeline stages keep no receive buffer from step to step
(`executor.parallel.pipeline.LeanBuffersStage`): they allocate each when its receive is posted,
inside the tracked step, so the tracker sees every one.
"""
from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker
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

    def peak_bytes(self) -> int:
        """Largest total of live tensor bytes seen, summed over devices (meta tensors occupy none)."""
        return int(sum(snapshot.get("Total", 0) for device, snapshot in self.get_tracker_snapshot("peak").items()
                       if torch.device(device).type != "meta"))
