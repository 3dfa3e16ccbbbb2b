"""The search's cost tables: one per distinct strategy, built at once (over a fork process pool
when there are many) or when the search first reaches a candidate that needs it (`TableCache`);
layerwise plans' per-layer meshes and their resharding cost."""
from __future__ import annotations

from dataclasses import replace
from functools import partial

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.collectives import all_gather_time_s
from meshplan.planner.costing.uniform import cost_config
from meshplan.planner.costing.tables import CostTable, build_cost_table, costed_config, stream_bytes
from meshplan.planner.search.candidates import divisors
from meshplan.planner.search.pool import worker_pool

# Below this many distinct strategies the tables are built in process (a pool costs more).
PARALLEL_TABLES_MIN = 400


class TableCache:
    """strategy -> CostTable: the tables built up front, and the others built on first use (with
    option costs shared between them, `tables.build_cost_table`'s cache). `table_for(candidate)`
    reads a candidate's table through the strategy `build_problems` recorded for it."""

    def __init__(self, graph, cluster, recompute_options: tuple[str, ...], built: dict):
        self._graph, self._cluster, self._recompute_options = graph, cluster, recompute_options
        self._tables = dict(built)
        self._option_costs: dict = {}
        # id(candidate) -> (candidate, strategy): by identity, as hashing every one of a search's
        # tens of thousands of candidates costs more than the few lookups (the solved ones) need
        self._strategy_of: dict[int, tuple[ParallelConfig, object]] = {}

    def record(self, candidate: ParallelConfig, strategy) -> None:
        """`candidate`'s table is `strategy`'s."""
        self._strategy_of[id(candidate)] = (candidate, strategy)

    def add(self, built: dict) -> None:
        """Tables built since (strategy -> CostTable)."""
        self._tables.update(built)

    def is_built(self, strategy) -> bool:
        return strategy in self._tables

    def get(self, strategy) -> CostTable:
        """The strategy's table, built now if it was left for later."""
        table = self._tables.get(strategy)
        if table is None:
            table = self._tables[strategy] = build_cost_table(self._graph, self._cluster, strategy,
                                                              self._recompute_options, cache=self._option_costs)
        return table

    def table_for(self, candidate: ParallelConfig) -> CostTable:
        """The table recorded for `candidate` (an equal configuration not recorded: its own strategy's)."""
        found = self._strategy_of.get(id(candidate))
        return self.get(found[1] if found is not None and found[0] is candidate else cost_config(candidate))


def strategies_of(candidates) -> list:
    """`cost_config` of every candidate, one object per distinct cost."""
    seen: dict = {}
    out = []
    for c in candidates:
        key = (c.tp, c.dp, c.zero, c.recompute, c.sp, c.microbatch_size, c.precision, c.pp, c.shard_group, c.cp, c.ep,
               c.etp, c.engine, c.offload, c.fp8_recipe, c.fp8_filter, c.recompute_modules, c.cp_method)
        strategy = seen.get(key)
        if strategy is None:
            strategy = seen[key] = cost_config(c)
        out.append(strategy)
    return out


def build_tables(graph, cluster, candidates, strategies, recompute_options, layerwise, workers) -> dict:
    """strategy -> CostTable for every candidate's strategy (`tables.build_cost_table`)."""
    jobs: dict = {}
    for candidate, strategy in zip(candidates, strategies):
        if strategy not in jobs:
            # per-layer degrees are for analysis of (tp, dp) meshes; context- and expert-parallel
            # candidates keep theirs
            jobs[strategy] = (layerwise_meshes(candidate, cluster)
                              if layerwise and candidate.cp == 1 and candidate.ep == 1 else ())
    todo = list(jobs.items())
    if workers > 1 and len(todo) >= PARALLEL_TABLES_MIN:
        todo.sort(key=_neighbour_key)
        built = _tables_over_pool(graph, cluster, todo, recompute_options, workers)
    else:
        built = _tables_of(graph, cluster, recompute_options, todo)
    out = {}
    for (strategy, meshes), table in zip(todo, built):
        if meshes:
            table = replace(table, reshard_s=reshard_s(table, strategy.tp * strategy.dp, cluster))
        out[strategy] = table
    return out


def _neighbour_key(job: tuple) -> tuple:
    """Strategies equal but for the expert layout (ep, etp), or for pp > 1, next to each other:
    they share their dense layers' costs, or all their layers' (`tables.build_cost_table`'s cache)."""
    strategy = job[0]
    return replace(costed_config(strategy), ep=1, etp=None).__repr__(), strategy.pp, strategy.ep, strategy.expert_tp


def _tables_over_pool(graph, cluster, todo: list, recompute_options, workers: int) -> list[CostTable]:
    """The tables of `todo` built in pieces over a fork pool; each piece's task carries the graph
    and cluster it builds from. What differs between tables comes back; names and layer types are
    the graph's."""
    size = -(-len(todo) // (2 * workers))
    pieces = [todo[start:start + size] for start in range(0, len(todo), size)]
    shared = build_cost_table(graph, cluster, todo[0][0], recompute_options, layerwise_meshes=todo[0][1])
    with worker_pool(workers) as pool:
        parts = list(pool.map(partial(_table_parts_of, graph, cluster, recompute_options), pieces))
    return [replace(shared, types=types, p2p_s=p2p_s, boundary_bytes=boundary_bytes, chunk_overhead_s=chunk_s,
                    rank_fixed_s=fixed_s)
            for piece in parts for types, p2p_s, boundary_bytes, chunk_s, fixed_s in piece]


def _tables_of(graph, cluster, recompute_options, jobs: list) -> list[CostTable]:
    cache: dict = {}  # option costs shared between tables (`tables.build_cost_table`)
    return [build_cost_table(graph, cluster, strategy, recompute_options, layerwise_meshes=meshes, cache=cache)
            for strategy, meshes in jobs]


def _table_parts_of(graph, cluster, recompute_options, jobs: list) -> list[tuple]:
    return [(t.types, t.p2p_s, t.boundary_bytes, t.chunk_overhead_s, t.rank_fixed_s)
            for t in _tables_of(graph, cluster, recompute_options, jobs)]


def layerwise_meshes(candidate: ParallelConfig, cluster) -> tuple[tuple[int, int], ...]:
    """(tp, dp) pairs with the candidate's tp * dp that a layer may use in a layerwise plan; TP
    groups stay inside a node, as everywhere else."""
    per_stage = candidate.tp * candidate.dp
    return tuple((tp, per_stage // tp) for tp in divisors(per_stage)
                 if tp <= candidate.tp * 8 and cluster.gpus_per_node % tp == 0)


def reshard_s(table: CostTable, stage_ranks: int, cluster) -> float:
    """One resharding of a micro-batch's boundary activation between two layers of one stage at
    different (tp, dp) in a layerwise plan: an all-gather over the stage's `stage_ranks` (tp * dp)
    ranks of the hidden stream (`tables.stream_bytes`). A layer with fewer data-parallel groups
    runs each group on more of the stage's samples, which its ranks gather from the groups
    before; the backward's reduce-scatter of the gradient moves as many bytes (the ILP charges a
    change of mesh twice, once each way)."""
    if stage_ranks == 1:
        return 0.0
    return all_gather_time_s(stream_bytes(table.types, table.layer_type), stage_ranks,
                             cluster.link_for_group(stage_ranks))
