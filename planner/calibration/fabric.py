"""The cluster a user really has: the topology they state, and the inter-node fabric fitted to
nccl-tests runs they import.

`meshplan calibrate` measures what one machine's processes can (compute, memory, the local link);
it cannot see the nodes it does not run on, nor their NICs. `apply_topology` writes the stated
node count, GPUs per node and NICs (rails) per node into the profile; `import_nccl_tests` fits
the inter-node link (one NIC's bandwidth, the fabric's latency per step) to `all_reduce_perf` /
`all_gather_perf` tables run across nodes (`planner.calibration.nccl_tests`), with the ring model
of `planner.costing.collectives`, so the profile prices multi-node groups as those runs measured.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

from meshplan.planner.calibration.fits import fit_inter_node_link
from meshplan.planner.calibration.nccl_tests import NcclTestsRun, read_nccl_tests
from meshplan.planner.contracts.cluster import ClusterProfile, LinkProfile
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing.collectives import Placement


def _positive(flag: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise MeshplanError(f"{flag} must be a positive integer, got {value!r}")


def check_topology(nodes: int | None = None, gpus_per_node: int | None = None, nics_per_node: int | None = None,
                   measured_ranks: int | None = None) -> None:
    """Refuse a stated topology that cannot be (before anything is measured).

    `measured_ranks`: processes the measurement runs on one node, which that node must hold.
    """
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--nics-per-node", nics_per_node)):
        _positive(flag, value)
    if gpus_per_node is not None and measured_ranks is not None and measured_ranks > gpus_per_node:
        raise MeshplanError(f"calibrate runs {measured_ranks} processes on this node, but --gpus-per-node says "
                            f"{gpus_per_node}; pass --gpus-per-node {measured_ranks} or more, or --nproc {gpus_per_node}")


def apply_topology(profile: ClusterProfile, nodes: int | None = None, gpus_per_node: int | None = None,
                   nics_per_node: int | None = None, measured_ranks: int | None = None) -> ClusterProfile:
    """The profile with the stated topology; what is not stated stays as it was."""
    check_topology(nodes, gpus_per_node, nics_per_node, measured_ranks)
    stated = {"max_nodes": nodes, "gpus_per_node": gpus_per_node, "nics_per_node": nics_per_node}
    stated = {name: value for name, value in stated.items() if value is not None}
    if not stated:
        return profile
    updated = replace(profile, **stated)
    words = (f"{updated.max_nodes} nodes x {updated.gpus_per_node} GPUs, {updated.nics_per_node} NICs per node "
             f"(stated: {', '.join(sorted(stated))})")
    return replace(updated, description=f"{profile.description}; topology {words}".lstrip("; "))


def _placement(run: NcclTestsRun, profile: ClusterProfile, stated_nodes: int | None) -> Placement:
    """Where the file's ranks ran: its `Rank ... on HOST` lines, else the whole stated cluster."""
    if run.num_ranks is not None:
        ranks, nodes = run.num_ranks, run.num_nodes
    elif stated_nodes is not None:
        ranks, nodes = stated_nodes * profile.gpus_per_node, stated_nodes
    else:
        raise MeshplanError(f"{run.path}: the file lists no '# Rank ... on HOST' lines; state where it ran with "
                            "--nodes and --gpus-per-node (the test is taken to span all of them)")
    if nodes < 2:
        raise MeshplanError(f"{run.path}: ran on one node; it measures NVLink, not the fabric between nodes: "
                            "import a run across 2 or more nodes")
    per_node = math.ceil(ranks / nodes)
    if per_node > profile.gpus_per_node:
        raise MeshplanError(f"{run.path}: {per_node} ranks per node, more than the profile's {profile.gpus_per_node} "
                            "GPUs per node; pass --gpus-per-node")
    return Placement(ranks, per_node, nodes)


def import_nccl_tests(profile: ClusterProfile, runs: list[NcclTestsRun | str | Path],
                      stated_nodes: int | None = None) -> tuple[ClusterProfile, list[str]]:
    """(profile with the fitted inter-node link, notes for the user) from nccl-tests outputs
    (parsed runs, or paths to read)."""
    runs = [run if isinstance(run, NcclTestsRun) else read_nccl_tests(run) for run in runs]
    samples, notes = [], []
    for run in runs:
        placement = _placement(run, profile, stated_nodes)
        samples += [(run.kind, size, seconds, placement) for size, seconds in run.samples]
        if placement.num_nodes == 2 and run.kind == "all_reduce":
            # NCCL's tree can beat the NICs on two nodes, so the fit may read faster NICs than the fabric has
            notes.append(f"{run.path}: 2 nodes; NCCL may have run a tree, which reads above the NICs: rerun "
                         "with NCCL_ALGO=Ring, or across 3 or more nodes, for the fabric's own figure")
    bw_bytes_per_s, latency_s = fit_inter_node_link(samples, profile)
    described = ", ".join(f"{Path(run.path).name} ({run.kind}, {len(run.samples)} sizes)" for run in runs)
    link = LinkProfile(bw_bytes_per_s=bw_bytes_per_s, latency_s=latency_s, efficiency=1.0,
                       source=f"one NIC: ring fit to nccl-tests {described} by meshplan calibrate on "
                              f"{time.strftime('%Y-%m-%d')} ({profile.nics_per_node} NICs per node)")
    return replace(profile, inter_node=link), notes
