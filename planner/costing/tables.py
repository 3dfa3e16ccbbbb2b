"""Cost tables: what the ILP needs about one outer candidate, built from `planner.costing.layer_cost.layer_cost`.

For one uniform `ParallelConfig` (tp, dp, cp, ep, ZeRO stage, SP, micro-batch size, precision, pp) the layers of a
model collapse into a few *layer types* (the embedding, the repeated transformer block, the head),
and each type has a handful of *options* (recomputation none / selective / full; with
`--layerwise` also the per-layer tp and dp degrees). The solver only ever reads these tables, so
it can be tested on synthetic tables and planning a 126-block model costs three types, not 126
layers.

All times are seconds on one rank. `fwd_s` and `bwd_s` are per micro-batch and include the blocking
TP collectives and the ZeRO gathers prefetch cannot hide; `bwd_s` includes the recomputed forward.
`fwd_head_s` / `bwd_head_s` are what the gather adds when the layer opens its chunk's forward
(closes its backward), which the ILP charges once per chunk pass (`gathers.gather_exposure_s`).
`dp_comm_s` (gradient reduction), `param_gather_s` (ZeRO-1/2 all-gather after the optimizer) and `optimizer_s` are per
optimizer step. Bytes are per rank: `static_bytes` (parameters, gradients, optimizer states) are
resident; `act_bytes` are held once per in-flight micro-batch; `buffer_bytes` is a transient peak.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache, partial
from typing import Callable

from meshplan.planner.contracts.config import RECOMPUTE
from meshplan.planner.contracts.graph import is_mtp_layer
from meshplan.planner.costing import fixed_costs
from meshplan.planner.costing.engine_memory import keeps_stage_outputs
from meshplan.planner.costing.gathers import after_other_gather_s, gather_exposure_s
from meshplan.planner.costing.ulysses import ULYSSES, ulysses_head_problem
from meshplan.planner.costing.weight_grad import weight_grad_share


@dataclass(frozen=True)
class OptionCost:
    """One layer type run one way (recompute, and for layerwise plans its own tp/dp), on one rank."""

    recompute: str
    fwd_s: float
    bwd_s: float
    static_bytes: float
    act_bytes: float
    buffer_bytes: float = 0.0
    dp_comm_s: float = 0.0
    param_gather_s: float = 0.0
    optimizer_s: float = 0.0
    output_bytes: float = 0.0
    tp: int = 1
    dp: int = 1
    # Split of the times and memory, kept for the plan's per-layer report.
    comm_s: float = 0.0
    # The parameter gathers before the layer's forward and backward and the busy time of each
    # pass, which prefetch hides the next layer's gather behind (`gathers.gather_exposure_s`).
    fwd_gather_s: float = 0.0
    bwd_gather_s: float = 0.0
    fwd_busy_s: float = 0.0
    bwd_busy_s: float = 0.0
    # The weight-gradient (W) part of the backward, which the zero-bubble schedules run as an
    # action of its own (`simulation.split_backward`).
    weight_grad_s: float = 0.0
    # The tensor-parallel collectives of each pass, which a reduction on NVLink slows (`simulation.contention`).
    fwd_tp_s: float = 0.0
    bwd_tp_s: float = 0.0
    # Model states offloaded to host memory (`costing.offload`), not in `static_bytes`.
    host_state_bytes: float = 0.0

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        for name in ("fwd_s", "bwd_s", "static_bytes", "act_bytes", "buffer_bytes", "dp_comm_s",
                     "param_gather_s", "optimizer_s", "output_bytes", "comm_s", "fwd_gather_s", "bwd_gather_s",
                     "fwd_busy_s", "bwd_busy_s", "weight_grad_s", "fwd_tp_s", "bwd_tp_s", "host_state_bytes"):
            value = getattr(self, name)
            if not value >= 0:  # also rejects NaN
                raise ValueError(f"option cost {name} must be >= 0, got {value!r}")

    @property
    def time_s(self) -> float:
        """Forward plus backward of one micro-batch."""
        return self.fwd_s + self.bwd_s

    @property
    def fwd_head_s(self) -> float:
        """What the gather adds when this layer opens its chunk's forward (no layer before it)."""
        return gather_exposure_s(self.fwd_gather_s, self.fwd_busy_s)[1]

    @property
    def bwd_head_s(self) -> float:
        """What the gather adds when this layer opens its chunk's backward (the chunk's last layer)."""
        return gather_exposure_s(self.bwd_gather_s, self.bwd_busy_s)[1]

    @property
    def tail_s(self) -> float:
        """Per-step work after the pipeline drains if nothing overlaps it."""
        return self.dp_comm_s + self.param_gather_s + self.optimizer_s


@dataclass(frozen=True)
class LayerType:
    """A kind of layer and its cost under each option (options in a fixed, deterministic order)."""

    key: str
    options: tuple[OptionCost, ...]

    def __post_init__(self):
        if not self.options:
            raise ValueError(f"layer type {self.key!r} has no options")

    def min_time_s(self) -> float:
        return min(option.time_s for option in self.options)


@dataclass(frozen=True)
class CostTable:
    """Per-layer type index into `types`, the types' option costs, and the pipeline transfer time.

    `p2p_s` is the time of one boundary transfer (one micro-batch's activation forward, or its
    gradient backward) between neighbouring pipeline ranks; `boundary_bytes` is that tensor (the
    output of a layer that ends a chunk: the hidden stream, never the head's logits), which every
    chunk but the last also keeps per micro-batch in flight. `chunk_overhead_s` is fixed work per
    chunk and micro-batch (torch pipelining's forward and backward actions), `rank_fixed_s` fixed
    work per rank and step (the gradient norm's all-reduce).
    """

    layer_names: tuple[str, ...]
    layer_type: tuple[int, ...]
    types: tuple[LayerType, ...]
    p2p_s: float = 0.0
    boundary_bytes: float = 0.0
    chunk_overhead_s: float = 0.0
    rank_fixed_s: float = 0.0
    # Layerwise plans: one resharding of the boundary activation between layers of different
    # (tp, dp) inside a stage, per micro-batch and direction.
    reshard_s: float = 0.0
    # whether a chunk keeps its boundary output per micro-batch (`engine_memory.keeps_stage_outputs`)
    keeps_outputs: bool = True

    def __post_init__(self):
        if len(self.layer_names) != len(self.layer_type) or not self.layer_names:
            raise ValueError(f"cost table has {len(self.layer_names)} names but {len(self.layer_type)} types")
        bad = [t for t in self.layer_type if not 0 <= t < len(self.types)]
        if bad:
            raise ValueError(f"cost table refers to layer type {bad[0]} but has {len(self.types)} types")
        for name in ("p2p_s", "reshard_s", "boundary_bytes", "chunk_overhead_s", "rank_fixed_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_type)

    @property
    def last_chunk_layers(self) -> int:
        """How many of the model's last layers every assignment puts in the last chunk: the head,
        and the multi-token-prediction depths before it (Megatron-Core builds them on the last
        pipeline stage beside the output layer; `contracts.graph.is_mtp_layer`)."""
        depths = 0
        while depths < self.num_layers - 1 and is_mtp_layer(self.layer_names[-2 - depths]):
            depths += 1
        return 1 + depths

    def option(self, layer: int, index: int) -> OptionCost:
        return self.types[self.layer_type[layer]].options[index]

    def runs(self) -> list[tuple[int, int, int]]:
        """Maximal runs of consecutive layers of one type: [(type, first layer, count)]."""
        return list(_runs(self.layer_type))

    def min_total_time_s(self) -> float:
        """Sum over layers of the fastest option: no pipeline can do one micro-batch faster."""
        return sum(self.types[t].min_time_s() for t in self.layer_type)

    # Aggregates the search reads once per candidate (computed once per table; a table is shared
    # by every candidate with its `uniform.cost_config`).
    @cached_property
    def type_counts(self) -> tuple[tuple[int, int], ...]:
        """(type index, layers of that type), in order of first appearance."""
        return _type_counts(self.layer_type)

    def layers_by_type(self) -> dict[int, int]:
        """{type index: layers of that type} (a fresh dict of `type_counts`)."""
        return dict(self.type_counts)

    @cached_property
    def fastest_sum_s(self) -> float:
        """Sum over layers of the fastest option's time (as `min_total_time_s`, by type)."""
        return sum(n * self.types[t].min_time_s() for t, n in self.type_counts)

    @cached_property
    def least_static_bytes(self) -> float:
        """Sum over layers of the leanest option's resident bytes."""
        return sum(n * min(o.static_bytes for o in self.types[t].options) for t, n in self.type_counts)

    def least_tail_s(self, blocking: bool) -> float:
        """Sum over layers of the least per-step tail (gather + optimizer, and with `blocking` the
        gradient reduction too)."""
        cache = self.__dict__.setdefault("_least_tail", {})
        if blocking not in cache:
            cache[blocking] = sum(n * min(o.param_gather_s + o.optimizer_s + (o.dp_comm_s if blocking else 0.0)
                                          for o in self.types[t].options)
                                  for t, n in self.type_counts)
        return cache[blocking]


@lru_cache(maxsize=64)
def _runs(layer_type: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    out: list[tuple[int, int, int]] = []
    for index, type_index in enumerate(layer_type):
        if out and out[-1][0] == type_index and out[-1][1] + out[-1][2] == index:
            out[-1] = (type_index, out[-1][1], out[-1][2] + 1)
        else:
            out.append((type_index, index, 1))
    return tuple(out)


@lru_cache(maxsize=64)
def _type_counts(layer_type: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    counts: dict[int, int] = {}
    for t in layer_type:
        counts[t] = counts.get(t, 0) + 1
    return tuple(counts.items())


def option_from_layer_cost(recompute: str, cost, tp: int = 1, dp: int = 1, weight_share: float = 0.0) -> OptionCost:
    """Fold a `planner.costing.layer_cost.LayerCost` into the quantities the ILP uses.

    Parameter gathers (ZeRO-3; FSDP2's ZeRO-1/2 forward) are prefetched one layer ahead, so only
    what the previous layer's busy time cannot hide is exposed (identical consecutive layers make
    "the previous layer" this one); a chunk pass's first layer also waits for its own gather
    (`fwd_head_s`, `bwd_head_s`: `gathers.gather_exposure_s`). Activations and buffers are counted
    as reserved: times `LayerCost.reserve_scale` (the engine's allocator fragmentation), as the
    simulator counts them.
    """
    fwd_comm_s, bwd_comm_s = cost.fwd_blocking_comm_s, cost.bwd_blocking_comm_s
    fwd_gather_s = cost.fwd_gather_exposure_s[0]
    bwd_gather_s = cost.bwd_gather_exposure_s[0]
    return OptionCost(
        recompute=recompute,
        fwd_s=cost.fwd_busy_s + fwd_gather_s,
        bwd_s=cost.bwd_busy_s + bwd_gather_s,
        static_bytes=cost.param_bytes + cost.grad_bytes + cost.optimizer_bytes,
        act_bytes=cost.activation_bytes * cost.reserve_scale,
        buffer_bytes=cost.buffer_bytes * cost.reserve_scale,
        dp_comm_s=cost.dp_grad_comm_s,
        param_gather_s=cost.dp_param_gather_s,
        optimizer_s=cost.optimizer_step_s,
        output_bytes=cost.output_bytes,
        tp=tp, dp=dp,
        comm_s=fwd_comm_s + bwd_comm_s + fwd_gather_s + bwd_gather_s,
        fwd_gather_s=cost.fwd_gather_s, bwd_gather_s=cost.bwd_gather_s,
        fwd_busy_s=cost.fwd_busy_s, bwd_busy_s=cost.bwd_busy_s, weight_grad_s=weight_share * cost.bwd_compute_s,
        fwd_tp_s=cost.tp_fwd_comm_s, bwd_tp_s=cost.tp_bwd_comm_s, host_state_bytes=cost.host_state_bytes)


def _no_worse(a: OptionCost, b: OptionCost) -> bool:
    """a is at least as good as b in every quantity the solver reads."""
    fields = ("static_bytes", "act_bytes", "buffer_bytes", "dp_comm_s", "param_gather_s", "optimizer_s",
              "fwd_head_s", "bwd_head_s")
    return ((a.tp, a.dp) == (b.tp, b.dp) and a.fwd_s <= b.fwd_s and a.bwd_s <= b.bwd_s
            and all(getattr(a, f) <= getattr(b, f) for f in fields))


def drop_dominated(options: list[OptionCost]) -> tuple[OptionCost, ...]:
    """Options no better than an earlier one (or worse than a later one) are never needed.

    Example: with flash attention there are no attention scores to drop, so selective
    recomputation costs exactly what no recomputation does; keeping both only gives the ILP
    interchangeable copies of every solution.
    """
    kept: list[OptionCost] = []
    for index, option in enumerate(options):
        earlier = any(_no_worse(other, option) for other in options[:index])
        later = any(_no_worse(other, option) and not _no_worse(option, other) for other in options[index + 1:])
        if not (earlier or later):
            kept.append(option)
    return tuple(kept)


def stream_bytes(types, layer_type) -> float:
    """The tensor one layer hands the next, per micro-batch: the largest output of any layer but
    the last (the hidden stream, never the head's logits), at the config's own mesh (the first
    option of each type). What a pipeline boundary sends and a layerwise plan reshards."""
    return max(types[t].options[0].output_bytes for t in set(layer_type[:-1] or layer_type))


def layer_type_keys(graph) -> tuple[list[str], list[int]]:
    """Distinct layer types of a ModelGraph (repeated blocks share one) and each layer's type."""
    keys: list[str] = []
    layer_type: list[int] = []
    for layer in graph.layers:
        key = layer.repeat_of or layer.name
        if key not in keys:
            keys.append(key)
        layer_type.append(keys.index(key))
    return keys, layer_type


def costed_pp(pp: int) -> int:
    """The pp a layer is costed at: its cost sees only whether it is pipelined (a tied copy also
    how far apart its stages are, costed at its own pp), so every pp > 1 shares pp = 2's costs."""
    return min(pp, 2)


def costed_config(config):
    """`config` at `costed_pp` (the GPUs to match), on the plain schedule (`uniform.cost_config`)."""
    from dataclasses import replace

    from meshplan.planner.costing.uniform import cost_config

    pp = costed_pp(config.pp)
    if pp == config.pp:
        return config
    return replace(cost_config(config), pp=pp, gpus=config.gpus // config.pp * pp)


def _pipelined(config, cache: dict):
    """`costed_config(config)`, one object per distinct config (kept in `cache`)."""
    key = ("costed_pp", config)
    out = cache.get(key)
    if out is None:
        out = cache[key] = costed_config(config)
    return out


def _variant(config, cache: dict, **changes):
    """`replace(config, **changes)`, built (and validated) once per distinct result (kept in `cache`)."""
    from dataclasses import replace

    key = ("variant", config, tuple(changes.items()))
    out = cache.get(key)
    if out is None:
        out = cache[key] = replace(config, **changes)
    return out


def _fold_pinned_neighbours(types: list[LayerType], layer_type) -> list[LayerType]:
    """A first and a last layer of their own kind (the embedding, the head) always run beside the
    run of blocks: fold into their options what each pass's gathers change there
    (`gathers.after_other_gather_s`): the first block's forward gather hides behind the
    embedding's forward, the embedding's backward gather behind the first block's backward, the
    head's forward gather behind the last block's, the last block's backward gather behind the
    head's. The block side is its first option (a chunk holding a pinned layer alone is charged
    as if a block were beside it)."""
    from dataclasses import replace

    num_layers = len(layer_type)
    if num_layers < 2:
        return types
    out = list(types)
    for end, beside in ((0, 1), (num_layers - 1, num_layers - 2)):
        kind = layer_type[end]
        if layer_type.count(kind) != 1 or layer_type[beside] == kind:
            continue
        block = types[layer_type[beside]].options[0]
        folded = []
        for option in types[kind].options:
            if end == 0:  # forward: the block after it; backward: it after the block
                fwd = after_other_gather_s(block.fwd_gather_s, block.fwd_busy_s, option.fwd_busy_s)
                bwd = after_other_gather_s(option.bwd_gather_s, option.bwd_busy_s, block.bwd_busy_s)
            else:  # forward: it after the block; backward: the block after it
                fwd = after_other_gather_s(option.fwd_gather_s, option.fwd_busy_s, block.fwd_busy_s)
                bwd = after_other_gather_s(block.bwd_gather_s, block.bwd_busy_s, option.bwd_busy_s)
            folded.append(replace(option, fwd_s=max(0.0, option.fwd_s + fwd), bwd_s=max(0.0, option.bwd_s + bwd)))
        out[kind] = replace(types[kind], options=tuple(folded))
    return out


def _mesh_config(config, layer, tp: int, dp: int, holds_shared: bool, cache: dict):
    """The config `layer` is costed under on a (tp, dp) mesh of the stage (`uniform.layer_mesh`),
    no expert layout (ep 1, etp unset) for a layer without routed experts, pp as `costed_pp` prices it."""
    from meshplan.planner.costing.uniform import layer_mesh

    local = layer_mesh(config, tp, dp)
    if not layer.expert_params and (local.ep != 1 or local.etp is not None):
        local = _variant(local, cache, ep=1, etp=None)
    if local.pp != costed_pp(local.pp) and not holds_shared:
        local = _pipelined(local, cache)
    return local


def build_cost_table(graph, cluster, config, recompute_options=RECOMPUTE, *,
                     layerwise_meshes: tuple[tuple[int, int], ...] = (),
                     layer_cost: Callable | None = None, p2p_time: Callable | None = None,
                     cache: dict | None = None) -> CostTable:
    """The cost table of `graph` under `config` (a `ParallelConfig` as `uniform.layer_config` gives it) on `cluster`.

    `layerwise_meshes`: extra (tp, dp) pairs each layer may pick (same tp*dp as the config's);
    the micro-batch is then split `dp` ways inside the stage instead of `config.dp` ways.
    `layer_cost` and `p2p_time` default to the cost model's; tests may pass others.
    `cache`: a dict shared by the tables of one graph on one cluster (the search's); a layer's
    option is costed once per config it sees, where a layer without routed experts sees
    every expert-parallel degree as ep = 1 (expert parallelism splits only routed experts), and
    a MoE block's dense part is priced once for all its expert layouts (`layer_cost`'s memo).
    """
    if cache is None:
        cache = {}
    if layer_cost is None or p2p_time is None:
        from meshplan.planner.costing.communication import p2p_time_s
        from meshplan.planner.costing.layer_cost import layer_cost as default_layer_cost
        layer_cost = layer_cost or partial(default_layer_cost, memo=cache)
        p2p_time = p2p_time or p2p_time_s
    shape = cache.get(("graph", id(graph)))
    if shape is None:
        keys, layer_type = layer_type_keys(graph)
        first_of_type = {t: graph.layers[i] for i, t in reversed(list(enumerate(layer_type)))}
        shape = cache[("graph", id(graph))] = (keys, tuple(layer_type), first_of_type,
                                               tuple(layer.name for layer in graph.layers), graph)
    keys, layer_type, first_of_type, layer_names = shape[:4]
    meshes = [(config.tp, config.dp)] + [m for m in layerwise_meshes if m != (config.tp, config.dp)]
    types = []
    for type_index, key in enumerate(keys):
        layer = first_of_type[type_index]
        options = _layer_options(graph, cluster, config, layer, meshes, recompute_options, layer_cost, cache)
        if not options:
            raise ValueError(f"layer {layer.name!r} cannot run with tp={config.tp}")
        types.append(LayerType(key=key, options=drop_dominated(options)))
    types = _fold_pinned_neighbours(types, layer_type)
    boundary_bytes = stream_bytes(types, layer_type) if config.pp > 1 else 0.0
    p2p_s = p2p_time(boundary_bytes, config, cluster) if config.pp > 1 else 0.0
    return CostTable(layer_names=layer_names, layer_type=layer_type,
                     types=tuple(types), p2p_s=p2p_s, boundary_bytes=boundary_bytes,
                     chunk_overhead_s=2 * fixed_costs.pipeline_action_s(config.pp, cluster),
                     rank_fixed_s=fixed_costs.grad_norm_all_reduce_s(config.gpus, cluster),  # every rank, cp's too
                     keeps_outputs=keeps_stage_outputs(config.engine))


def _layer_options(graph, cluster, config, layer, meshes, recompute_options, layer_cost, cache) -> list:
    """Every (mesh, recompute) option of one layer type: a mesh whose tp the layer can split and
    whose dp divides the stage's samples (and, under Ulysses, whose heads split over the cp ranks),
    each priced once per the shared `cache`."""
    options = []
    holds_shared = bool(layer.shared_params) and config.pp > 1
    samples_per_stage = config.microbatch_size * config.dp
    for tp, dp in meshes:
        if not layer.tp_split.max_degree_ok(tp) or samples_per_stage % dp:
            continue
        if layer.kind == "block" and config.cp_method == ULYSSES and ulysses_head_problem(
                graph.info.num_heads, graph.info.num_kv_heads, tp, config.cp, ""):
            continue  # a layerwise tp whose heads Ulysses cannot split over the cp ranks
        local = _mesh_config(config, layer, tp, dp, holds_shared, cache)
        # Recomputation is for blocks; the embedding and head always keep their activations.
        for recompute in (("none",) if layer.kind in ("embedding", "head") else recompute_options):
            index = (id(layer), local, recompute, holds_shared, tp, dp)
            option = cache.get(index)
            if option is None:
                run = local if local.recompute == recompute else _variant(local, cache, recompute=recompute)
                cost = layer_cost(layer, run, cluster, graph.info, profile_dtype=graph.dtype,
                                  attention=graph.attention, holds_shared=holds_shared)
                share = weight_grad_share(layer, graph.seq, graph.attention)
                option = cache[index] = option_from_layer_cost(recompute, cost, tp, dp, share)
            options.append(option)
    return options
