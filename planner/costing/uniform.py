"""A uniform configuration: the strategy every layer of a `ParallelConfig` runs under, the
recomputation it applies per layer, and the balanced cut of the layers into pipeline chunks.
The simulator (`simulation.simulator.simulate_config`), `estimate` and the engine bridge read
these when no plan gives per-layer choices; the search costs its candidates with `strategy_for`."""
from __future__ import annotations

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.costing.layer_cost import LayerCost, layer_cost
from meshplan.planner.costing.strategy import Strategy
from meshplan.planner.costing.state_memory import executed_zero


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
