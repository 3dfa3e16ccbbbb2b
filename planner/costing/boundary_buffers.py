"""The pipeline boundary tensors a rank holds besides its saved activations: receive buffers in
transit and a multi-chunk schedule's kept input-gradient sends. One rule for the simulator and
the ILP, both through `simulation.schedules.held_boundary_bytes`."""
from __future__ import annotations

from meshplan.planner.contracts.schedule import schedule_spec


def receive_buffer_bytes(rank_of_chunk, boundary_bytes, pp: int) -> list[float]:
    """Per pipeline rank: the receive buffers in transit at its peak. meshplan's stages allocate a
    receive buffer when its receive is posted and drop it after that micro-batch's backward
    (`executor.parallel.pipeline.LeanBuffersStage`; torch's own `PipelineStage` keeps m per
    boundary and direction for the whole run). A received input is meanwhile the saved input of
    an in-flight micro-batch, which its chunk's first layer counts among its activations; what
    is left is one buffer per boundary and direction, an input received before its forward runs
    or a gradient received for the backward that runs next (measured on CPU flat from 8 to 64
    micro-batches: tests/executor/test_memory_prediction.py). Each boundary c -> c + 1 between
    two ranks carries tensors of `boundary_bytes[c]`; a V's tip, two chunks on one rank, hands
    its tensors over in place. The same rule in the simulator and the ILP."""
    out = [0.0] * pp
    for c, size in enumerate(boundary_bytes):
        sender, receiver = rank_of_chunk(c), rank_of_chunk(c + 1)
        if sender != receiver:
            out[sender] += size
            out[receiver] += size
    return out


def kept_send_bytes(rank_of_chunk, boundary_bytes, done_of_chunk, pp: int, schedule: str) -> list[float]:
    """Per pipeline rank: the input gradients a multi-chunk schedule still holds at the rank's
    last forward. torch's `_PipelineScheduleRuntime` (interleaved, the zero-bubble schedules,
    DualPipeV) waits for its sends only when the step ends, and each send's work keeps its
    tensor (measured on CPU: tests/executor/test_memory_prediction.py, -19% at 32 micro-batches
    without this rule). Once a micro-batch's backward has run, the input gradient its chunk sent
    back stays: `done_of_chunk(c)` of them per chunk c that receives over a boundary
    (`simulation.schedules.backwards_before_last_forward`, the moment those counts are largest;
    the peak is the largest live set plus these, an upper bound tight when the steady state
    ends there). The outputs sent on are freed by the executor's stages once their gradient is
    back (`executor.parallel.pipeline.LeanBuffersStage`). `Schedule1F1B` and `ScheduleGPipe`
    wait for each send by the next one: none."""
    out = [0.0] * pp
    if not schedule_spec(schedule).multi_chunk:
        return out
    for c, size in enumerate(boundary_bytes):
        sender, receiver = rank_of_chunk(c), rank_of_chunk(c + 1)
        if sender != receiver:
            out[receiver] += done_of_chunk(c + 1) * size  # the gradient sent back
    return out
