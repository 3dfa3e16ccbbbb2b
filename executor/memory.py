"""Peak live tensor memory of one training step on CPU, where there are no allocator statistics.

`torch.distributed._tools.mem_tracker.MemTracker` counts every tensor storage (parameters,
gradients, optimizer states, activations, temporaries, FSDP's resized all-gather buffers) as it
is created and freed. It refuses a root module that runs forward twice in one tracked region,
which is exactly what gradient accumulation and pipeline schedules do (one forward per
micro-batch); this subclass forgets the root module's per-module statistics before each repeated
forward instead. Per-module breakdowns are not used, only the global peak, which is unaffected.
"""
from __future__ import annotations

from torch.distributed._tools.mem_tracker import MemTracker


class StepMemTracker(MemTracker):
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
