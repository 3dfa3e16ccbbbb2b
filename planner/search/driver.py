"""The outer search of `meshplan plan`: candidates, pruning, parallel ILP solves, re-ranking.

1. Enumerate the uniform choices DESIGN.md's executable plan space allows (`enumerate_candidates`):
   mesh (pp, dp, tp) with tp inside a node and dividing the heads, micro-batch size (its count
   m >= pp), schedule (1F1B; interleaved with v virtual stages; GPipe only when pinned, since with
   the same layer assignment it is never faster and holds more activations), ZeRO stage 0-3, and
   sequence parallelism when tp > 1. Pins fix any of them.
2. Build each candidate's cost table (`planner.costing.tables`) and a lower bound on its ILP
   objective from compute alone (perfectly balanced stages with every layer at its fastest
   option). Candidates are solved in order of that bound, in batches over a process pool; before
   each batch, every candidate whose bound cannot beat the `num_rerank`-th best objective found so
   far is pruned without building its ILP. Batches keep the result independent of timing.
3. The best `num_rerank` solutions are re-ranked by the simulator (`planner.simulation.simulator`); the
   winner is the fastest simulated plan that fits, the runners-up become the plan's alternatives.
"""
from __future__ import annotations

import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from meshplan.planner.contracts.config import RECOMPUTE, SCHEDULES, ParallelConfig
from meshplan.planner.costing.tables import CostTable, build_cost_table
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.search.ilp.formulation import PipelineShape, StageProblem, StageSolution, solve_stages

# Interleaving deeper than this rarely pays (each extra virtual stage adds transfers) and its
# ILPs, with up to pp*v chunks, are the slowest to prove optimal. Pin --vpp for more.
MAX_VIRTUAL_STAGES = 4
# Candidates solved between two pruning decisions: fixed, so the result does not depend on the
# number of worker processes.
SOLVE_BATCH = 4
MEMORY_MARGIN = 1e-3
# Time-limited solves among the re-ranked candidates, if further than this from optimal, get
# this many times the limit once more.
POLISH_GAP = 0.01
POLISH_FACTOR = 2


@dataclass(frozen=True)
class Pins:
    """Choices the user fixed (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    zero: int | None = None
    recompute: str | None = None
    sp: bool | None = None
    schedule: str | None = None
    vpp: int | None = None
    mbs: int | None = None

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "vpp", "mbs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise MeshplanError(f"--{name} must be a positive integer, got {value!r}")
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise MeshplanError(f"--zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise MeshplanError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise MeshplanError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")


@dataclass(frozen=True)
class Candidate:
    """One outer choice; the ILP then places layers and picks recomputation."""

    tp: int
    pp: int
    dp: int
    mbs: int
    zero: int
    sp: bool
    schedule: str
    vpp: int = 1

    def config(self, gpus: int, global_batch: int, precision: str, recompute: str = "none") -> ParallelConfig:
        return ParallelConfig(gpus=gpus, global_batch=global_batch, tp=self.tp, pp=self.pp, dp=self.dp,
                              microbatch_size=self.mbs, zero=self.zero, recompute=recompute, sp=self.sp,
                              schedule=self.schedule, virtual_stages=self.vpp, precision=precision)

    def num_microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mbs)

    @property
    def sort_key(self) -> tuple:
        return (self.pp, self.tp, self.dp, self.mbs, self.zero, self.sp, self.schedule, self.vpp)

    def label(self) -> str:
        sched = f"interleaved x{self.vpp}" if self.schedule == "interleaved" else self.schedule
        return (f"pp={self.pp} dp={self.dp} tp={self.tp}{' +sp' if self.sp else ''}, {sched}, "
                f"mbs {self.mbs}, ZeRO-{self.zero}")


# Model families the executor runs whole on every rank (pp = tp = 1).
WHOLE_MODEL_FAMILIES = ("file", "hf")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(graph, cluster, gpus: int, global_batch: int, pins: Pins = Pins(),
                         max_mbs: int = 16) -> list[Candidate]:
    """Every outer candidate of the executable plan space that satisfies the pins, sorted."""
    info = graph.info
    split_layers = [layer.tp_split for layer in graph.layers]
    num_layers = len(graph.layers)
    # File and Hugging Face models run whole on every rank (data parallelism only): the executor
    # can split neither their layers into stages nor their Linears over TP ranks.
    whole_model_only = info.family in WHOLE_MODEL_FAMILIES
    out = []
    for tp in _divisors(gpus):
        # TP groups tile a node (as `estimate` requires) and every layer must split tp ways.
        if cluster.gpus_per_node % tp or (pins.tp and tp != pins.tp):
            continue
        if not all(split.max_degree_ok(tp) for split in split_layers):
            continue
        if info.num_heads and (info.num_heads % tp or (info.num_kv_heads or info.num_heads) % tp):
            continue
        if whole_model_only and tp > 1:
            continue
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if (whole_model_only and pp > 1) or pp > num_layers or (pins.pp and pp != pins.pp) or (pins.dp and dp != pins.dp):
                continue
            if global_batch % dp:
                continue
            for mbs in _divisors(global_batch // dp):
                if (mbs > max_mbs and pins.mbs is None) or (pins.mbs and mbs != pins.mbs):
                    continue
                m = global_batch // (dp * mbs)
                if pp > 1 and m < pp:
                    continue
                for schedule, vpp in _schedules(pp, m, num_layers, pins):
                    for zero in (0, 1, 2, 3):
                        if pins.zero is not None and zero != pins.zero:
                            continue
                        for sp in ((False, True) if tp > 1 else (False,)):
                            if pins.sp is not None and sp != pins.sp:
                                continue
                            out.append(Candidate(tp, pp, dp, mbs, zero, sp, schedule, vpp))
    return sorted(out, key=lambda c: c.sort_key)


def _schedules(pp: int, m: int, num_layers: int, pins: Pins) -> list[tuple[str, int]]:
    if pp == 1:
        ok = pins.schedule in (None, "1f1b", "gpipe") and pins.vpp in (None, 1)
        return [(pins.schedule or "1f1b", 1)] if ok else []
    wanted = pins.schedule or ("interleaved" if pins.vpp and pins.vpp > 1 else None)
    out = []
    if wanted in (None, "1f1b") and pins.vpp in (None, 1):
        out.append(("1f1b", 1))
    if wanted == "gpipe" and pins.vpp in (None, 1):
        out.append(("gpipe", 1))
    rounds = max(1, m // pp)
    if wanted in (None, "interleaved") and m % pp == 0 and m % rounds == 0:
        for vpp in range(2, max(MAX_VIRTUAL_STAGES, pins.vpp or 0) + 1):
            if pp * vpp <= num_layers and (vpp == pins.vpp or (pins.vpp is None and vpp <= MAX_VIRTUAL_STAGES)):
                out.append(("interleaved", vpp))
    return out


def usable_memory_bytes(cluster) -> float:
    return cluster.device.usable_memory_bytes


# --------------------------------------------------------------------------------------------
# Cost tables, bounds and parallel solving


def strategy_of(candidate: Candidate, precision: str):
    from meshplan.planner.costing.layer_costs import Strategy

    return Strategy(tp=candidate.tp, dp=candidate.dp, zero=candidate.zero, sp=candidate.sp,
                    microbatch_size=candidate.mbs, precision=precision, pp=candidate.pp)


def lower_bound_s(table: CostTable, candidate: Candidate, num_microbatches: int) -> float:
    """No assignment of `table` to this pipeline can have a smaller ILP objective.

    sum_r T_r >= S (every layer at its fastest option, plus the transfers), T_max >= S / p, and the
    tail is at least the average per-rank optimizer + gather time.
    """
    pp, v = candidate.pp, candidate.vpp
    chunks = pp * v
    counts = _type_counts(table)
    total = sum(n * table.types[t].min_time_s() for t, n in counts.items()) + table.p2p_s * 2 * (chunks - 1)
    tail = sum(n * min(o.param_gather_s + o.optimizer_s for o in table.types[t].options) for t, n in counts.items())
    return (num_microbatches - 1 / v) * total / pp + total / v + tail / pp


def _type_counts(table: CostTable) -> dict[int, int]:
    counts: dict[int, int] = {}
    for t in table.layer_type:
        counts[t] = counts.get(t, 0) + 1
    return counts


def min_static_bytes(table: CostTable, pp: int) -> float:
    """Resident bytes of the least loaded rank can be no less than the average."""
    return sum(n * min(o.static_bytes for o in table.types[t].options) for t, n in _type_counts(table).items()) / pp


@dataclass(frozen=True)
class Solved:
    """A candidate with its ILP solution (or why it has none)."""

    candidate: Candidate
    lower_bound_s: float
    solution: StageSolution | None = None
    pruned: str = ""  # "", "bound", "memory"


def solve_candidates(problems: list[tuple[Candidate, float, StageProblem]], *, num_keep: int,
                     workers: int = 2, progress=None) -> list[Solved]:
    """Solve in order of lower bound, pruning against the `num_keep`-th best objective so far."""
    order = sorted(problems, key=lambda item: (item[1], item[0].sort_key))
    results: list[Solved] = []
    best: list[float] = []  # sorted objectives of feasible solutions
    batch_size = SOLVE_BATCH
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=_fork_context()) if workers > 1 else None
    try:
        index = 0
        while index < len(order):
            threshold = best[num_keep - 1] if len(best) >= num_keep else math.inf
            batch = []
            while index < len(order) and len(batch) < batch_size:
                candidate, bound, problem = order[index]
                index += 1
                if bound >= threshold:
                    results.append(Solved(candidate, bound, pruned="bound"))
                    _tick(progress)
                else:
                    batch.append((candidate, bound, problem))
            mapper = pool.map if pool is not None else map
            cutoff = threshold if math.isfinite(threshold) else None
            todo = [replace(b[2], cutoff_s=cutoff) for b in batch]
            for (candidate, bound, _), solution in zip(batch, mapper(solve_stages, todo)):
                results.append(Solved(candidate, bound, solution))
                if solution.feasible:
                    best = sorted(best + [solution.objective_s])
                _tick(progress)
    finally:
        if pool is not None:
            pool.shutdown()
    return results


def _fork_context():
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else methods[0])


def _tick(progress) -> None:
    if progress is not None:
        progress.update(1)


# --------------------------------------------------------------------------------------------
# The search


@dataclass(frozen=True)
class Ranked:
    """A solved candidate with its simulated prediction."""

    candidate: Candidate
    solution: StageSolution
    config: ParallelConfig
    recompute_of_layer: tuple[str, ...]
    prediction: object  # planner.contracts.prediction.Prediction
    tp_of_layer: tuple[int, ...] = ()
    dp_of_layer: tuple[int, ...] = ()
    table: CostTable | None = field(default=None, compare=False, repr=False)


def _check_executor_pins(graph, pins: Pins) -> None:
    """A pp or tp pin the executor cannot run for this model family is a user error."""
    if graph.info.family not in WHOLE_MODEL_FAMILIES:
        return
    for name in ("pp", "tp"):
        value = getattr(pins, name)
        if value not in (None, 1):
            raise MeshplanError(f"--{name} {value}: {graph.info.family} models train with data parallelism only "
                                f"(the executor cannot split them into pipeline stages or tensor-parallel "
                                f"shards); drop --{name} or use --{name} 1")


def search_plan(spec, cluster, gpus: int, global_batch: int, seq: int | None = None, *, pins: Pins | None = None,
                top_k: int = 5, precision: str | None = None, dtype: str | None = None, attention: str = "flash",
                layerwise: bool = False, time_limit_s: float = 2.5, seed: int = 0, workers: int = 2,
                num_rerank: int | None = None, max_mbs: int = 16, progress: bool = False, graph=None,
                **pin_kwargs):
    """The fastest plan that fits; see the module docstring. Pins may be given as keywords."""
    from meshplan.planner.simulation.estimator import DEFAULT_SEQ, default_precision
    from meshplan.planner.models.registry import default_seq
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.search.assembly import build_plan

    started = time.perf_counter()
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    pins = pins or Pins(**pin_kwargs)
    _check_request(cluster, gpus, global_batch, top_k)
    precision = precision or default_precision(cluster)
    if graph is None:
        from meshplan.planner.profiling.profiler import profile
        dtype = dtype or ("bf16" if precision == "bf16-mixed" else "fp32")
        graph = profile(spec, seq or default_seq(spec, DEFAULT_SEQ), batch=1, dtype=dtype, attention=attention)
    _check_executor_pins(graph, pins)
    candidates = enumerate_candidates(graph, cluster, gpus, global_batch, pins, max_mbs)
    if not candidates:
        raise MeshplanError(_no_candidate_message(graph, cluster, gpus, global_batch, pins))
    # The ILP plans against a hair less than the usable memory, so the simulator's replay of the
    # same plan (its own rounding of buffers and timing) still fits.
    limit = usable_memory_bytes(cluster) * (1 - MEMORY_MARGIN)
    problems, memory_pruned, tables = _problems(graph, cluster, candidates, global_batch, precision, pins,
                                                 limit, layerwise, time_limit_s)
    num_keep = num_rerank or max(2 * top_k, 6)
    bar = _progress_bar(len(candidates), progress)
    for _ in memory_pruned:
        _tick(bar)
    try:
        solved = solve_candidates(problems, num_keep=num_keep, workers=workers, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    solved += memory_pruned
    feasible = sorted((s for s in solved if s.solution is not None and s.solution.feasible),
                      key=lambda s: (s.solution.objective_s, s.candidate.sort_key))
    if not feasible:
        raise MeshplanError(infeasible_message(graph, cluster, gpus, global_batch, precision, pins,
                                               candidates, max_mbs))
    feasible = _polish(feasible, num_keep, {c: p for c, _, p in problems}, workers)
    ranked = [_simulate(graph, cluster, s, tables[s.candidate], gpus, global_batch, precision)
              for s in feasible[:num_keep]]
    ranked.sort(key=lambda r: (not r.prediction.fits, r.prediction.step_time_s, r.solution.objective_s,
                               r.candidate.sort_key))
    stats = {"num_candidates": len(candidates), "num_solved": sum(s.solution is not None for s in solved),
             "num_pruned_bound": sum(s.pruned == "bound" for s in solved),
             "num_pruned_memory": sum(s.pruned == "memory" for s in solved),
             "num_cutoff": sum(s.solution is not None and s.solution.status == "cutoff" for s in solved),
             "num_infeasible": sum(s.solution is not None and s.solution.status == "infeasible" for s in solved),
             "max_gap": max(s.solution.gap for s in feasible[:num_keep]),
             "search_time_s": time.perf_counter() - started}
    return build_plan(graph, cluster, ranked[:top_k], stats, seed=seed, layerwise=layerwise, limit_bytes=limit)


def _polish(feasible: list[Solved], num_keep: int, problems: dict, workers: int) -> list[Solved]:
    """Re-solve the candidates that will be re-ranked but stopped at the time limit further than
    POLISH_GAP from optimal, with POLISH_FACTOR times the limit and no cutoff."""
    stopped = [s for s in feasible[:num_keep] if s.solution.status == "time_limit" and s.solution.gap > POLISH_GAP]
    if not stopped:
        return feasible
    again = [(s.candidate, s.lower_bound_s,
              replace(problems[s.candidate], time_limit_s=problems[s.candidate].time_limit_s * POLISH_FACTOR))
             for s in stopped]
    better = {s.candidate: s for s in solve_candidates(again, num_keep=len(again) + 1, workers=workers)}
    out = []
    for item in feasible:
        new = better.get(item.candidate)
        keep_new = new is not None and new.solution.feasible and new.solution.objective_s <= item.solution.objective_s
        out.append(new if keep_new else item)
    return sorted(out, key=lambda s: (s.solution.objective_s, s.candidate.sort_key))


def _check_request(cluster, gpus: int, global_batch: int, top_k: int) -> None:
    for name, value in (("--gpus", gpus), ("--gbs", global_batch), ("--top", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MeshplanError(f"{name} must be a positive integer, got {value!r}")
    capacity = cluster.gpus_per_node * cluster.max_nodes
    if gpus > capacity:
        raise MeshplanError(f"--gpus {gpus} exceeds the {capacity} GPUs of cluster {cluster.name!r} "
                            f"({cluster.max_nodes} nodes x {cluster.gpus_per_node}); use at most {capacity}")


def _no_candidate_message(graph, cluster, gpus, global_batch, pins: Pins) -> str:
    return (f"no parallel configuration of {gpus} GPUs matches global batch {global_batch}, "
            f"{len(graph.layers)} layers, {cluster.gpus_per_node} GPUs per node and the pins "
            f"{ {k: v for k, v in vars(pins).items() if v is not None} }: tp must divide the heads and "
            f"stay inside a node, pp <= layers, dp must divide the batch and micro-batches >= pp; "
            "relax a pin or change --gpus/--gbs")


def _problems(graph, cluster, candidates, global_batch, precision, pins, limit, layerwise, time_limit_s):
    """Cost tables (shared between candidates with the same strategy) and ILP problems."""
    recompute_options = (pins.recompute,) if pins.recompute else RECOMPUTE
    table_cache: dict = {}
    tables: dict[Candidate, CostTable] = {}
    problems, pruned = [], []
    for candidate in candidates:
        strategy = strategy_of(candidate, precision)
        if strategy not in table_cache:
            meshes = _layerwise_meshes(candidate, graph) if layerwise else ()
            table = build_cost_table(graph, cluster, strategy, recompute_options, layerwise_meshes=meshes)
            if meshes:
                table = replace(table, reshard_s=_reshard_s(table, candidate, cluster))
            table_cache[strategy] = table
        table = tables[candidate] = table_cache[strategy]
        m = candidate.num_microbatches(global_batch)
        bound = lower_bound_s(table, candidate, m)
        if min_static_bytes(table, candidate.pp) > limit:
            pruned.append(Solved(candidate, bound, pruned="memory"))
            continue
        shape = PipelineShape(candidate.pp, m, candidate.vpp, candidate.schedule)
        problems.append((candidate, bound, StageProblem(table, shape, mem_limit_bytes=limit,
                                                        time_limit_s=time_limit_s)))
    return problems, pruned, tables


def _layerwise_meshes(candidate: Candidate, graph) -> tuple[tuple[int, int], ...]:
    """(tp, dp) pairs with the candidate's tp * dp that a layer may use in a layerwise plan."""
    per_stage = candidate.tp * candidate.dp
    return tuple((tp, per_stage // tp) for tp in _divisors(per_stage) if tp <= candidate.tp * 8)


def _reshard_s(table: CostTable, candidate: Candidate, cluster) -> float:
    """Moving one micro-batch's boundary activation between layouts inside a stage (all-to-all)."""
    from meshplan.planner.costing.collectives import all_gather_time_s

    group = candidate.tp * candidate.dp
    if group == 1:
        return 0.0
    size = max(o.output_bytes for t in table.types for o in t.options)
    return all_gather_time_s(size, group, cluster.link_for_group(group))


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="meshplan plan", unit="candidate", file=sys.stderr, leave=False)


def _simulate(graph, cluster, solved: Solved, table: CostTable, gpus, global_batch, precision) -> Ranked:
    from meshplan.planner.simulation.simulator import simulate_config

    solution = solved.solution
    options = [table.option(layer, index) for layer, index in enumerate(solution.option_of_layer)]
    recompute = tuple(o.recompute for o in options)
    counts = {r: recompute.count(r) for r in RECOMPUTE}
    default = max(RECOMPUTE, key=lambda r: counts[r])
    config = solved.candidate.config(gpus, global_batch, precision, recompute=default)
    degrees = tuple((o.tp, o.dp) for o in options)
    prediction = simulate_config(graph, cluster, config, chunk_of_layer=solution.chunk_of_layer,
                                 recompute_of_layer=recompute, degrees_of_layer=degrees)
    return Ranked(solved.candidate, solution, config, recompute, prediction,
                  tp_of_layer=tuple(o.tp for o in options), dp_of_layer=tuple(o.dp for o in options),
                  table=table)


# --------------------------------------------------------------------------------------------
# Infeasible requests: what would work


def min_memory_bytes(graph, cluster, candidates, global_batch, precision, pins, workers=1) -> float:
    """Smallest per-rank peak memory any memory-lean candidate reaches (ILP minimising the peak).

    Per mesh only the memory-lean variants are tried: the smallest micro-batch, no interleaving
    (it holds more micro-batches), SP whenever tp > 1; all ZeRO stages (ZeRO-3 gathers whole
    layers into a transient buffer, so it is not always the leanest).
    """
    lean = {}
    for c in candidates:
        key = (c.tp, c.pp, c.dp, c.zero)
        if c.vpp == 1 and c.schedule != "gpipe" and (c.sp or c.tp == 1 or pins.sp is False):
            if key not in lean or c.mbs < lean[key].mbs:
                lean[key] = c
    chosen = sorted(lean.values(), key=lambda c: c.sort_key)
    problems, _, _ = _problems(graph, cluster, chosen, global_batch, precision, pins, math.inf, False, 20.0)
    problems = [(c, b, replace(p, objective="memory", mem_limit_bytes=None)) for c, b, p in problems]
    solved = solve_candidates(problems, num_keep=len(problems) + 1, workers=workers)
    peaks = [s.solution.objective_s for s in solved if s.solution is not None and s.solution.feasible]
    return min(peaks) if peaks else math.inf


def infeasible_message(graph, cluster, gpus, global_batch, precision, pins, candidates, max_mbs) -> str:
    limit = usable_memory_bytes(cluster)
    reserved = cluster.device.reserved_memory_bytes
    need = min_memory_bytes(graph, cluster, candidates, global_batch, precision, pins)
    gib = 2.0 ** 30
    text = (f"no plan of {graph.spec!r} fits on {gpus} x {cluster.device.name} "
            f"({limit / gib:.3f} GiB usable per GPU) with global batch {global_batch}")
    if math.isfinite(need):
        need /= 1 - MEMORY_MARGIN  # what the planner must be given to accept that plan
        # Rounded up, so the figure printed is itself enough.
        text += (f"; the leanest plan needs {math.ceil(need / gib * 1000) / 1000:.3f} GiB per GPU, i.e. devices "
                 f"with at least {math.ceil((need + reserved) / gib * 1000) / 1000:.3f} GiB of memory")
    more = _smallest_gpu_count(graph, cluster, gpus, global_batch, precision, pins, max_mbs, limit)
    if more:
        text += f"; or use at least {more} GPUs (--gpus {more})"
    elif math.isfinite(need):
        text += "; no larger GPU count on this cluster fits either"
    return text + (" (or relax the pins)" if any(v is not None for v in vars(pins).values()) else "")


def _smallest_gpu_count(graph, cluster, gpus, global_batch, precision, pins, max_mbs, limit) -> int | None:
    """The smallest GPU count (doubling from `gpus`, up to the cluster) with a plan that fits."""
    capacity = cluster.gpus_per_node * cluster.max_nodes
    count = gpus * 2
    for _ in range(12):
        if count > capacity:
            return None
        candidates = enumerate_candidates(graph, cluster, count, global_batch, pins, max_mbs)
        if candidates and min_memory_bytes(graph, cluster, candidates, global_batch, precision, pins) <= limit:
            return count
        count *= 2
    return None
