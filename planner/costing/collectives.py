"""Alpha-beta cost of the collectives meshplan plans with (ring and tree algorithms).

For a group of n ranks on a link of latency alpha (s per hop) and effective bandwidth
B = bw * efficiency (bytes/s per rank, one direction), with `size_bytes` the full tensor:

    ring all-reduce       2 (n-1)/n * size/B + 2 (n-1) alpha     (reduce-scatter then all-gather)
    ring all-gather         (n-1)/n * size/B +   (n-1) alpha     (size = gathered output)
    ring reduce-scatter     (n-1)/n * size/B +   (n-1) alpha     (size = full input)
    tree all-reduce       2 * size/B + 2 ceil(log2 n) alpha      (NCCL double binary tree: each
                                                                  half of the data climbs one tree)
    broadcast (pipelined)   size/B + (n-1) alpha  (ring) or ceil(log2 n) (alpha + size/B) (tree)
    send/recv               alpha + size/B

`algorithm="auto"` takes the faster of ring and tree, as NCCL's tuner does: trees win for small
messages on large groups, rings for bandwidth. The link is the slowest one the group crosses:
`ClusterProfile.link_for_group(n, stride)` (NVLink inside a node, the fabric across nodes).
"""
from __future__ import annotations

import math

from meshplan.planner.contracts.cluster import ClusterProfile, LinkProfile

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
ALGORITHMS = ("ring", "tree", "auto")


def _check(size_bytes: float, group_size: int, algorithm: str) -> None:
    if size_bytes < 0 or not math.isfinite(size_bytes):
        raise ValueError(f"collective size must be a finite number of bytes >= 0, got {size_bytes!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"collective group size must be a positive integer, got {group_size!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"collective algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def _log2_ceil(group_size: int) -> int:
    return max(1, math.ceil(math.log2(group_size)))


def all_reduce_time_s(size_bytes: float, group_size: int, link: LinkProfile, algorithm: str = "auto") -> float:
    """Time for every rank to hold the sum of `size_bytes` over `group_size` ranks."""
    _check(size_bytes, group_size, algorithm)
    if group_size == 1 or size_bytes == 0:
        return 0.0
    n, bw, alpha = group_size, link.effective_bw_bytes_per_s, link.latency_s
    ring = 2 * (n - 1) / n * size_bytes / bw + 2 * (n - 1) * alpha
    tree = 2 * size_bytes / bw + 2 * _log2_ceil(n) * alpha
    return {"ring": ring, "tree": tree, "auto": min(ring, tree)}[algorithm]


def all_gather_time_s(size_bytes: float, group_size: int, link: LinkProfile, algorithm: str = "auto") -> float:
    """Time to gather `size_bytes` in total (each rank contributes size/n). Ring only in NCCL."""
    _check(size_bytes, group_size, algorithm)
    if group_size == 1 or size_bytes == 0:
        return 0.0
    n = group_size
    return (n - 1) / n * size_bytes / link.effective_bw_bytes_per_s + (n - 1) * link.latency_s


def reduce_scatter_time_s(size_bytes: float, group_size: int, link: LinkProfile, algorithm: str = "auto") -> float:
    """Time to reduce a `size_bytes` tensor and leave each rank its 1/n shard. Ring only in NCCL."""
    return all_gather_time_s(size_bytes, group_size, link, algorithm)


def broadcast_time_s(size_bytes: float, group_size: int, link: LinkProfile, algorithm: str = "auto") -> float:
    """Time to copy `size_bytes` from one rank to all others (pipelined ring or binary tree)."""
    _check(size_bytes, group_size, algorithm)
    if group_size == 1 or size_bytes == 0:
        return 0.0
    bw, alpha = link.effective_bw_bytes_per_s, link.latency_s
    ring = size_bytes / bw + (group_size - 1) * alpha
    tree = _log2_ceil(group_size) * (alpha + size_bytes / bw)
    return {"ring": ring, "tree": tree, "auto": min(ring, tree)}[algorithm]


def send_recv_time_s(size_bytes: float, link: LinkProfile) -> float:
    """Point-to-point transfer of `size_bytes` (pipeline activations or their gradients)."""
    _check(size_bytes, 2, "auto")
    if size_bytes == 0:
        return 0.0
    return link.latency_s + size_bytes / link.effective_bw_bytes_per_s


def collective_time_s(kind: str, size_bytes: float, group_size: int, cluster: ClusterProfile,
                      stride: int = 1, algorithm: str = "auto") -> float:
    """Cost of one collective over `group_size` ranks spaced `stride` apart in the rank order.

    The link is the slowest the group crosses: a group whose span fits in one node runs on
    NVLink, otherwise on the inter-node fabric.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"collective kind must be one of {COLLECTIVES}, got {kind!r}")
    link = cluster.link_for_group(max(group_size, 2 if kind == "send_recv" else 1), stride)
    if kind == "send_recv":
        return send_recv_time_s(size_bytes, link)
    function = {"all_reduce": all_reduce_time_s, "all_gather": all_gather_time_s,
                "reduce_scatter": reduce_scatter_time_s, "broadcast": broadcast_time_s}[kind]
    return function(size_bytes, group_size, link, algorithm)
