"""A whole configuration from per-layer costs: the pipeline in closed form, the strategy every
layer of a uniform configuration runs under, and the balanced cut of layers into chunks."""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import MULTI_CHUNK_SCHEDULES
from meshplan.planner.costing.layer_cost import LayerCost, layer_cost
from meshplan.planner.costing.strategy import Strategy
from meshplan.planner.costing.state_memory import executed_zero


@dataclass(frozen=True)
class StageTimes:
    """One pipeline rank. Per micro-batch (all its chunks) unless marked per step."""

    compute_s: float  # forward + backward compute
    recompute_s: float
    tp_comm_s: float  # blocking TP collectives, forward and backward
    zero3_exposed_s: float  # ZeRO-3 gathers not hidden behind the previous layer's compute
    p2p_s: float  # boundary sends of this rank: activations forward, their gradients backward
    dp_exposed_s: float = 0.0  # per step: gradient reduction not hidden behind the last backward
    param_gather_s: float = 0.0  # per step: ZeRO-1/2 parameter all-gather after the optimizer
    optimizer_s: float = 0.0  # per step

    @property
    def per_microbatch_s(self) -> float:
        """Busy time of the compute stream (p2p runs on its own stream: see pipeline_closed_form)."""
        return self.compute_s + self.recompute_s + self.tp_comm_s + self.zero3_exposed_s

    @property
    def tail_s(self) -> float:
        return self.dp_exposed_s + self.param_gather_s + self.optimizer_s



@dataclass(frozen=True)
class StepEstimate:
    """The closed-form step: pipeline (fill, steady state, drain) then the per-step tail."""

    step_time_s: float
    pipeline_time_s: float
    bubble_s: float  # idle time of the busiest rank in fill and drain
    bubble_fraction: float  # bubble_s / step_time_s
    busiest_rank: int
    breakdown: dict[str, float]  # compute, recompute, tp_comm, pp_comm, dp_comm, bubble, optimizer



def pipeline_closed_form(stages: tuple[StageTimes, ...] | list[StageTimes], num_microbatches: int,
                         schedule: str = "1f1b", virtual_stages: int = 1) -> StepEstimate:
    """Step time of m micro-batches through p stages with per-micro-batch times T_i.

    GPipe and 1F1B: (m - 1) max_i T_i + sum_i T_i: the first micro-batch crosses every stage, then
    the slowest stage sets the pace. With balanced stages this is (m + p - 1) T, so the bubble is
    (p - 1) / (m + p - 1) of the pipeline. Interleaved 1F1B with v chunks per rank fills with
    chunks 1/v the size: (m - 1/v) max_i T_i + sum_i T_i / v, i.e. (m + (p - 1)/v) T balanced
    (Narayanan et al. 2021). Sends and receives are asynchronous: in the steady state they hide
    behind compute, but the fill and drain wait for them once per boundary (sum_i p2p_i / v).
    Then the slowest rank's tail (exposed DP communication, ZeRO parameter gathers, optimizer).
    The zero-bubble schedules fill with a smaller share of T (`fill_share`).
    """
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    per_mb = [stage.per_microbatch_s for stage in stages]
    slowest = max(per_mb)
    chunks = virtual_stages if schedule in MULTI_CHUNK_SCHEDULES else 1
    p2p_path_s = sum(stage.p2p_s for stage in stages) / chunks
    fill = fill_share(schedule, chunks)
    pipeline_s = (num_microbatches - fill) * slowest + sum(per_mb) * fill + p2p_path_s
    busiest = per_mb.index(slowest)
    tail_rank = max(range(len(stages)), key=lambda i: stages[i].tail_s)
    tail = stages[tail_rank]
    step_s = pipeline_s + tail.tail_s
    bubble_s = max(0.0, pipeline_s - p2p_path_s - num_microbatches * slowest)
    busy = stages[busiest]
    m = num_microbatches
    breakdown = {
        "compute": m * busy.compute_s, "recompute": m * busy.recompute_s,
        "tp_comm": m * busy.tp_comm_s, "pp_comm": p2p_path_s,
        "dp_comm": m * busy.zero3_exposed_s + tail.dp_exposed_s + tail.param_gather_s,
        "bubble": bubble_s, "optimizer": tail.optimizer_s,
    }
    return StepEstimate(step_time_s=step_s, pipeline_time_s=pipeline_s, bubble_s=bubble_s,
                        bubble_fraction=bubble_s / step_s if step_s > 0 else 0.0,
                        busiest_rank=busiest, breakdown=breakdown)



def fill_share(schedule: str, virtual_stages: int = 1) -> float:
    """f in pipeline = (m - f) max_i T_i + f sum_i T_i: the bubble of balanced stages is (p - 1) f T.

    1F1B and GPipe f = 1, interleaved 1F1B 1/v. The split-backward schedules, from their published
    analysis with F = I = W = T/3 (B = I + W, a Linear-dominated block): ZB1P's bubble is
    (p - 1)(F + I - W) (Qi et al. 2023), 1/v of it interleaved, so f = 1/(3v); ZB-V, one
    synchronous step, keeps only the fill of a half-size chunk, (p - 1) F/2 (its published 0 needs
    steps to overlap, which the gradient-norm all-reduce prevents), f = 1/6; DualPipeV's bubble
    is (p - 1)(F&B + B - 3W) in chunk times (DeepSeek-AI 2024), with torch running F&B as F + B,
    (p - 1) T/3, f = 1/3. tests/planner/simulation holds these against the event simulator.
    """
    if schedule == "interleaved":
        return 1.0 / virtual_stages
    if schedule == "zb-interleaved":
        return 1.0 / (3.0 * virtual_stages)
    return {"zbv": 1.0 / 6.0, "dualpipev": 1.0 / 3.0}.get(schedule, 1.0)


def strategy_for(config, recompute: str | None = None) -> Strategy:
    """The Strategy every layer of a uniform ParallelConfig runs under (at the ZeRO stage the
    executor runs: `state_memory.executed_zero`)."""
    zero = executed_zero(config.zero, config.dp * config.cp, config.pp, config.schedule)
    return Strategy(tp=config.tp, dp=config.dp, zero=zero, recompute=recompute or config.recompute,
                    sp=config.sp, microbatch_size=config.microbatch_size, precision=config.precision, pp=config.pp,
                    shard_group=config.shard_group, cp=config.cp, ep=getattr(config, "ep", 1))



def default_recompute(graph, config) -> tuple[str, ...]:
    """Recomputation applies to transformer blocks (and unknown layers), not embedding or head."""
    return tuple("none" if layer.kind in ("embedding", "head") else config.recompute for layer in graph.layers)



def balanced_layer_chunks(graph, cluster: ClusterProfile, config) -> tuple[int, ...]:
    """Chunk index per layer: pp * virtual_stages contiguous non-empty chunks, slowest minimal.

    A layer weighs its per-micro-batch time (compute, recomputation, TP collectives). The optimal
    bottleneck is found by bisection on a greedy feasibility test (a chunk closes when the next
    layer would exceed the bound); the result is exact to 1e-9 relative.
    """
    num_chunks = config.num_model_chunks
    if num_chunks > len(graph.layers):
        raise ValueError(f"{num_chunks} pipeline chunks (pp {config.pp} x virtual stages {config.virtual_stages}) "
                         f"need at least that many layers; the model has {len(graph.layers)}")
    recomputes = default_recompute(graph, config)
    weights = [_layer_time_s(layer_cost(layer, strategy_for(config, r), cluster, graph.info, profile_dtype=graph.dtype,
                                           attention=graph.attention))
               for layer, r in zip(graph.layers, recomputes)]
    low, high = max(weights), sum(weights)
    for _ in range(100):
        if high - low <= 1e-9 * high:
            break
        mid = (low + high) / 2
        if _greedy_chunks(weights, mid, num_chunks) is None:
            low = mid
        else:
            high = mid
    chunks = _greedy_chunks(weights, high, num_chunks)
    assert chunks is not None
    return chunks



def _layer_time_s(cost: LayerCost) -> float:
    return (cost.fwd_compute_s + cost.bwd_compute_s + cost.recompute_s + cost.tp_fwd_comm_s + cost.tp_bwd_comm_s
            + cost.cp_fwd_comm_s + cost.cp_bwd_comm_s + cost.ep_fwd_comm_s + cost.ep_bwd_comm_s)



def _greedy_chunks(weights: list[float], bound: float, num_chunks: int) -> tuple[int, ...] | None:
    """Pack layers left to right under `bound`; open a new chunk early when the layers left are
    just enough to give every later chunk one. None if some chunk must exceed `bound`."""
    chunks: list[int] = []
    chunk, load = 0, 0.0
    for index, weight in enumerate(weights):
        layers_left = len(weights) - index  # including this one
        later_chunks = num_chunks - 1 - chunk
        if index and later_chunks and (load + weight > bound or layers_left == later_chunks):
            chunk, load = chunk + 1, 0.0
        if load + weight > bound * (1 + 1e-12):
            return None
        chunks.append(chunk)
        load += weight
    return tuple(chunks) if chunk == num_chunks - 1 else None


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
    its tensors over in place. The same rule in the simulator, the closed form and the ILP."""
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
    if schedule not in MULTI_CHUNK_SCHEDULES:
        return out
    for c, size in enumerate(boundary_bytes):
        sender, receiver = rank_of_chunk(c), rank_of_chunk(c + 1)
        if sender != receiver:
            out[receiver] += done_of_chunk(c + 1) * size  # the gradient sent back
    return out
