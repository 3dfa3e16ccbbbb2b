"""The outer candidates of the search: every uniform `ParallelConfig` of the executable plan space
that the user's pins allow.

Mesh (pp, dp, cp, tp) with tp inside a node and dividing the heads, cp (context parallelism) for
sequences long enough to split (`context_parallel_degrees`), micro-batch size (its count
m >= pp), schedule and virtual stages (what each schedule's description accepts and offers to the
search, `contracts.schedule`: 1F1B, interleaved with v = 2..4, the zero-bubble schedules; GPipe
only when pinned, since with the same layer assignment it is never faster and holds more
activations), ZeRO stage 0-3, and
sequence parallelism when tp > 1 (not for Hugging Face models), and for ZeRO 1-3 HSDP shard groups of 1, 2 or 4 whole nodes;
for mixtures of experts, the folded expert layout (`expert_layouts`): expert tensor parallelism
etp = tp or 1, and expert parallelism `ep` over powers of two dividing tp * cp * dp / etp and the
expert count. ZeRO-2/3 are not offered with a split-backward
(zero-bubble) schedule and dp > 1: its reduction is deferred to the step's end, so they run as
ZeRO-1 (`costing.state_memory.executed_zero`).
"""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.contracts.axes import AXIS_NAMES, degrees_base
from meshplan.planner.contracts.config import (CP_METHODS, DEFAULT_CP_METHOD, ENGINE_CP_METHODS, NO_PIPELINE_ENGINES,
                                               OFFLOAD, RECOMPUTE, SCHEDULES, ParallelConfig, moe_sp_problem,
                                               tp_sp_problem)
from meshplan.planner.contracts.engine_rules import SEQUENCE_SPLIT_ENGINES
from meshplan.planner.contracts.schedule import SCHEDULE_SPECS
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import is_mtp_layer
from meshplan.planner.costing.executable import (NO_SEQUENCE_SPLIT_FAMILIES, WHOLE_MODEL_FAMILIES, cp_split_problem,
                                                 model_facts, moe_refuses_sp, tp_split_problem,
                                                 why_not_executable)
from meshplan.planner.costing.state_memory import executed_zero


# Interleaving deeper than this rarely pays (each extra virtual stage adds transfers) and its
# ILPs, with up to pp*v chunks, are the slowest to prove optimal. Pin --vpp for more.
MAX_VIRTUAL_STAGES = 4



@dataclass(frozen=True, kw_only=True)
class Pins(degrees_base("PinnedDegrees", lambda axis: None)):
    """Choices the user fixed (None: searched): a degree per axis of `contracts.axes` (tp, pp,
    dp, cp, ep: expert parallelism, carved out of dp * cp) and the fields below."""

    zero: int | None = None
    recompute: str | None = None
    sp: bool | None = None
    schedule: str | None = None
    vpp: int | None = None
    mbs: int | None = None
    shard_group: int | None = None  # HSDP shard group; pinning it implies ZeRO >= 1
    offload: str | None = None  # model states in host memory (`search.offloading`); None: only if nothing fits
    cp_method: str | None = None  # how CP ranks attend when cp > 1 (`contracts.config.CP_METHODS`)

    def __post_init__(self):
        for name in (*AXIS_NAMES, "vpp", "mbs", "shard_group"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise MeshplanError(f"--{name} must be a positive integer, got {value!r}")
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise MeshplanError(f"--zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise MeshplanError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise MeshplanError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.offload is not None and self.offload not in OFFLOAD:
            raise MeshplanError(f"--offload must be one of {', '.join(OFFLOAD)}, got {self.offload!r}")
        if self.offload == "params" and self.zero not in (None, 3):
            raise MeshplanError(f"--offload params needs the parameters sharded: pin --zero 3, not {self.zero}")
        if self.shard_group is not None and self.zero == 0:
            raise MeshplanError(f"--shard-group {self.shard_group} (HSDP) shards ZeRO state: pin --zero 1, 2 or 3")
        if self.cp_method is not None and self.cp_method not in CP_METHODS:
            raise MeshplanError(f"--cp-method must be one of {', '.join(CP_METHODS)}, got {self.cp_method!r}")



def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, from its prime factors: trial division to sqrt(n), not a loop to n."""
    if n < 1:
        raise ValueError(f"divisors of a positive integer only, got {n}")
    found = [1]
    rest, prime = n, 2
    while prime * prime <= rest:
        power = 0
        while rest % prime == 0:
            rest //= prime
            power += 1
        found = [d * prime**k for d in found for k in range(power + 1)]
        prime += 1 if prime == 2 else 2
    if rest > 1:
        found += [d * rest for d in found]
    return sorted(found)



def enumerate_candidates(graph, cluster, gpus: int, global_batch: int, pins: Pins = Pins(),
                         max_mbs: int | None = None, precision: str = "bf16-mixed",
                         engine: str = "meshplan", fp8_recipe: str | None = None,
                         left_out: list | None = None) -> list[ParallelConfig]:
    """Every outer candidate of the plan space of the engine that runs it which satisfies the
    pins, sorted, each priced with `engine`'s memory recipe: for engine "meshplan" the space
    meshplan's executor runs (what `train` runs); for another engine every layout the cost model
    prices (the plan is exported to that engine: an executor-only limit, such as a Hugging Face
    mixture of experts trained without expert parallelism, would cost it the layouts that engine
    runs best; the plan says why `train` refuses it).

    A candidate is a `ParallelConfig` with recompute "none": the ILP then picks each layer's
    recomputation and stage. Micro-batch sizes go up to the samples per replica (`max_mbs`
    limits them; the search prunes those memory cannot hold, `problems.build_problems`).
    `left_out`, when given, receives the candidates only meshplan's executor's limits kept out.
    """
    facts = model_facts(graph)
    options = (graph, cluster, gpus, global_batch, pins, max_mbs, precision, engine, fp8_recipe, facts)
    # SP under TP, which meshplan's executor refuses for a mixture of experts at every layout, is never made
    # for it; the other engines run it (Megatron-LM requires it with TP and EP)
    out = _enumerate(*options, refused_sp=engine != "meshplan")
    # meshplan's default space is what its executor runs; only pins that leave nothing else keep
    # the rest, and the plan then says why `train` refuses it (`costing.executable`).
    runnable = [c for c in out if why_not_executable(c, facts) is None] if engine == "meshplan" else out
    if not runnable and engine == "meshplan":  # another engine's space has the refused SP candidates already
        out = _enumerate(*options, refused_sp=True)
    elif left_out is not None and len(runnable) < len(out):
        kept = set(runnable)
        left_out.extend(c for c in out if c not in kept)
    return sorted(runnable or out, key=lambda c: c.sort_key)


def _enumerate(graph, cluster, gpus: int, global_batch: int, pins: Pins, max_mbs: int | None, precision: str,
               engine: str, fp8_recipe: str | None, facts, refused_sp: bool) -> list[ParallelConfig]:
    """`enumerate_candidates` before the executor's refusals, `refused_sp`: with the SP candidates
    `costing.executable.moe_refuses_sp` refuses (every expert layout of them)."""
    info = graph.info
    # chunks hold at least one layer each, and the multi-token-prediction depths share the output
    # layer's chunk (`CostTable.last_chunk_layers`, `costing.uniform`): a pipeline of more chunks
    # than that has no assignment, so none is posed
    num_layers = len(graph.layers) - sum(map(is_mtp_layer, graph.layers))
    sequence_split = info.family not in NO_SEQUENCE_SPLIT_FAMILIES
    moe = info.num_experts > 0  # the engine may refuse it under TP without SP (`moe_sp_problem`)
    out = []
    layouts: dict[tuple[int, int], list] = {}  # (tp, dp * cp) -> the engine's expert_layouts there
    # (tp, cp, mbs, sp) -> the CP methods not searched there (`dominated_cp_methods`); precision
    # and engine are the call's. A pinned method is searched whatever dominates it.
    dominated: dict[tuple, frozenset[str]] = {}
    for tp, pp, cp, dp in _mesh_shapes(gpus, global_batch, cluster, pins, facts, info.family, sequence_split,
                                       num_layers, engine):
        sp_splits = ((sequence_split or engine in SEQUENCE_SPLIT_ENGINES)
                     and (refused_sp or not moe_refuses_sp(facts, tp)))
        if (tp, dp * cp) not in layouts:
            layouts[tp, dp * cp] = [(etp, ep) for etp, ep in expert_layouts(info, tp, dp * cp, pins)
                                    if not (engine in NO_PIPELINE_ENGINES and ep > 1)]
        methods = [method for method in cp_methods(facts, tp, cp, pins.cp_method)
                   if method in ENGINE_CP_METHODS.get(engine, CP_METHODS)]
        pairs = [(layout, method) for layout in layouts[tp, dp * cp] for method in methods]
        for mbs, schedule, vpp in _batch_shapes(global_batch, dp, pp, num_layers, max_mbs, pins, engine):
            for zero, sp, group in _state_shardings(tp, pp, cp, dp, schedule, cluster, pins, engine, moe, sp_splits):
                for (etp, ep), method in pairs:
                    if method in dominated.get((tp, cp, mbs, sp), ()):
                        continue
                    out.append(ParallelConfig(gpus=gpus, global_batch=global_batch, tp=tp, pp=pp, dp=dp, cp=cp,
                                              microbatch_size=mbs, zero=zero, sp=sp, schedule=schedule,
                                              virtual_stages=vpp, precision=precision, shard_group=group, ep=ep,
                                              etp=etp, engine=engine, fp8_recipe=fp8_recipe, cp_method=method))
                    if len(methods) > 1 and (tp, cp, mbs, sp) not in dominated:
                        # decided once per (tp, cp, mbs, sp), before the other axes multiply it
                        dominated[tp, cp, mbs, sp] = dominated_cp_methods(graph, cluster, out[-1])
                        if out[-1].cp_method in dominated[tp, cp, mbs, sp]:
                            out.pop()
    return out


def _mesh_shapes(gpus: int, global_batch: int, cluster, pins: Pins, facts, family: str, sequence_split: bool,
                 num_layers: int, engine: str):
    """(tp, pp, cp, dp) the search poses: TP groups tile a node (as `estimate` requires) and every
    layer splits tp ways; a pipeline has no more stages than layers; the data ranks divide the batch.
    File models run whole on every rank (data parallelism only): the executor can split neither
    their layers into stages nor their Linears over TP ranks. Hugging Face models pipeline at
    their decoder layers and split the layers whose layout is known (`models.hf_tp`)."""
    whole_model_only = family in WHOLE_MODEL_FAMILIES
    for tp in divisors(gpus):
        if cluster.gpus_per_node % tp or (pins.tp and tp != pins.tp):
            continue
        if tp_split_problem(facts, tp) or (tp > 1 and whole_model_only):
            continue
        for pp in divisors(gpus // tp):
            for cp in context_parallel_degrees(facts, gpus // (tp * pp), pins.cp, not sequence_split):
                dp = gpus // (tp * pp * cp)
                if (whole_model_only and pp > 1) or pp > num_layers or (pins.pp and pp != pins.pp) \
                        or (pins.dp and dp != pins.dp):
                    continue
                if engine in NO_PIPELINE_ENGINES and pp * cp > 1:  # FSDP engines without pipelines or CP
                    continue
                if global_batch % dp == 0:
                    yield tp, pp, cp, dp


def _batch_shapes(global_batch: int, dp: int, pp: int, num_layers: int, max_mbs: int | None, pins: Pins,
                  engine: str):
    """(micro-batch size, schedule, virtual stages) of one data rank's batch: a pipeline needs at
    least as many micro-batches as stages."""
    for mbs in divisors(global_batch // dp):
        if (max_mbs is not None and mbs > max_mbs and pins.mbs is None) or (pins.mbs and mbs != pins.mbs):
            continue
        m = global_batch // (dp * mbs)
        if pp > 1 and m < pp:
            continue
        for schedule, vpp in _schedules(pp, m, num_layers, pins, engine):
            yield mbs, schedule, vpp


def _state_shardings(tp: int, pp: int, cp: int, dp: int, schedule: str, cluster, pins: Pins, engine: str,
                     moe: bool, sp_splits: bool):
    """(ZeRO stage, SP, shard group): the stages that run as themselves (`executed_zero`: one that
    runs as ZeRO-1 buys nothing), SP where TP can split the sequence (`sp_splits`)."""
    for zero in (0, 1, 2, 3):
        if (pins.zero is not None and zero != pins.zero) or executed_zero(zero, dp * cp, pp, schedule) != zero:
            continue
        for sp in _sp_options(tp, engine, moe, sp_splits):
            if pins.sp is not None and sp != pins.sp:
                continue
            for group in shard_groups(dp, tp * cp, zero, cluster.gpus_per_node, pins.shard_group):
                yield zero, sp, group


def _sp_options(tp: int, engine: str, moe: bool, splits: bool) -> tuple[bool, ...]:
    """SP off and on where TP can split the sequence (`splits`: the family allows it and meshplan's
    executor, when it runs the plan, does not refuse it); an engine that trains a mixture of experts
    under TP only with SP (`config.moe_sp_problem`) gets SP alone, for any family: that engine, not
    meshplan's executor, splits the sequence."""
    if tp == 1:
        return (False,)
    if moe_sp_problem(engine, tp, False, moe) or tp_sp_problem(engine, tp, False):
        return (True,)
    return (False, True) if splits else (False,)


# HSDP shard groups the search offers span this many whole nodes (NCCL's fast intra-node or
# few-node reduce-scatter, one cross-replica all-reduce of 1/N of the gradient). Pin others.
HSDP_NODES = (1, 2, 4)


def shard_groups(dp: int, tp: int, zero: int, gpus_per_node: int, pinned: int | None) -> list[int | None]:
    """HSDP options of one mesh: None (shard over all dp ranks) and shard groups of whole nodes."""
    if pinned is not None:
        return [None] if pinned == dp else ([pinned] if zero >= 1 and dp % pinned == 0 and pinned > 1 else [])
    out: list[int | None] = [None]
    if zero == 0 or dp == 1:
        return out
    for nodes in HSDP_NODES:
        group, rest = divmod(nodes * gpus_per_node, tp)
        if not rest and 1 < group < dp and dp % group == 0:
            out.append(group)
    return out


# Context parallelism pays a K/V exchange per layer for attention over shorter local sequences;
# below this many tokens per rank the exchange outweighs what it saves, so the search does not
# offer it (pin --cp to evaluate one anyway).
MIN_TOKENS_PER_CP_RANK = 2048


def context_parallel_degrees(model, ranks: int, pinned: int | None, whole_model_only: bool) -> list[int]:
    """CP degrees for `ranks` = gpus / (tp * pp): 1, and powers of two that divide ranks, split
    `model`'s attention (`costing.executable.cp_split_problem`: every sequence in 2*cp equal
    chunks) and leave each rank MIN_TOKENS_PER_CP_RANK tokens. `model`: a `ModelFacts`."""
    if pinned is not None:
        ok = ranks % pinned == 0 and (pinned == 1 or (not cp_split_problem(model, pinned) and not whole_model_only))
        return [pinned] if ok else []
    out = [1]
    if whole_model_only:
        return out
    cp = 2
    while ranks % cp == 0 and not cp_split_problem(model, cp) and model.seq // cp >= MIN_TOKENS_PER_CP_RANK:
        out.append(cp)
        cp *= 2
    return out


def cp_methods(model, tp: int, cp: int, pinned: str | None) -> list[str]:
    """How the ranks of a cp > 1 candidate attend (`contracts.config.CP_METHODS`): the pinned
    method, or each method that splits `model`'s attention (`costing.executable.cp_split_problem`:
    Ulysses where cp divides the heads per tensor-parallel rank). cp = 1: the default alone."""
    if cp == 1:
        return [DEFAULT_CP_METHOD]
    methods = CP_METHODS if pinned is None else (pinned,)
    return [method for method in methods if not cp_split_problem(model, cp, method=method, tp=tp)]


def dominated_cp_methods(graph, cluster, config: ParallelConfig) -> frozenset[str]:
    """The CP methods not worth searching at `config`'s tp, cp, micro-batch, SP and precision:
    another method's blocking exchange is no slower and keeps no more bytes under every
    recomputation mode (the ILP picks the mode per layer), so it makes every plan at least as fast
    within the same memory (the methods change nothing else of a layer; a tie keeps the earlier
    method of `CP_METHODS`). Read from a block's `LayerCost`, as the ILP and the simulator read it."""
    from dataclasses import replace

    from meshplan.planner.costing.layer_cost import layer_cost

    block = next((layer for layer in graph.layers if layer.kind == "block"), None)
    if config.cp == 1 or block is None:
        return frozenset()
    methods = [m for m in CP_METHODS if not cp_split_problem(model_facts(graph), config.cp, method=m, tp=config.tp)]
    if len(methods) < 2:
        return frozenset()
    figures = {}
    for method in methods:
        costs = [layer_cost(block, replace(config, cp_method=method, recompute=mode), cluster, graph.info,
                            profile_dtype=graph.dtype, attention=graph.attention) for mode in RECOMPUTE]
        figures[method] = [(c.cp_fwd_comm_s + c.cp_bwd_comm_s, c.activation_bytes) for c in costs]

    def dominates(better: str, worse: str) -> bool:
        no_worse = all(b[0] <= w[0] and b[1] <= w[1] for b, w in zip(figures[better], figures[worse]))
        return no_worse and (figures[better] != figures[worse] or methods.index(better) < methods.index(worse))

    return frozenset(m for m in methods if any(dominates(other, m) for other in methods if other != m))


def expert_layouts(info, tp: int, data_ranks: int, pins: Pins) -> list[tuple[int | None, int]]:
    """(etp, ep) of the MoE layers folded over a stage's tp * dp * cp ranks: etp = tp (None) or,
    for a mixture of experts under TP, 1 (Megatron-Core's usual folding, EP taking the TP ranks
    too); each with the EP degrees of `expert_parallel_degrees` over the tp * dp * cp / etp ranks.
    Dense models: (None, 1) alone.

    Unless etp is pinned, (etp = tp, ep > 1) is left out where (etp = 1, ep * tp) is offered: the
    same expert shards per rank, expert-data group and FLOPs per rank, over an EP group spanning the
    same ranks, but with tp times fewer dispatched bytes per rank (a tp group's tokens split over its
    ranks instead of each rank sending all of them; the slice all-gather moves 1/top_k of that) and
    tp times larger per-expert GEMMs (`costing.expert_parallel`): it is never slower and holds no more."""
    if pins.etp is not None:
        options = [pins.etp] if (tp * data_ranks) % pins.etp == 0 else []
    else:
        options = [tp] + ([1] if tp > 1 and info.num_experts else [])
    if any(etp > 1 and info.num_experts and info.expert_ffn % etp for etp in options):
        options = [etp for etp in options if etp == 1 or not info.num_experts or info.expert_ffn % etp == 0]
    layouts = [(etp, ep) for etp in options for ep in expert_parallel_degrees(info, tp * data_ranks // etp, pins.ep)]
    if pins.etp is None:
        # etp < tp without EP only replicates the experts over the tp ranks: offered when pinned
        folded = {ep for etp, ep in layouts if etp == 1 and ep > 1 and tp > 1}
        layouts = [(etp, ep) for etp, ep in layouts if (etp == tp and (ep == 1 or ep * tp not in folded))
                   or (etp < tp and ep > 1)]
    return [(None if etp == tp else etp, ep) for etp, ep in layouts]


def expert_parallel_degrees(info, data_ranks: int, pinned: int | None) -> list[int]:
    """EP degrees for the `data_ranks` they are carved from (tp * dp * cp / etp): 1 for dense models;
    for a mixture of experts the powers of two that divide both those ranks and the expert count (other divisors split
    the experts unevenly over nodes and are rarely used; pin --ep for one)."""
    if pinned is not None:
        return [pinned] if data_ranks % pinned == 0 and (pinned == 1 or (
            info.num_experts and info.num_experts % pinned == 0)) else []
    out = [1]
    ep = 2
    while info.num_experts and data_ranks % ep == 0 and info.num_experts % ep == 0:
        out.append(ep)
        ep *= 2
    return out


def _schedules(pp: int, m: int, num_layers: int, pins: Pins, engine: str = "meshplan") -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs for pp ranks and m micro-batches: those the schedule's
    description accepts (`Schedule.check`) with pp * v <= the layer count, v pinned or over
    the description's searched chunk counts (up to MAX_VIRTUAL_STAGES); unless --schedule names
    it, only where the search offers it (`Schedule.searched_at`: GPipe never, interleaved from 2
    chunks, ZB-V once m >= 2 pp - 1); only those the engine runs (`Schedule.runs_under`: a plan
    for Megatron-LM holds 1F1B or interleaved 1F1B, one for DeepSpeed 1F1B)."""
    out = []
    for spec in SCHEDULE_SPECS.values():
        pinned = pins.schedule == spec.name
        if (pins.schedule is not None and not pinned) or (pp > 1 and not spec.runs_under(engine)):
            continue
        chunks = [pins.vpp] if pins.vpp is not None else spec.searched_chunks(MAX_VIRTUAL_STAGES)
        for vpp in chunks:
            if (pp * vpp <= num_layers and spec.accepts(pp, m, vpp)
                    and (pinned or spec.searched_at(pp, m, vpp))):
                out.append((spec.name, vpp))
    return out



# The ILP plans against a hair less than the usable memory, so that the simulator's replay of the
# winner (a different summation order) fits too.
MEMORY_MARGIN = 1e-3


def usable_memory_bytes(cluster) -> float:
    return cluster.device.usable_memory_bytes
