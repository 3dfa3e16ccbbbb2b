"""The overlap rules: what of a layer's collectives stays exposed under the engine that runs it.

The engine's overlap is data (`contracts.overlap.EngineOverlap`, one per `--engine`); these are
the rules that read it. `layer_cost` applies them to every `LayerCost`, which the event simulator
and the ILP's tables both read, so the two price one engine's overlap alike. Context
parallelism's K/V exchange is priced by `costing.context_parallel` from the same record, and the
gradient reduction's timing by `costing.state_memory.grad_sync_mode`.
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.overlap import EngineOverlap, engine_overlap
from meshplan.planner.costing import fp8
from meshplan.planner.costing.device_time import memory_time_s


def overlap_of(config) -> EngineOverlap:
    """The `EngineOverlap` of the engine `config` runs under, with the configuration's own TP
    overlap where it sets one (`ParallelConfig.tp_comm_overlap`: Megatron-LM's --tp-comm-overlap,
    torchtitan's async TP), refused when it asks for an overlap meshplan cannot price (every
    engine's parameter gathers are prefetched and its pipeline transfers asynchronous: the
    simulator's only model of them)."""
    overlap = overlap_under(config, config.engine)
    if not (overlap.param_gather_prefetch and overlap.pp_p2p_async):
        raise ValueError(f"{overlap.engine}: meshplan prices parameter gathers as prefetched and pipeline "
                         "transfers as asynchronous only")
    return overlap


def overlap_under(config, engine: str) -> EngineOverlap:
    """`engine`'s `EngineOverlap` with `config`'s own TP overlap where it sets one: what a plan runs
    with under that engine (its export writes these flags)."""
    overlap = engine_overlap(engine)
    tp_overlap = getattr(config, "tp_comm_overlap", None)
    if tp_overlap is not None and tp_overlap != overlap.tp_comm_overlap:
        overlap = replace(overlap, tp_comm_overlap=tp_overlap)
    if getattr(config, "moe_a2a_overlap", False):  # priced by `expert_parallel.combined_1f1b_share`
        overlap = replace(overlap, ep_a2a_paired=True)
    return overlap


def exposed_tp_comm_s(comm_s: float, compute_s: float, layer_kind: str, config, unpipelined_s: float = 0.0) -> float:
    """What a pass's TP collectives (`comm_s`) add to the compute stream beside `compute_s`.

    Blocking engines expose all of it. A TP overlap (Megatron `--tp-comm-overlap`, torchtitan's
    async TP; it needs sequence parallelism and acts on a block's Linears) cuts each all-gather /
    reduce-scatter and its GEMM into tp pieces and sends piece i+1 while piece i multiplies: the
    first piece (1/tp of the collective) stays exposed, and so does whatever the pass's compute is
    too short to cover. `unpipelined_s` of `comm_s` the engine cannot pipeline
    (`unpipelined_tp_comm_s`) stays exposed whole. Under torch's micro-pipeline a block whose
    Linears' shapes are known is priced collective by collective instead (`fused_tp`).
    """
    tp = config.tp
    if comm_s <= 0 or tp < 2 or not config.sp or layer_kind != "block" or not overlap_of(config).tp_comm_overlap:
        return comm_s
    pipelined_s = comm_s - unpipelined_s
    return unpipelined_s + max(pipelined_s / tp, pipelined_s - compute_s)


def unpipelined_tp_comm_s(layer, config, parts) -> tuple[float, float]:
    """(forward, backward) seconds of a block's TP collectives, `parts` as
    `communication.tp_comm_parts_s` gives them, that the engine's TP overlap leaves blocking.

    Userbuffers pipeline all of them. torch's micro-pipeline (`TP_OVERLAP_PATTERNS`) fuses an
    all-gather only where matmuls consume the gathered tensor: not where fp8 Linears cast it after
    the gather (their cast sits between; torchtitan's Float8 TP casts before it,
    `fp8.fp8_tp_gather`), forward and backward alike. It fuses a backward reduce-scatter only where
    one matmul produces it: a region with several column Linears (q, k, v; up and gate) sums their
    input gradients first, and a recipe that rescales its gradient GEMMs' outputs
    (`Fp8Recipe.rescaled_gradient_gemms`) puts a multiply between. The forward's reduce-scatters,
    each a row Linear's product, fuse."""
    (fwd_gather, _), (bwd_gather, bwd_scatter) = parts
    split = layer.tp_split
    # the cheap tests first: this runs for every layer a cost table prices
    if split.kind != "block" or not split.num_allreduce_per_pass or not (fwd_gather or bwd_scatter) \
            or overlap_of(config).tp_overlap_pattern != "micro_pipeline":
        return 0.0, 0.0
    fp8_linears = fp8.is_fp8(config.precision) and fp8.converts(layer)
    cast_after_gather = fp8_linears and not fp8.fp8_tp_gather(layer, config)
    regions = split.num_allreduce_per_pass
    unfused_scatter = bwd_scatter * (1 - fused_scatter_regions(layer, config) / regions)
    if cast_after_gather:
        return fwd_gather, bwd_gather + unfused_scatter
    return 0.0, unfused_scatter


def fused_scatter_regions(layer, config) -> int:
    """How many of a block's regions torch's micro-pipeline fuses the backward reduce-scatter of:
    those with a single column Linear (at least 2 x regions less the column Linears, the columns
    spread as evenly as they go), none where a recipe rescales its gradient GEMMs' outputs."""
    split = layer.tp_split
    if fp8.is_fp8(config.precision) and fp8.converts(layer) and fp8.recipe_of(config).rescaled_gradient_gemms:
        return 0
    return max(0, 2 * split.num_allreduce_per_pass - len(split.column_linears))


def fused_tp_collectives(layer, config) -> tuple[bool, bool, bool] | None:
    """Under torch's micro-pipelined TP (`unpipelined_tp_comm_s`'s rules): whether it fuses the
    all-gathers before the column Linears' forward, those before the row Linears' input
    gradients, and the reduce-scatters after single-column regions' input gradients (the
    forward's reduce-scatters after the row Linears always fuse); None where it pipelines nothing."""
    split = layer.tp_split
    if split.kind != "block" or not split.num_allreduce_per_pass or config.tp < 2 or not config.sp:
        return None
    overlap = overlap_of(config)
    if not overlap.tp_comm_overlap or overlap.tp_overlap_pattern != "micro_pipeline":
        return None
    fp8_linears = fp8.is_fp8(config.precision) and fp8.converts(layer)
    gathers = not (fp8_linears and not fp8.fp8_tp_gather(layer, config))
    scatters = not (fp8_linears and fp8.recipe_of(config).rescaled_gradient_gemms)
    return gathers, gathers, scatters


def micro_pipeline_pieces(layer, config, shapes) -> tuple[tuple[int, int], ...] | None:
    """(forward, input-gradient) row chunks of each of a block's Linears `shapes` under torch's
    micro-pipelined TP: a GEMM fused with the collective that feeds or drains it runs as tp GEMMs
    of 1/tp of the rows, one per rank's shard (torch/distributed/_symmetric_memory:
    `_fused_all_gather_matmul_impl` consumes the gathered shards one at a time,
    `_fused_matmul_reduce_scatter_impl` produces one chunk per destination rank), each with its own
    tile and wave quantisation (`gemm.gemm_time_s`); None where nothing is fused."""
    fused = fused_tp_collectives(layer, config)
    if fused is None or not shapes:
        return None
    fwd_gather, bwd_gather, bwd_scatter = fused
    tp = config.tp
    single_mlp_column = sum(column for _, _, column in shapes[4:]) == 1
    pieces = []
    for index, (_, _, column) in enumerate(shapes):
        if column:
            dgrad = tp if bwd_scatter and index >= 4 and single_mlp_column else 1
            pieces.append((tp if fwd_gather else 1, dgrad))
        else:
            pieces.append((tp, tp if bwd_gather else 1))
    return tuple(pieces)


def micro_pipeline_reduce_s(layer, config, shapes, tokens: float, cluster) -> tuple[float, float]:
    """(forward, backward) seconds of the local sums after torch's fused matmul-reduce-scatters: it
    sends each rank its chunk of every partial product (an all-to-all) and sums the tp partials
    where they land (`_fused_matmul_reduce_scatter_impl`: reading tp chunks of 1/tp of the rows,
    writing one), a memory pass NCCL's reduce-scatter does inside the collective. Forward: the row
    Linears' outputs; backward: the input gradients of single-column regions
    (`micro_pipeline_pieces`)."""
    pieces = micro_pipeline_pieces(layer, config, shapes)
    if pieces is None:
        return 0.0, 0.0
    tp, value_bytes = config.tp, 2.0  # the GEMMs' bf16 outputs
    per_value = value_bytes * (1 + 1 / tp)
    fwd = sum(tokens * out_dim for _, out_dim, column in shapes if not column)
    bwd = sum(tokens * in_dim for (in_dim, _, column), (_, dgrad) in zip(shapes, pieces) if column and dgrad > 1)
    return memory_time_s(fwd * per_value, cluster), memory_time_s(bwd * per_value, cluster)


def ep_a2a_hidden_share(config) -> float:
    """The share of the expert-parallel dispatch and combine all-to-alls the engine hides behind
    other compute (`EngineOverlap.ep_a2a_hidden_fraction`), which `expert_parallel.ep_comm_s`
    takes as `a2a_overlap`. The one place the engine's recorded EP overlap enters the cost model;
    a configuration's combined 1F1B (`moe_a2a_overlap`) is derived per block instead
    (`expert_parallel.combined_1f1b_share`, `costing.moe_overlap`)."""
    return overlap_of(config).ep_a2a_hidden_fraction


def grad_reduce_overlaps(config, zero: int) -> bool:
    """Whether the engine reduces gradients during the backward at the executed ZeRO stage."""
    return overlap_of(config).grad_reduce_overlaps(zero)


def exposed_ring_s(transfer_s: float, step_compute_s: float, num_steps: int) -> float:
    """A ring of `num_steps` transfers, each sent while a step of `step_compute_s` computes: each
    exposes only what it takes beyond that step."""
    return num_steps * max(0.0, transfer_s - step_compute_s)


def pipelined_grad_reduce_blocks(config) -> bool:
    """Whether a pipelined rank's ZeRO-0/1 gradient reduction waits for each chunk's last backward
    and blocks the rank (`EngineOverlap.pp_grad_reduce` "after_chunk": torch pipelining), rather
    than running in buckets during that backward (Megatron's --overlap-grad-reduce)."""
    return overlap_of(config).pp_grad_reduce == "after_chunk"


def gathers_in_a_forward(config) -> bool:
    """Whether ZeRO-1/2 parameters are all-gathered once per step, unit by unit during a step's
    first forward (`EngineOverlap.param_gather` "next_forward": Megatron's distributed optimizer
    with --overlap-param-gather; "first_forward": meshplan's executor, FSDP2 kept gathered across
    micro-batches), rather than as FSDP2 reshards them after every backward."""
    return config.zero in (1, 2) and overlap_of(config).param_gather in ("first_forward", "next_forward")


def exposed_step_gather_s(gather_s: float, fwd_busy_s: float, config) -> float:
    """What a layer's once-per-step parameter all-gather (`gather_s`) adds to the step.

    FSDP-style engines that reshard after every backward gather it, under pipelining, with
    nothing to hide behind: all of it. Megatron's distributed optimizer with
    --overlap-param-gather issues bucket i+1's all-gather when bucket i's layers start their
    forward (a forward pre-hook waits on bucket i and dispatches the next), and meshplan's
    executor (FSDP2 kept gathered across micro-batches) prefetches unit i+1's gather while unit i
    computes, so in the step's first forward each layer's gather runs while the layer before it
    computes. It is priced against the layer's own forward (`fwd_busy_s`: one micro-batch's
    compute and blocking collectives; a chunk's repeated blocks are alike): it exposes only what
    it takes beyond one forward.
    """
    if gather_s <= 0 or not gathers_in_a_forward(config):
        return gather_s
    return max(0.0, gather_s - fwd_busy_s)
