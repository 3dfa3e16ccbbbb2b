"""The outer search of `meshplan plan`: candidates, pruning, parallel ILP solves, re-ranking.

1. Enumerate the uniform choices of the executable plan space (`candidates.enumerate_candidates`);
   pins fix any of them.
2. Build each candidate's cost table (`planner.costing.tables`, `table_cache`) and a lower bound
   on its ILP objective from compute alone (perfectly balanced stages with every layer at its
   fastest option) (`problems`). Candidates are solved in order of that bound, in batches over a
   process pool; before each batch, every candidate whose bound cannot beat the `num_rerank`-th
   best objective found so far is pruned without building its ILP (`solving`). Batches keep the
   result independent of timing.
3. The best `num_rerank` solutions are re-ranked by the simulator (`planner.simulation.simulator`); the
   winner is the fastest simulated plan that fits, the runners-up become the plan's alternatives.

`search(request)` runs it for a `request.PlanRequest`; `search_plan(spec, cluster, gpus, ...)`
builds the request from keywords.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field, replace

from meshplan.planner.contracts.config import RECOMPUTE, ParallelConfig
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing.tables import CostTable
from meshplan.planner.search import alternatives
from meshplan.planner.search.candidates import (MEMORY_MARGIN, WHOLE_MODEL_FAMILIES, Pins, enumerate_candidates,
                                                usable_memory_bytes)
from meshplan.planner.search.ilp.formulation import StageSolution
from meshplan.planner.search.ilp.refine import refine_best
from meshplan.planner.search import offloading
from meshplan.planner.search.infeasible import NothingFits, infeasible_message
from meshplan.planner.search.problems import build_problems
from meshplan.planner.search.request import PlanRequest
from meshplan.planner.search.solving import Ready, Solved, can_win, tick, solve_candidates

# Time-limited solves among the re-ranked candidates, if further than this from optimal, get
# this many times the limit once more.
POLISH_GAP = 0.01
POLISH_FACTOR = 2


@dataclass(frozen=True)
class Ranked:
    """A solved candidate with its simulated prediction."""

    candidate: ParallelConfig
    solution: StageSolution
    config: ParallelConfig
    recompute_of_layer: tuple[str, ...]
    prediction: object  # planner.contracts.prediction.Prediction
    tp_of_layer: tuple[int, ...] = ()
    dp_of_layer: tuple[int, ...] = ()
    table: CostTable | None = field(default=None, compare=False, repr=False)


def _check_executor_pins(graph, pins: Pins) -> None:
    """A pp or tp pin the executor cannot run for this model family is a user error."""
    if graph.info.family == "hf" and pins.tp not in (None, 1):
        from meshplan.planner.simulation.estimator import check_tp_splits

        check_tp_splits(graph, pins.tp)  # a decoder layer of no known layout, or heads tp does not divide
    if graph.info.family not in WHOLE_MODEL_FAMILIES:
        return
    for name in ("pp", "tp"):
        value = getattr(pins, name)
        if value not in (None, 1):
            raise MeshplanError(f"--{name} {value}: {graph.info.family} models train with data parallelism only "
                                f"(the executor cannot split them into pipeline stages or tensor-parallel "
                                f"shards); drop --{name} or use --{name} 1")


def search_plan(spec, cluster, gpus: int, global_batch: int, seq: int | None = None, *, progress=False,
                graph=None, **options):
    """The fastest plan that fits: `search` of `PlanRequest.of(spec, cluster, gpus, global_batch,
    seq, **options)` (the request's other fields, and pins, by name: `top_k=3, tp=8`)."""
    return search(PlanRequest.of(spec, cluster, gpus, global_batch, seq, **options), progress=progress, graph=graph)


def search(request: PlanRequest, *, progress=False, graph=None, candidate_rows: list | None = None):
    """The fastest plan that fits; see the module docstring. `graph`: the model's profile, when
    the caller has it already. `candidate_rows`: a list that receives one row per enumerated
    candidate and how it left the search (`alternatives.candidate_rows`, for `plan --candidates-csv`).

    `progress`: False, True (a bar on stderr when it is a terminal) or fn(done, total) per candidate.
    """
    with collecting_rarely():
        return _search(request, progress, graph, candidate_rows)


# The garbage collector's thresholds during a search (CPython's default: 700, 10, 10).
SEARCH_GC_THRESHOLDS = (50_000, 50, 100)


@contextlib.contextmanager
def collecting_rarely():
    """CPython's cyclic garbage collector with `SEARCH_GC_THRESHOLDS` (the forked workers inherit
    them), the previous thresholds restored after. A search allocates millions of small objects
    that form no cycles (costs, bounds, schedule actions), and at the default thresholds every
    700 of them start a collection, and every 70,000 one that walks the whole heap of cost
    tables again: a quarter of a mixture-of-experts search's time. Cycles are still collected."""
    before = gc.get_threshold()
    gc.set_threshold(*SEARCH_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _search(request: PlanRequest, progress, graph, candidate_rows: list | None):
    from meshplan.planner.search.assembly import build_plan

    if offloading.may_offload(request):  # nothing fits on the devices alone: their states in host memory
        return offloading.search_or_offload(search, request, progress=progress, graph=graph,
                                            candidate_rows=candidate_rows)
    started = time.perf_counter()
    cluster, pins = request.planning_cluster, request.pins
    if graph is None:
        graph = _profile(request)
    _check_executor_pins(graph, pins)
    _check_expert_pin(graph, pins)
    _check_cp_method_pin(graph, pins)
    executor_limited: list = []  # layouts the engine meshplan leaves out because its executor does not run them
    candidates = offloading.with_offload(enumerate_candidates(
        graph, cluster, request.gpus, request.global_batch, pins, request.max_mbs, request.precision, request.engine,
        request.fp8_recipe, left_out=executor_limited), pins.offload)
    candidates = _with_engine_settings(candidates, request, graph)
    if not candidates:
        raise MeshplanError(_no_candidate_message(graph, request))
    # The ILP plans against a hair less than the usable memory, so the simulator's replay of the
    # same plan (its own rounding of buffers and timing) still fits.
    limit = usable_memory_bytes(cluster) * (1 - MEMORY_MARGIN)
    problems, memory_pruned, tables = build_problems(graph, cluster, candidates, request.global_batch,
                                                     request.precision, pins, limit, request.layerwise,
                                                     request.time_limit_s, workers=request.workers)
    problems, host_pruned = offloading.prune_host_memory(problems, tables, cluster)  # their nodes' host memory
    memory_pruned += host_pruned
    num_keep = request.num_keep
    bar = _progress_bar(len(candidates), progress)
    for _ in memory_pruned:
        tick(bar)
    try:
        solved = solve_candidates(problems, num_keep=num_keep, workers=request.workers, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    solved += memory_pruned
    feasible = sorted((s for s in solved if s.solution is not None and s.solution.feasible),
                      key=lambda s: (s.solution.objective_s, s.candidate.sort_key))
    if not feasible:
        raise NothingFits(offloading.host_refusal(host_pruned, tables, cluster, graph.spec) if host_pruned
                          else infeasible_message(graph, request, candidates))
    feasible = _polish(feasible, request, {s.candidate: s.problem for s in solved if s.problem is not None})
    feasible = refine_best(feasible, num_keep, budget_s=request.time_limit_s / 5)  # the exact step of each, improved
    ranked = _rank_fitting(graph, request, feasible, tables, more=lambda: _solve_more(solved, problems, request))
    ep_rival = _ep_rival(graph, cluster, ranked, feasible, tables)
    simulated = {r.candidate: r.prediction for r in ranked}
    ranked = _distinct(graph, request, ranked, feasible, tables, simulated)
    conventional = _conventional(graph, request)
    if candidate_rows is not None:
        candidate_rows += alternatives.candidate_rows(candidates, solved, simulated, ranked[0].candidate,
                                                      [r.candidate for r in ranked[1:request.top_k]])
    stats = {**_search_stats(candidates, solved, feasible[:num_keep]), **({"ep_rival": ep_rival} if ep_rival else {}),
             **({"num_executor_limited": len(executor_limited)} if executor_limited else {}),
             "search_time_s": time.perf_counter() - started,
             **({"memory_headroom_bytes": request.memory_headroom_bytes} if request.memory_headroom_bytes else {})}
    return build_plan(graph, cluster, ranked[:request.top_k], stats, seed=request.seed, layerwise=request.layerwise,
                      limit_bytes=limit, conventional=conventional)


def _with_engine_settings(candidates: list, request: PlanRequest, graph) -> list:
    """The candidates with the request's engine settings, the same on every candidate where they
    apply: TP overlap where TP splits the sequence, combined 1F1B where the layout can run it; an
    fp8 filter on every one, less those the engine cannot run with it (`fp8_advice.filter_problem`)."""
    if request.grad_reduce_in_bf16:
        candidates = [replace(c, grad_reduce_in_bf16=True) for c in candidates]
    if request.cross_entropy_fusion != "none":
        candidates = [replace(c, cross_entropy_fusion=request.cross_entropy_fusion) for c in candidates]
    if request.recompute_early_stop is not None:  # what full recomputation reruns
        candidates = [replace(c, recompute_early_stop=request.recompute_early_stop) for c in candidates]
    if request.torch_compile:  # torchtitan's training.compile
        candidates = [replace(c, torch_compile=True) for c in candidates]
    if request.tp_comm_overlap is not None:
        candidates = [replace(c, tp_comm_overlap=request.tp_comm_overlap) if c.tp > 1 and c.sp else c
                      for c in candidates]
    if request.compile_loss is not None:  # after what compiles the model, whose default it sets apart from
        candidates = [replace(c, compile_loss=request.compile_loss) for c in candidates]
    if request.moe_a2a_overlap:  # Megatron-Core's combined 1F1B
        candidates = [replace(c, moe_a2a_overlap=True) if c.ep > 1 and c.a2a_overlap_problem() is None else c
                      for c in candidates]
    if request.fp8_filter:  # last: "fastest" judges each candidate as it runs, compiled and overlapped
        candidates = _with_fp8_filter(candidates, request, graph)
    return candidates


def _with_fp8_filter(candidates: list, request: PlanRequest, graph) -> list:
    """The candidates with the request's fp8 filter, where the engine can run it; under "fastest",
    one candidate per filter on each one's `fp8_advice.filter_path` (found once per distinct
    compute-time key), so the search prices them all. MeshplanError with the reason when the
    filter can run on none."""
    from meshplan.planner.contracts.fp8_choice import FP8_FASTEST_FILTER
    from meshplan.planner.costing.compute_time import compute_time_key
    from meshplan.planner.costing.fp8_advice import filter_path, filter_problem

    names = tuple(name for name in request.fp8_filter if name != FP8_FASTEST_FILTER)
    filtered = [replace(c, fp8_filter=names) for c in candidates]
    problems: dict[int, str | None] = {}  # it depends on the TP degree alone among what the candidates vary
    for c in filtered:
        if c.tp not in problems:
            problems[c.tp] = filter_problem(graph, c)
    kept = [c for c in filtered if problems[c.tp] is None]
    if filtered and not kept:
        raise MeshplanError(problems[filtered[0].tp])
    if len(names) == len(request.fp8_filter):
        return kept
    paths: dict[tuple, tuple] = {}
    out = []
    for c in kept:
        key = compute_time_key(c)
        if key not in paths:
            paths[key] = filter_path(graph, request.planning_cluster, c)
        out.extend(replace(c, fp8_filter=path) if path != names else c for path in paths[key])
    return out


def _distinct(graph, request: PlanRequest, ranked: list[Ranked], feasible: list[Solved], tables,
              simulated: dict) -> list[Ranked]:
    """The winner and the best plan of each other structure (`alternatives.structure`): the
    re-ranked ones, then the ILP's best of each structure not among them, simulated, until the
    plan has `top_k` entries. `simulated` gains every prediction made."""
    have = {alternatives.structure(r.config) for r in ranked}
    wanted = request.top_k - len(alternatives.best_per_structure(ranked, lambda r: r.config))
    extra = []
    for item in alternatives.best_per_structure(feasible, lambda s: s.candidate):
        if wanted <= 0:
            break
        if alternatives.structure(item.candidate) in have:
            continue
        more = _simulate(graph, request.planning_cluster, item, tables.table_for(item.candidate))
        simulated[item.candidate] = more.prediction
        extra.append(more)
        wanted -= 1
    others = sorted(ranked[1:] + extra, key=lambda r: (not r.prediction.fits, r.prediction.step_time_s,
                                                      r.solution.objective_s, r.candidate.sort_key))
    return alternatives.best_per_structure([ranked[0], *others], lambda r: r.config)


def _conventional(graph, request: PlanRequest):
    """The conventional layout beside an unpinned search of a dense model, when the executor runs
    it (the plan space offers nothing it cannot run); pins ask for a space of their own, and the
    rule is for dense transformers."""
    from meshplan.planner.costing.executable import model_facts, why_not_executable

    pins = {name: value for name, value in vars(request.pins).items()
            if (name, value) != ("offload", "none")}  # the offloading hook's first search is unpinned
    if graph.info.num_experts or any(value is not None for value in pins.values()):
        return None
    found = alternatives.conventional_layout(graph, request.planning_cluster, request.gpus, request.global_batch,
                                             request.precision, graph.info.family in WHOLE_MODEL_FAMILIES)
    return found if found is not None and why_not_executable(found.config, model_facts(graph), ()) is None else None


def _profile(request: PlanRequest):
    """The request's model profiled at its sequence length (the model's default when none)."""
    from meshplan.planner.models.registry import default_seq
    from meshplan.planner.profiling.profiler import profile
    from meshplan.planner.simulation.estimator import DEFAULT_SEQ

    dtype = request.dtype or ("fp32" if request.precision == "fp32" else "bf16")
    seq = default_seq(request.spec, DEFAULT_SEQ) if request.seq is None else request.seq
    return profile(request.spec, seq, batch=1, dtype=dtype, attention=request.attention,
                   moe_imbalance=request.moe_imbalance, moe_capacity_factor=request.moe_capacity_factor,
                   moe_pad_to_capacity=request.moe_pad_to_capacity, moe_dispatcher=request.moe_dispatcher,
                   mtp_num_layers=request.mtp_num_layers, engine=request.engine)


def _search_stats(candidates, solved: list[Solved], reranked: list[Solved]) -> dict:
    """The plan's solver counts: how each candidate left the search, and the re-ranked ones' largest gap."""
    return {"num_candidates": len(candidates), "num_solved": sum(s.solution is not None for s in solved),
            "num_pruned_bound": sum(s.pruned == "bound" for s in solved),
            "num_pruned_memory": sum(s.pruned == "memory" for s in solved),
            "num_pruned_memory_bound": sum(s.pruned == "memory_bound" for s in solved),
            "num_pruned_host_memory": sum(s.pruned == "host_memory" for s in solved),
            "num_pruned_expert_degree": sum(s.pruned == "expert_degree" for s in solved),
            "num_cutoff": sum(s.solution is not None and s.solution.status == "cutoff" for s in solved),
            "num_infeasible": sum(s.solution is not None and s.solution.status == "infeasible" for s in solved),
            "max_gap": max(s.solution.gap for s in reranked)}


def _rank_fitting(graph, request: PlanRequest, feasible: list[Solved], tables, more=None) -> list[Ranked]:
    """Simulate the best solutions in ILP order and rank them, fitting ones first by simulated step
    time. A plan is only written if the simulator says it fits: while none of the simulated ones
    does, the next `num_keep` are simulated too, and once the solved ones run out `more()` solves
    the next best of the candidates pruned so far; if none fits at all, the request is refused,
    naming the binding limit."""
    cluster, num_keep = request.planning_cluster, request.num_keep
    ranked: list[Ranked] = []
    start = 0
    while True:
        if start >= len(feasible):
            extra = more() if more is not None else []
            if not extra:
                break
            feasible = feasible + extra
        ranked += [_simulate(graph, cluster, s, tables.table_for(s.candidate))
                   for s in feasible[start:start + num_keep]]
        start += num_keep
        if any(r.prediction.fits for r in ranked):
            break
    ranked.sort(key=lambda r: (not r.prediction.fits, r.prediction.step_time_s, r.solution.objective_s,
                               r.candidate.sort_key))
    if not ranked[0].prediction.fits:
        leanest = min(ranked, key=lambda r: r.prediction.peak_memory_bytes)
        gib = 2.0 ** 30
        raise NothingFits(
            f"no plan of {graph.spec!r} that the ILP accepted fits when simulated: the leanest needs "
            f"{leanest.prediction.peak_memory_bytes / gib:.2f} GiB per GPU against "
            f"{cluster.device.usable_memory_bytes / gib:.2f} GiB usable on {cluster.device.name} (binding: "
            "memory per GPU); use more GPUs, a larger device, or pin --recompute full")
    return ranked


def _solve_more(solved: list[Solved], problems: list, request: PlanRequest) -> list[Solved]:
    """The next best solutions when none of those solved fits when simulated: the candidates that
    were pruned against the best objectives (a bound or the ILP's cutoff, not a memory proof) are
    searched again, pruned against their own `num_keep`-th best. `solved` is updated in place;
    returns the new feasible solutions in ILP order."""
    pending = {item.candidate: item for item in problems}
    again = [index for index, s in enumerate(solved)
             if s.candidate in pending and (s.pruned in ("bound", "memory_bound")
                                           or (s.solution is not None and s.solution.status == "cutoff"))]
    if not again:
        return []
    new = solve_candidates([pending[solved[index].candidate] for index in again], num_keep=request.num_keep,
                           workers=request.workers)
    by_candidate = {s.candidate: s for s in new}
    for index in again:
        solved[index] = by_candidate[solved[index].candidate]
    return sorted((s for s in new if s.solution is not None and s.solution.feasible),
                  key=lambda s: (s.solution.objective_s, s.candidate.sort_key))


def _polish(feasible: list[Solved], request: PlanRequest, problems: dict) -> list[Solved]:
    """Re-solve the candidates that will be re-ranked, stopped at the time limit further than
    POLISH_GAP from optimal and that may still win (`solving.can_win`), with POLISH_FACTOR times
    the limit and no cutoff."""
    best_s = feasible[0].solution.objective_s
    stopped = [s for s in feasible[:request.num_keep]
               if s.solution.status == "time_limit" and s.solution.gap > POLISH_GAP and can_win(s.solution, best_s)]
    if not stopped:
        return feasible
    again = [Ready(s.candidate, s.lower_bound_s,
                   replace(problems[s.candidate], time_limit_s=problems[s.candidate].time_limit_s * POLISH_FACTOR))
             for s in stopped]
    better = {s.candidate: s for s in solve_candidates(again, num_keep=len(again) + 1, workers=request.workers)}
    out = []
    for item in feasible:
        new = better.get(item.candidate)
        keep_new = new is not None and new.solution.feasible and new.solution.objective_s <= item.solution.objective_s
        out.append(new if keep_new else item)
    return sorted(out, key=lambda s: (s.solution.objective_s, s.candidate.sort_key))


def _no_candidate_message(graph, request: PlanRequest) -> str:
    pins = {k: v for k, v in vars(request.pins).items() if v is not None}
    return (f"no parallel configuration of {request.gpus} GPUs matches global batch {request.global_batch}, "
            f"{len(graph.layers)} layers, {request.cluster.gpus_per_node} GPUs per node and the pins "
            f"{pins}: tp must divide the heads and "
            f"stay inside a node, pp <= layers, dp must divide the batch and micro-batches >= pp, and "
            f"ZeRO-2/3 do not combine with pp > 1 and dp > 1 (torch's pipeline schedules run them as "
            f"ZeRO-1); relax a pin or change --gpus/--gbs")


def _check_expert_pin(graph, pins: Pins) -> None:
    """--ep N needs a mixture of experts whose expert count N divides, --etp M one whose experts'
    width M divides."""
    from meshplan.planner.costing.expert_parallel import check_expert_parallel

    if pins.ep not in (None, 1) or pins.etp not in (None, 1):
        try:
            check_expert_parallel(graph.info, pins.ep or 1, pins.etp)
        except ValueError as exc:
            flags = " ".join(f"--{name} {value}" for name, value in (("ep", pins.ep), ("etp", pins.etp))
                             if value is not None)
            raise MeshplanError(f"{flags}: {exc}") from None


def _check_cp_method_pin(graph, pins: Pins) -> None:
    """--cp N --cp-method M with --tp T: the split rule's reason when the three cannot go together."""
    from meshplan.planner.costing.executable import cp_split_problem, model_facts

    if (pins.cp or 1) > 1 and pins.cp_method and pins.tp:
        problem = cp_split_problem(model_facts(graph), pins.cp, f"--cp {pins.cp}", pins.cp_method, pins.tp)
        if problem:
            raise MeshplanError(problem)


def _ep_rival(graph, cluster, ranked: list[Ranked], feasible: list[Solved], tables) -> dict | None:
    """For a mixture of experts: the best fitting plan with another EP degree than the winner's
    (simulated already, or the ILP's best of the other degrees that were solved), for the plan's
    explanation."""
    if not graph.info.num_experts:
        return None
    ep = ranked[0].config.ep
    rival = next((r for r in ranked[1:] if r.config.ep != ep and r.prediction.fits), None)
    label = None
    if rival is None:
        other = next((s for s in feasible if s.candidate.ep != ep), None)
        if other is not None:
            rival = _simulate(graph, cluster, other, tables.table_for(other.candidate))
        elif ep > 1:  # no other degree was solved (pruned by bound): the winner's own layout at ep 1
            rival = replace(ranked[0], config=replace(ranked[0].config, ep=1), prediction=_at_expert_degree(
                graph, cluster, ranked[0], 1))
            label = replace(ranked[0].candidate, ep=1).label()
        if rival is None or not rival.prediction.fits:
            return None
    pred = rival.prediction
    return {"label": label or rival.candidate.label(), "basis": "same layout" if label else "best",
            "ep": rival.config.ep, "step_time_s": pred.step_time_s,
            "ep_comm_s": pred.breakdown.get("ep_comm", 0.0), "compute_s": pred.breakdown.get("compute", 0.0),
            "expert_bytes": max((m.experts for m in pred.memory), default=0.0),
            "peak_memory_bytes": pred.peak_memory_bytes}


def _at_expert_degree(graph, cluster, winner: Ranked, ep: int):
    """The simulated step of the winner's assignment (stages, recomputation, degrees) at `ep`."""
    from meshplan.planner.simulation.simulator import simulate_config

    return simulate_config(graph, cluster, replace(winner.config, ep=ep), chunk_of_layer=winner.solution.chunk_of_layer,
                           recompute_of_layer=winner.recompute_of_layer,
                           degrees_of_layer=tuple(zip(winner.tp_of_layer, winner.dp_of_layer)) or None)


def _progress_bar(total: int, progress):
    """`progress`: False, True (a bar when stderr is a terminal) or fn(done, total); contracts.progress."""
    from meshplan.planner.contracts.progress import progress_reporter

    return progress_reporter(progress, total, "meshplan plan", "candidate")


def _simulate(graph, cluster, solved: Solved, table: CostTable) -> Ranked:
    from meshplan.planner.simulation.simulator import simulate_config

    solution = solved.solution
    options = [table.option(layer, index) for layer, index in enumerate(solution.option_of_layer)]
    recompute = tuple(o.recompute for o in options)
    counts = {r: recompute.count(r) for r in RECOMPUTE}
    default = max(RECOMPUTE, key=lambda r: counts[r])
    config = replace(solved.candidate, recompute=default)
    degrees = tuple((o.tp, o.dp) for o in options)
    prediction = simulate_config(graph, cluster, config, chunk_of_layer=solution.chunk_of_layer,
                                 recompute_of_layer=recompute, degrees_of_layer=degrees)
    return Ranked(solved.candidate, solution, config, recompute, prediction,
                  tp_of_layer=tuple(o.tp for o in options), dp_of_layer=tuple(o.dp for o in options),
                  table=table)




