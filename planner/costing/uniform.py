"""A uniform configuration: the `ParallelConfig` each layer is costed under (`layer_config`, and
`layer_mesh` for a layer of a layerwise plan), the recomputation it applies per layer, and the
balanced cut of the layers into pipeline chunks. The simulator (`simulation.simulator.simulate_config`),
`estimate` and the engine bridge read these when no plan gives per-layer choices; the search costs
its candidates under `layer_config`."""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import is_mtp_layer
from meshplan.planner.costing.layer_cost import LayerCost, layer_cost
from meshplan.planner.costing.state_memory import executed_zero


def layer_config(config: ParallelConfig, recompute: str | None = None) -> ParallelConfig:
    """`config` as `layer_cost` prices a layer of it: at the ZeRO stage the executor runs
    (`state_memory.executed_zero`) and with the layer's recomputation (None: the config's)."""
    zero = executed_zero(config.zero, config.data_ranks, config.pp, config.schedule)
    recompute = recompute or config.recompute
    if (zero, recompute) == (config.zero, config.recompute):
        return config
    # parameters stay offloaded only while sharded (ZeRO-3); run as ZeRO-1, the optimizer's states alone
    offload = "optimizer" if config.offload == "params" and zero != 3 else config.offload
    return replace(config, zero=zero, recompute=recompute, offload=offload)


# The schedule a cost-only config carries: valid at any pp (m >= pp holds for every config), one chunk.
PLAIN_SCHEDULE = "1f1b"


def cost_config(config: ParallelConfig) -> ParallelConfig:
    """`layer_config(config)` on the plain schedule: what the layers' costs depend on and no more
    (a schedule changes a layer's cost only through the ZeRO stage run, applied here), so that
    candidates equal under it share their cost tables (`tables.build_cost_table`)."""
    config = layer_config(config)
    if (config.schedule, config.virtual_stages) == (PLAIN_SCHEDULE, 1):
        return config
    return replace(config, schedule=PLAIN_SCHEDULE, virtual_stages=1)


def layer_mesh(config: ParallelConfig, tp: int, dp: int) -> ParallelConfig:
    """`config` for a layer of a layerwise plan that runs on its own (tp, dp), tp * dp being the
    stage's: the stage's samples split dp ways, sequence parallelism only where tp > 1, HSDP and
    expert parallelism kept only on the config's own dp (they belong to its data groups)."""
    if (tp, dp) == (config.tp, config.dp):
        return config
    samples = config.microbatch_size * config.dp
    if samples % dp:
        raise ValueError(f"dp={dp} does not divide the stage's {samples} samples per micro-batch "
                         f"(mbs {config.microbatch_size} x dp {config.dp})")
    same_dp = dp == config.dp
    return replace(config, tp=tp, dp=dp, microbatch_size=samples // dp, sp=config.sp and tp > 1,
                   shard_group=config.shard_group if same_dp else None, ep=config.ep if same_dp else 1,
                   etp=config.etp if same_dp and tp == config.tp else None)


def default_recompute(graph, config) -> tuple[str, ...]:
    """Recomputation applies to transformer blocks (and unknown layers), not embedding or head."""
    return tuple("none" if layer.kind in ("embedding", "head") else config.recompute for layer in graph.layers)


def balanced_layer_chunks(graph, cluster: ClusterProfile, config) -> tuple[int, ...]:
    """Chunk index per layer: pp * virtual_stages contiguous non-empty chunks, slowest minimal;
    under an engine that cuts the model its own way, that engine's cut (`engine_layer_chunks`).

    A layer weighs its per-micro-batch time (compute, recomputation, TP collectives). The optimal
    bottleneck is found by bisection on a greedy feasibility test (a chunk closes when the next
    layer would exceed the bound); the result is exact to 1e-9 relative.
    """
    num_chunks = config.num_model_chunks
    if num_chunks > len(graph.layers):
        raise ValueError(f"{num_chunks} pipeline chunks (pp {config.pp} x virtual stages {config.virtual_stages}) "
                         f"need at least that many layers; the model has {len(graph.layers)}")
    num_mtp = sum(map(is_mtp_layer, graph.layers))
    own = engine_layer_chunks([layer.kind for layer in graph.layers], config.engine, num_chunks, num_mtp)
    if own is not None:
        return own
    recomputes = default_recompute(graph, config)
    weights = [_layer_time_s(layer_cost(layer, layer_config(config, r), cluster, graph.info, profile_dtype=graph.dtype,
                                           attention=graph.attention))
               for layer, r in zip(graph.layers, recomputes)]
    if num_mtp:  # the MTP depths share the output layer's chunk (Megatron-Core's `mtp_on_this_rank`)
        weights = weights[:-1 - num_mtp] + [sum(weights[-1 - num_mtp:])]
        if num_chunks > len(weights):
            raise ValueError(f"{num_chunks} pipeline chunks need at least that many layers besides the "
                             f"{num_mtp} multi-token-prediction depths, which share the output layer's chunk; "
                             f"the model has {len(weights)}")
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
    return chunks + (chunks[-1],) * num_mtp


def engine_layer_chunks(kinds: list[str], engine: str, num_chunks: int, num_mtp: int = 0) -> tuple[int, ...] | None:
    """The chunk of each layer (by its kind) as `engine` cuts the model when told nothing else;
    None where meshplan's balanced cut stands in (meshplan's executor, the other engines, models
    other than embedding, blocks, head).

    Megatron-LM builds `--num-layers` / (pp x vpp) transformer layers in every (virtual) stage,
    the embedding on the first and the output layer on the last
    (`megatron/core/transformer/transformer_block.py` `get_num_layers_to_build`); where the
    blocks do not divide but blocks, embedding and loss do, its recipes count the embedding and
    the loss as one layer each (`--account-for-embedding-in-pipeline-split
    --account-for-loss-in-pipeline-split`, Megatron-Bridge's Llama 3.1 405B). Its stages hold
    equal block counts whatever their time: the first chunks carry no more micro-batches' worth
    of blocks than the last, which a time-balanced cut (a heavy output layer) would give them.
    The `num_mtp` multi-token-prediction depths before the output layer are not counted in that
    split: Megatron-Core builds them all on the last stage (`mtp_on_this_rank`).
    """
    if engine != "megatron" or len(kinds) < 3 or kinds[0] != "embedding" or kinds[-1] != "head" \
            or any(kind != "block" for kind in kinds[1:-1]):
        return None
    num_blocks = len(kinds) - 2 - num_mtp
    last = (num_chunks - 1,) * (num_mtp + 1)
    if num_blocks % num_chunks == 0:
        per_chunk = num_blocks // num_chunks
        return (0,) + tuple(index // per_chunk for index in range(num_blocks)) + last
    if (num_blocks + 2) % num_chunks == 0:
        per_chunk = (num_blocks + 2) // num_chunks
        return tuple(index // per_chunk for index in range(num_blocks + 1)) + last
    return None


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
