"""`estimate`: predict one hand-written parallel configuration (what `meshplan estimate` prints).

    estimate(spec, cluster, gpus, global_batch, seq, tp, pp, ...) -> Prediction

profiles the model (`planner.profiling.profiler.profile`), validates the configuration against the model
and the cluster, then asks the event-driven simulator (`planner.simulation.simulator.simulate_config`) for
the step; `closed_form_prediction` is the cost model's own closed form of the same step (the
planner's objective), used where the simulator is not available and tested against it.
"""
from __future__ import annotations

from meshplan.planner.contracts.config import MULTI_CHUNK_SCHEDULES, V_SHAPED_SCHEDULES, ParallelConfig
from meshplan.planner.costing import flops
from meshplan.planner.costing.fp8 import check_fp8_supported
from meshplan.planner.costing.layer_costs import COMPUTE_DTYPE, layer_cost, p2p_time_s, pass_gather_exposure_s
from meshplan.planner.costing.pipeline import (StageTimes, balanced_layer_chunks, default_recompute,
                                               pipeline_closed_form, strategy_for)
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.contracts.prediction import MemoryBreakdown, Prediction
from meshplan.planner.simulation.schedules import (SPLIT_BACKWARD_SCHEDULES, held_boundary_bytes, max_in_flight,
                                                   rank_actions)

DEFAULT_SEQ = 2048


def default_precision(cluster: ClusterProfile) -> str:
    """bf16-mixed where the device computes bf16 faster than fp32 (GPUs), else fp32 (CPUs)."""
    peaks = cluster.device.peak_flops_per_s
    return "bf16-mixed" if peaks.get("bf16", 0.0) > peaks.get("fp32", 0.0) else "fp32"


def make_config(graph, cluster: ClusterProfile, gpus: int, global_batch: int, tp: int = 1, pp: int = 1,
                mbs: int = 1, zero: int = 0, recompute: str = "none", sp: bool = False, schedule: str = "1f1b",
                vpp: int = 1, precision: str = "bf16-mixed", shard_group: int | None = None,
                cp: int = 1, ep: int = 1) -> ParallelConfig:
    """Validate a configuration against the model and the cluster; MeshplanError says why not."""
    check_mesh(cluster, gpus, tp, pp, cp)
    check_context_parallel(graph, cp)
    check_expert_parallel_request(graph, ep)
    check_tp_splits(graph, tp)
    if schedule in V_SHAPED_SCHEDULES and vpp == 1:
        vpp = 2  # a V always holds two chunks per rank: --vpp 2 is implied
    chunks = pp * (vpp if schedule in MULTI_CHUNK_SCHEDULES else 1)
    if chunks > len(graph.layers):
        raise MeshplanError(f"pp*vpp = {chunks} pipeline chunks need at least {chunks} layers; "
                            f"the model has {len(graph.layers)}")
    return parallel_config(gpus, global_batch, tp, pp, mbs, zero, recompute, sp, schedule, vpp, precision,
                           shard_group, cp, ep)


def check_tp_splits(graph, tp: int) -> None:
    """Every layer splits tp ways (`costing.executable.tp_split_problem`, the one rule)."""
    from meshplan.planner.costing.executable import model_facts, tp_split_problem

    problem = tp_split_problem(model_facts(graph), tp, f"--tp {tp}")
    if problem:
        raise MeshplanError(problem)


def check_expert_parallel_request(graph, ep: int) -> None:
    """EP needs a mixture of experts whose expert count ep divides (the mesh check is ParallelConfig's)."""
    from meshplan.planner.costing.expert_parallel import check_expert_parallel

    try:
        check_expert_parallel(graph.info, ep, ep)
    except ValueError as exc:
        raise MeshplanError(f"--ep {ep}: {exc}") from None


def check_context_parallel(graph, cp: int) -> None:
    """CP splits attention, every sequence in 2*cp chunks (`costing.executable.cp_split_problem`)."""
    from meshplan.planner.costing.executable import cp_split_problem, model_facts

    problem = cp_split_problem(model_facts(graph), cp, f"--cp {cp}")
    if problem:
        raise MeshplanError(problem)


def parallel_config(gpus, global_batch, tp, pp, mbs, zero, recompute, sp, schedule, vpp, precision,
                    shard_group: int | None = None, cp: int = 1, ep: int = 1) -> ParallelConfig:
    """ParallelConfig with DP = gpus / (tp * pp * cp); its validation errors become MeshplanError."""
    dp = gpus // (tp * pp * cp)
    if schedule in V_SHAPED_SCHEDULES and vpp == 1:
        vpp = 2  # a V always holds two chunks per rank: --vpp 2 is implied
    if shard_group == dp:  # sharding over every dp rank is plain ZeRO
        shard_group = None
    try:
        return ParallelConfig(gpus=gpus, global_batch=global_batch, tp=tp, pp=pp, dp=dp, cp=cp,
                              microbatch_size=mbs, zero=zero, recompute=recompute, sp=sp, schedule=schedule,
                              virtual_stages=vpp, precision=precision, shard_group=shard_group, ep=ep)
    except ValueError as exc:
        raise MeshplanError(str(exc).replace("shard_group", "--shard-group").replace(
            "expert parallelism ep=", "--ep ")) from None


def check_mesh(cluster: ClusterProfile, gpus: int, tp: int, pp: int, cp: int = 1) -> None:
    """The checks that need no model: degrees divide the GPUs, TP fits in a node, GPUs exist."""
    for name, value in (("gpus", gpus), ("tp", tp), ("pp", pp), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MeshplanError(f"--{name} must be a positive integer, got {value!r}")
    if gpus % (tp * pp * cp):
        names, values = ("tp*pp*cp", f"{tp}*{pp}*{cp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")
        raise MeshplanError(f"--gpus {gpus} is not divisible by {names} = {values} = {tp * pp * cp}; "
                            f"use a multiple of {tp * pp * cp} GPUs or other degrees")
    if tp > cluster.gpus_per_node or cluster.gpus_per_node % tp:
        raise MeshplanError(f"--tp {tp} must divide the {cluster.gpus_per_node} GPUs of one node of "
                            f"{cluster.name!r} (tensor parallelism stays inside a node)")
    max_gpus = cluster.gpus_per_node * cluster.max_nodes
    if gpus > max_gpus:
        raise MeshplanError(f"--gpus {gpus} exceeds the {max_gpus} GPUs profile {cluster.name!r} allows "
                            f"({cluster.max_nodes} nodes of {cluster.gpus_per_node})")


def estimate(spec: str, cluster: str | ClusterProfile, gpus: int, global_batch: int, seq: int | None = None,
             tp: int = 1, pp: int = 1, mbs: int = 1, zero: int = 0, recompute: str = "none", sp: bool = False,
             schedule: str = "1f1b", vpp: int = 1, precision: str | None = None, dtype: str | None = None,
             attention: str = "flash", shard_group: int | None = None, cp: int = 1, ep: int = 1,
             moe_imbalance: float = 1.0, moe_capacity_factor: float | None = None,
             moe_pad_to_capacity: bool = False) -> Prediction:
    """Predict step time, memory per pipeline rank, throughput and MFU of one configuration.
    `shard_group`: HSDP (ZeRO over groups of that many dp ranks, replicated across them);
    `cp`: context parallelism (each of cp ranks holds 1/cp of every sequence)."""
    from meshplan.planner.models.registry import default_seq
    from meshplan.planner.profiling.profiler import profile

    cluster = cluster if isinstance(cluster, ClusterProfile) else load_cluster(cluster)
    precision = precision or default_precision(cluster)
    check_fp8_supported(cluster, precision)
    check_mesh(cluster, gpus, tp, pp, cp)
    parallel_config(gpus, global_batch, tp, pp, mbs, zero, recompute, sp, schedule, vpp, precision,
                    shard_group, cp, ep)  # fail fast
    dtype = dtype or ("fp32" if precision == "fp32" else "bf16")
    graph = profile(spec, default_seq(spec, DEFAULT_SEQ) if seq is None else seq, batch=1, dtype=dtype, attention=attention,
                    moe_imbalance=moe_imbalance, moe_capacity_factor=moe_capacity_factor,
                    moe_pad_to_capacity=moe_pad_to_capacity)
    config = make_config(graph, cluster, gpus, global_batch, tp, pp, mbs, zero, recompute, sp, schedule, vpp,
                         precision, shard_group, cp, ep)
    return predict(graph, cluster, config)


def predict(graph, cluster: ClusterProfile, config: ParallelConfig, chunk_of_layer=None,
            recompute_of_layer=None) -> Prediction:
    """The simulator's prediction where it exists (one source of truth), else the closed form."""
    try:
        from meshplan.planner.simulation.simulator import simulate_config
    except ImportError:
        return closed_form_prediction(graph, cluster, config, chunk_of_layer, recompute_of_layer)
    return simulate_config(graph, cluster, config, chunk_of_layer=chunk_of_layer,
                           recompute_of_layer=recompute_of_layer, timeline=False)


def closed_form_prediction(graph, cluster: ClusterProfile, config: ParallelConfig, chunk_of_layer=None,
                           recompute_of_layer=None) -> Prediction:
    """The cost model's closed-form step (pipeline_closed_form) and memory per pipeline rank."""
    chunks = tuple(chunk_of_layer) if chunk_of_layer is not None else balanced_layer_chunks(graph, cluster, config)
    recomputes = tuple(recompute_of_layer) if recompute_of_layer is not None else default_recompute(graph, config)
    if len(chunks) != len(graph.layers) or len(recomputes) != len(graph.layers):
        raise ValueError(f"chunk_of_layer and recompute_of_layer need one entry per layer ({len(graph.layers)})")
    stage_of = [config.rank_of_chunk(chunk) for chunk in chunks]
    embed_stage = next((stage_of[i] for i, layer in enumerate(graph.layers) if layer.kind == "embedding"), None)
    costs = []
    for index, (layer, recompute) in enumerate(zip(graph.layers, recomputes)):
        holds_shared = bool(layer.shared_params) and embed_stage is not None and stage_of[index] != embed_stage
        costs.append(layer_cost(layer, strategy_for(config, recompute), cluster, graph.info,
                                profile_dtype=graph.dtype, holds_shared=holds_shared,
                                attention=graph.attention))
    stages = [_stage_times(graph, cluster, config, costs, chunks, stage_of, rank) for rank in range(config.pp)]
    step = pipeline_closed_form(stages, config.num_microbatches, config.schedule, config.virtual_stages)
    memory = tuple(_stage_memory(config, costs, chunks, stage_of, rank) for rank in range(config.pp))
    return _prediction(graph, cluster, config, recomputes, step, memory)


def _exposed_gathers_s(costs, chunk_layers) -> float:
    """Per micro-batch, the parameter gathers of one chunk's forward and backward that prefetch
    one layer ahead cannot hide (`layer_costs.pass_gather_exposure_s`)."""
    forward = [costs[i] for i in chunk_layers]
    backward = forward[::-1]
    return (pass_gather_exposure_s([c.fwd_gather_s for c in forward], [c.fwd_busy_s for c in forward])
            + pass_gather_exposure_s([c.bwd_gather_s for c in backward], [c.bwd_busy_s for c in backward]))


def _stage_times(graph, cluster, config, costs, chunks, stage_of, rank) -> StageTimes:
    mine = [i for i, stage in enumerate(stage_of) if stage == rank]
    compute = sum(costs[i].fwd_compute_s + costs[i].bwd_compute_s for i in mine)
    recompute = sum(costs[i].recompute_s for i in mine)
    tp_comm = sum(costs[i].fwd_blocking_comm_s + costs[i].bwd_blocking_comm_s for i in mine)
    zero3 = sum(_exposed_gathers_s(costs, [i for i in mine if chunks[i] == chunk])
                for chunk in dict.fromkeys(chunks[i] for i in mine))
    # Each chunk boundary: this rank sends the activation forward, and the gradient of its own
    # input backward.
    p2p = 0.0
    for i in mine:
        if i + 1 < len(chunks) and chunks[i + 1] != chunks[i]:
            p2p += p2p_time_s(costs[i].output_bytes, config, cluster)
        if i > 0 and chunks[i - 1] != chunks[i]:
            p2p += p2p_time_s(costs[i - 1].output_bytes, config, cluster)
    # DP gradient reduction overlaps the last micro-batch's backward, except for the gradients
    # produced last (the stage's first layer), which nothing follows.
    grad_comm = sum(costs[i].dp_grad_comm_s for i in mine)
    window = sum(costs[i].bwd_busy_s for i in mine)
    exposed = max(grad_comm - window, costs[mine[0]].dp_grad_comm_s if mine else 0.0)
    return StageTimes(compute_s=compute, recompute_s=recompute, tp_comm_s=tp_comm, zero3_exposed_s=zero3,
                      p2p_s=p2p, dp_exposed_s=exposed,
                      param_gather_s=sum(costs[i].dp_param_gather_s for i in mine),
                      optimizer_s=sum(costs[i].optimizer_step_s for i in mine))


def microbatches_in_flight(config: ParallelConfig, rank: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in units of the
    whole stage's activations: GPipe m; 1F1B min(m, p - rank); interleaved 1F1B (Megatron's
    warm-up) min(m v, 2 (p - rank - 1) + (v - 1) p + 1) chunk-micro-batches, each 1/v of the stage."""
    m, p = config.num_microbatches, config.pp
    if config.schedule in SPLIT_BACKWARD_SCHEDULES:  # read off torch's order (I keeps them until W)
        actions = rank_actions(config.schedule, p, m, config.virtual_stages, rank)
        return max_in_flight(actions) / config.virtual_stages
    if config.schedule == "gpipe":
        return float(m)
    if config.schedule == "interleaved":
        v = config.virtual_stages
        return min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1) / v
    return float(min(m, p - rank))


def _stage_memory(config, costs, chunks, stage_of, rank) -> MemoryBreakdown:
    """Resident states plus, per micro-batch in flight, the saved activations and each chunk's
    boundary output (the pipeline stage keeps it as the root of that chunk's backward)."""
    mine = [costs[i] for i, stage in enumerate(stage_of) if stage == rank]
    boundary = sum(costs[i].output_bytes for i, stage in enumerate(stage_of)
                   if stage == rank and i + 1 < len(chunks) and chunks[i + 1] != chunks[i])
    buffers = max((c.buffer_bytes for c in mine), default=0.0)
    if config.pp > 1:  # receive buffers in transit, kept sends (the simulator's and the ILP's rule)
        last_of_chunk = {chunk: i for i, chunk in enumerate(chunks)}
        boundaries = [costs[last_of_chunk[c]].output_bytes for c in range(config.num_model_chunks - 1)]
        buffers += held_boundary_bytes(config.schedule, config.pp, config.num_microbatches, config.virtual_stages,
                                       config.rank_of_chunk, boundaries)[rank]
    return MemoryBreakdown(params=sum(c.param_bytes for c in mine), grads=sum(c.grad_bytes for c in mine),
                           optimizer=sum(c.optimizer_bytes for c in mine),
                           activations=(sum(c.activation_bytes for c in mine) + boundary)
                           * microbatches_in_flight(config, rank),
                           buffers=buffers, experts=sum(c.expert_state_bytes for c in mine))


def _prediction(graph, cluster, config, recomputes, step, memory) -> Prediction:
    step_s = step.step_time_s
    model_flops = flops.model_flops_per_step(graph, config.global_batch)
    hw_flops = flops.executed_flops_per_step(graph, config.global_batch, recomputes)
    peak = cluster.device.peak_flops(COMPUTE_DTYPE[config.precision])  # fp8: MFU against the bf16 peak
    model_tflops = model_flops / step_s / config.gpus / 1e12
    peak_memory = max(m.total for m in memory)
    return Prediction(
        step_time_s=step_s, tokens_per_s=config.global_batch * graph.seq / step_s,
        model_tflops_per_gpu=model_tflops, hw_tflops_per_gpu=hw_flops / step_s / config.gpus / 1e12,
        mfu=model_tflops * 1e12 / peak, peak_memory_bytes=peak_memory, memory=memory,
        bubble_fraction=step.bubble_fraction, fits=peak_memory <= cluster.device.usable_memory_bytes,
        breakdown=dict(step.breakdown))
