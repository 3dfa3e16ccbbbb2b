"""The search's offloading hook: model states go to host memory only when asked (`--offload`) or
when nothing fits on the devices without it, and the plan says which.

Offloading trades step time for device memory (`costing.offload`: the CPU optimizer step and the
host transfers), so an unpinned search first plans without it; only when that finds nothing that
fits (`infeasible.NothingFits`) does it plan again with the optimizer's states offloaded, then
with the parameters too (ZeRO-3), and records why in the plan's `solver.offload`. A profile
without host bandwidths (the cpu profile: its device is the host) is never offloaded.

Offloaded states must fit in their nodes' host memory too (`costing.offload.host_fits`, the rule
the simulator's `fits` applies): `prune_host_memory` drops the candidates whose states cannot fit
however the ILP places the layers (the plan's `solver.num_pruned_host_memory`).
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.costing.offload import host_fits, host_state_bytes_per_node, usable_host_memory_bytes
from meshplan.planner.search.infeasible import NothingFits
from meshplan.planner.search.solving import Solved

# What an unpinned search tries, in order, when nothing fits without offloading.
FALLBACK_MODES = ("optimizer", "params")


def may_offload(request) -> bool:
    """Whether `request` (a `PlanRequest`) leaves offloading to the search and the profile can offload."""
    device = request.cluster.device
    return request.pins.offload is None and device.host_link_bw_bytes_per_s > 0 \
        and device.host_memory_bw_bytes_per_s > 0


def with_offload(candidates: list, offload: str | None) -> list:
    """The candidates with `offload` set (None or "none": as they are); "params" keeps ZeRO-3 only."""
    if offload in (None, "none"):
        return candidates
    return [replace(c, offload=offload) for c in candidates if offload != "params" or c.zero == 3]


def prune_host_memory(problems: list, tables, cluster) -> tuple[list, list]:
    """(the problems whose offloaded states can fit in host memory, the others as pruned `Solved`)."""
    kept, pruned = [], []
    usable = usable_host_memory_bytes(cluster)
    for problem in problems:
        candidate = problem.candidate
        if candidate.offload != "none":
            if not host_fits(least_host_bytes_per_node(tables.table_for(candidate), candidate, cluster), usable):
                pruned.append(Solved(candidate, problem.bound_s, pruned="host_memory"))
                continue
        kept.append(problem)
    return kept, pruned


def host_refusal(pruned: list, tables, cluster, spec: str) -> str:
    """The search's refusal when host memory pruned candidates (`prune_host_memory`) and none was left."""
    least = min(least_host_bytes_per_node(tables.table_for(s.candidate), s.candidate, cluster) for s in pruned)
    return (f"no plan of {spec!r} fits: {len(pruned)} candidate(s) fit on the GPUs only by offloading more model "
            f"states than their nodes' host memory holds (the leanest {least / 2**30:.1f} GiB on a node, "
            f"{usable_host_memory_bytes(cluster) / 2**30:.1f} GiB usable); use more nodes (ZeRO shards the "
            "offloaded states over all their data-parallel ranks), ZeRO-1 or higher, or offload the optimizer only")


def least_host_bytes_per_node(table, candidate, cluster) -> float:
    """A lower bound on `costing.offload.host_state_bytes_per_node` for any placement of the layers
    of `candidate` (`table`: its cost table): every layer's least offloaded bytes (over its options:
    layerwise plans' own tp and dp), held by each of its stage's gpus / pp GPUs, over the job's
    nodes; the heaviest node holds at least the average. One node or whole nodes: the layers
    spread evenly over the pipeline ranks, as the per-node rule sums them."""
    per_rank = sum(min(option.host_state_bytes for option in table.types[t].options)
                   for t in table.layer_type) / candidate.pp
    if candidate.gpus <= cluster.gpus_per_node or candidate.gpus % cluster.gpus_per_node == 0:
        return host_state_bytes_per_node([per_rank] * candidate.pp, candidate.gpus, cluster.gpus_per_node)
    return per_rank * candidate.gpus / -(-candidate.gpus // cluster.gpus_per_node)


def search_or_offload(search, request, **kwargs):
    """`search(request)` without offloading; when nothing fits, with each of `FALLBACK_MODES` the
    pins allow, the first plan that fits marked with why (`solver.offload`)."""
    try:
        return search(_pinned(request, "none"), **kwargs)
    except NothingFits as refusal:
        modes = [mode for mode in FALLBACK_MODES if mode != "params" or request.pins.zero in (None, 3)]
        for mode in modes:
            try:
                plan = search(_pinned(request, mode), **kwargs)
            except NothingFits:
                continue
            why = (f"nothing fits on the GPUs without offloading ({refusal}); offloading the "
                   f"{'optimizer states' if mode == 'optimizer' else 'parameters, gradients and optimizer states'} "
                   "to host memory fits")
            return replace(plan, solver={**plan.solver, "offload": why})
        raise NothingFits(f"{refusal}; offloading the optimizer or the parameters to host memory does not fit "
                          "either") from None


def _pinned(request, mode: str):
    return replace(request, pins=replace(request.pins, offload=mode))
