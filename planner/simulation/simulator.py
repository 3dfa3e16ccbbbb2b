"""`simulate(plan) -> Prediction`: one training step of a plan, played event by event.

This module costs every layer with the cost model (`planner.costing.layer_cost.layer_cost`) and hands the
result to the event engine (`planner.simulation.event_engine`), which plays the pipeline schedule the
executor runs with compute, TP, p2p and DP streams and tracks memory over time. `estimate` and
the planner's re-ranking call `simulate_config`; `meshplan simulate` calls `simulate`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshplan.planner.costing.communication import p2p_time_s
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.offload import usable_host_memory_bytes
from meshplan.planner.costing.precision import COMPUTE_DTYPE
from meshplan.planner.costing import flops, uniform
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import ModelGraph
from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.errors import PlanNeedsModelCode
from meshplan.planner.contracts.plan import Plan, check_plan_matches_model, model_file
from meshplan.planner.contracts.prediction import Prediction
from meshplan.planner.costing.state_memory import grad_sync_mode
from meshplan.planner.simulation.contention import stream_links
from meshplan.planner.simulation.event_engine import simulate_step
from meshplan.planner.simulation.step_costs import StepCosts
from meshplan.planner.costing.weight_grad import weight_grad_share

STREAMS = ("compute", "tp", "cp", "ep", "p2p", "dp")


def simulate_config(graph: ModelGraph, cluster: ClusterProfile, config: ParallelConfig,
                    chunk_of_layer: Sequence[int] | None = None, recompute_of_layer: Sequence[str] | None = None,
                    timeline: bool = False, degrees_of_layer: Sequence[tuple[int, int]] | None = None,
                    grad_sync: str | None = None) -> Prediction:
    """Simulate one step of `graph` on `cluster` under a configuration.

    `chunk_of_layer`: model chunk (virtual_stage * pp + stage) of each layer; None balances the
    layers with `uniform.balanced_layer_chunks`. `recompute_of_layer`: none|selective|full per layer;
    None applies `config.recompute` to the transformer blocks (`uniform.default_recompute`).
    `degrees_of_layer`: (tp, dp) per layer for layer-wise plans; None uses the mesh's.
    `grad_sync`: when gradients are reduced (see `StepCosts.grad_sync`); None follows the
    executor (`costing.state_memory.grad_sync_mode`).
    """
    costs = step_costs(graph, cluster, config, chunk_of_layer, recompute_of_layer, degrees_of_layer, grad_sync)
    return simulate_step(costs, timeline=timeline)


def simulate(plan: Plan, graph: ModelGraph | None = None, timeline: bool = True) -> Prediction:
    """Simulate one step of a Plan. `graph` None: the graph the plan carries, else `plan_graph`'s."""
    if graph is None:
        graph = plan_graph(plan)
    check_plan_matches_model(plan, [layer.name for layer in graph.layers])
    degrees = [(layer.tp, layer.dp) for layer in plan.layers]
    costs = step_costs(graph, plan.cluster, plan.config, [plan.chunk_of(layer) for layer in plan.layers],
                       [layer.recompute for layer in plan.layers], degrees_of_layer=degrees)
    return simulate_step(costs, timeline=timeline)


def plan_graph(plan: Plan) -> ModelGraph:
    """The layer graph of a plan's model without running model code: the graph the plan carries
    (file and hf: models), else the zoo spec's (closed form). An older plan of a user-code model
    that carries none is refused (`PlanNeedsModelCode`) rather than importing its file."""
    if plan.graph is not None:
        return plan.graph
    path = model_file(plan.model.spec)
    if path is not None:
        raise PlanNeedsModelCode(
            f"the plan of {plan.model.spec} carries no layer graph (written by an older meshplan) and reading a plan "
            f"never runs model code ({path}); re-plan it with this meshplan (`meshplan plan --model "
            f"{plan.model.spec} ... --out plan.json`)")
    from meshplan.planner.profiling.profiler import profile_plan_model

    return profile_plan_model(plan.model, plan.config.engine)


def step_costs(graph: ModelGraph, cluster: ClusterProfile, config: ParallelConfig,
               chunk_of_layer: Sequence[int] | None = None, recompute_of_layer: Sequence[str] | None = None,
               degrees_of_layer: Sequence[tuple[int, int]] | None = None,
               grad_sync: str | None = None) -> StepCosts:
    """Cost every layer and collect what the event engine needs (see `StepCosts`).

    `degrees_of_layer`: (tp, dp) per layer for non-executable layer-wise plans; None uses the
    mesh's degrees for every layer. `grad_sync` None follows the executor (`costing.state_memory.grad_sync_mode`).
    """
    num_layers = len(graph.layers)
    chunks = tuple(uniform.balanced_layer_chunks(graph, cluster, config) if chunk_of_layer is None else chunk_of_layer)
    recomputes = tuple(uniform.default_recompute(graph, config) if recompute_of_layer is None else recompute_of_layer)
    degrees = tuple(degrees_of_layer or [(config.tp, config.dp)] * num_layers)
    for name, values in (("chunk_of_layer", chunks), ("recompute_of_layer", recomputes),
                         ("degrees_of_layer", degrees)):
        if len(values) != num_layers:
            raise ValueError(f"{name} has {len(values)} entries but the model has {num_layers} layers")
    owner_rank = config.rank_of_chunk(chunks[0])  # tied weights are owned by the first layer's stage
    layer_costs, configs = [], {}
    for layer, chunk, recompute, (tp, dp) in zip(graph.layers, chunks, recomputes, degrees):
        # A layer of a layerwise plan splits the stage's samples its own dp ways (as the ILP's
        # cost table does): its micro-batch is the stage's samples over its dp (`uniform.layer_mesh`).
        if (config.microbatch_size * config.dp) % dp:
            raise ValueError(f"layer {layer.name!r} has dp={dp}, which does not divide the stage's "
                             f"{config.microbatch_size * config.dp} samples per micro-batch")
        run = configs.get((tp, dp, recompute))
        if run is None:
            run = configs[tp, dp, recompute] = uniform.layer_config(uniform.layer_mesh(config, tp, dp), recompute)
        holds_shared = bool(layer.shared_params) and config.rank_of_chunk(chunk) != owner_rank
        layer_costs.append(layer_cost(layer, run, cluster, graph.info, profile_dtype=graph.dtype,
                                      attention=graph.attention, holds_shared=holds_shared))
    layer_costs = _charge_step_fixed_costs(layer_costs, chunks, cluster, config)
    last_of_chunk = {chunk: index for index, chunk in enumerate(chunks)}
    p2p = tuple(p2p_time_s(layer_costs[last_of_chunk[c]].output_bytes, config, cluster)
                for c in range(config.num_model_chunks - 1))
    model_flops = flops.model_flops_per_step(graph, config.global_batch)
    hw_flops = flops.executed_flops_per_step(graph, config.global_batch, recomputes, config)
    links = stream_links(config, cluster.gpus_per_node)
    return StepCosts(
        config=config, layer_costs=tuple(layer_costs), chunk_of_layer=chunks, p2p_time_s=p2p,
        tokens_per_step=float(config.global_batch * graph.seq), model_flops_per_step=float(model_flops),
        hw_flops_per_step=hw_flops,
        peak_flops_per_s=cluster.device.peak_flops(COMPUTE_DTYPE[config.precision]),
        usable_memory_bytes=cluster.device.usable_memory_bytes,
        gpus_per_node=cluster.gpus_per_node, usable_host_memory_bytes=usable_host_memory_bytes(cluster),
        grad_sync=grad_sync or grad_sync_mode(config),
        dp_link=links[0], pp_link=links[1],
        weight_grad_share=tuple(weight_grad_share(layer, graph.seq, graph.attention) for layer in graph.layers))


def _charge_step_fixed_costs(layer_costs: list, chunks: Sequence[int], cluster: ClusterProfile,
                             config: ParallelConfig) -> list:
    """Per-chunk and per-rank fixed costs (`planner.costing.fixed_costs`): torch pipelining's work per
    forward and backward action, charged to each chunk's first layer, and the gradient norm's
    all-reduce, charged to the optimizer step of each pipeline rank's first layer."""
    from dataclasses import replace

    from meshplan.planner.costing.fixed_costs import grad_norm_all_reduce_s, pipeline_action_s

    action_s = pipeline_action_s(config.pp, cluster)
    norm_s = grad_norm_all_reduce_s(config.gpus, cluster)
    out, seen_chunks, seen_ranks = list(layer_costs), set(), set()
    for index, chunk in enumerate(chunks):
        first_of_rank = config.rank_of_chunk(chunk) not in seen_ranks
        if chunk in seen_chunks:
            continue
        seen_chunks.add(chunk)
        seen_ranks.add(config.rank_of_chunk(chunk))
        c = out[index]
        out[index] = replace(c, fwd_compute_s=c.fwd_compute_s + action_s, bwd_compute_s=c.bwd_compute_s + action_s,
                             optimizer_step_s=c.optimizer_step_s + (norm_s if first_of_rank else 0.0))
    return out


def chrome_trace(prediction: Prediction) -> dict[str, Any]:
    """The timeline as Chrome trace-event JSON (Perfetto, chrome://tracing): one process per
    pipeline rank, one thread per stream, times in microseconds, memory as a counter track."""
    events: list[dict[str, Any]] = []
    ranks = sorted({interval.rank for interval in prediction.timeline} | set(range(len(prediction.memory))))
    # name the streams this step uses (a dense model without CP has no cp or ep traffic)
    used = {interval.stream for interval in prediction.timeline} | {"compute"}
    for rank in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"pipeline rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, stream in ((tid, stream) for tid, stream in enumerate(STREAMS) if stream in used):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": stream}})
    for interval in prediction.timeline:
        label = interval.kind
        if interval.microbatch >= 0:
            label += f" c{interval.chunk} mb{interval.microbatch}"
        events.append({"ph": "X", "name": label, "cat": interval.kind, "pid": interval.rank,
                       "tid": STREAMS.index(interval.stream) if interval.stream in STREAMS else len(STREAMS),
                       "ts": interval.start_s * 1e6, "dur": (interval.end_s - interval.start_s) * 1e6,
                       "args": {"kind": interval.kind, "stream": interval.stream, "rank": interval.rank,
                                "chunk": interval.chunk, "microbatch": interval.microbatch}})
    for rank, curve in enumerate(prediction.memory_timeline):
        for time_s, live_bytes in curve:
            events.append({"ph": "C", "name": "memory (GiB)", "pid": rank, "tid": 0, "ts": time_s * 1e6,
                           "args": {"live": live_bytes / 2**30}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_time_s": prediction.step_time_s, "bubble_fraction": prediction.bubble_fraction}}
