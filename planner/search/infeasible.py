"""When no plan fits: the leanest memory any candidate reaches, and the request that would fit
(bigger devices or more GPUs), in one line."""
from __future__ import annotations

import math
from dataclasses import replace

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.search.candidates import enumerate_candidates, usable_memory_bytes
from meshplan.planner.search.candidates import MEMORY_MARGIN
from meshplan.planner.search.problems import build_problems
from meshplan.planner.search.request import PlanRequest
from meshplan.planner.search.solving import Ready, solve_candidates


class NothingFits(MeshplanError):
    """The search's refusal when no candidate fits in memory (what `search.offloading` answers by
    offloading model states to host memory)."""


def min_memory_bytes(graph, cluster, candidates, global_batch, precision, pins, workers=1) -> float:
    """Smallest per-rank peak memory any memory-lean candidate reaches (ILP minimising the peak).

    Per mesh only the memory-lean variants are tried: the smallest micro-batch, no interleaving
    (it holds more micro-batches), a schedule the search offers unpinned (GPipe, which holds every
    micro-batch, is offered only when pinned), SP whenever tp > 1; all ZeRO stages (ZeRO-3 gathers whole
    layers into a transient buffer, so it is not always the leanest).
    """
    lean = {}
    for c in candidates:
        key = (c.tp, c.pp, c.dp, c.zero)
        if c.virtual_stages == 1 and c.schedule_spec.searched and (c.sp or c.tp == 1 or pins.sp is False):
            if key not in lean or c.microbatch_size < lean[key].microbatch_size:
                lean[key] = c
    chosen = sorted(lean.values(), key=lambda c: c.sort_key)
    problems, _, _ = build_problems(graph, cluster, chosen, global_batch, precision, pins, math.inf, False, 20.0)
    problems = [Ready(p.candidate, p.bound_s, replace(p.exact_problem(), objective="memory", mem_limit_bytes=None))
                for p in problems]
    solved = solve_candidates(problems, num_keep=len(problems) + 1, workers=workers)
    peaks = [s.solution.objective_s for s in solved if s.solution is not None and s.solution.feasible]
    return min(peaks) if peaks else math.inf



def infeasible_message(graph, request: PlanRequest, candidates) -> str:
    """Why no candidate of `request` fits (`request.PlanRequest`), and what would."""
    cluster, gpus, global_batch = request.planning_cluster, request.gpus, request.global_batch
    precision, pins = request.precision, request.pins
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
    more = _smallest_gpu_count(graph, request, limit)
    if more:
        text += f"; or use at least {more} GPUs (--gpus {more})"
    elif math.isfinite(need):
        text += "; no larger GPU count on this cluster fits either"
    return text + (" (or relax the pins)" if any(v is not None for v in vars(pins).values()) else "")



def _smallest_gpu_count(graph, request: PlanRequest, limit: float) -> int | None:
    """The smallest GPU count (doubling from the request's, up to the cluster) with a plan that fits."""
    cluster, global_batch, precision, pins = (request.planning_cluster, request.global_batch, request.precision,
                                              request.pins)
    capacity = cluster.gpus_per_node * cluster.max_nodes
    count = request.gpus * 2
    for _ in range(12):
        if count > capacity:
            return None
        candidates = enumerate_candidates(graph, cluster, count, global_batch, pins, request.max_mbs, precision,
                                          request.engine, request.fp8_recipe)
        if candidates and min_memory_bytes(graph, cluster, candidates, global_batch, precision, pins) <= limit:
            return count
        count *= 2
    return None
