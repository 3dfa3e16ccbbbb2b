"""Cost of the collectives meshplan plans with, as NCCL runs them on nodes, NVLink and NIC rails.

Notation. A group of n ranks, `size` S bytes (all-reduce, broadcast: the buffer; all-gather: the
gathered output; reduce-scatter: the full input; all-to-all: each rank's send buffer). Its
placement: k ranks on each of N nodes (`Placement`; k is the fullest node). A node has R NICs
(`nics_per_node`, the rails). Per GPU and one direction:

    B_nv  = intra_node.bw * intra_node.efficiency      NVLink/NVSwitch port
    B_nic = inter_node.bw * inter_node.efficiency      one NIC
    m     = min(k, R)                                  rails the group's traffic spreads over
    B_net = m * B_nic                                  what leaves a node for the group
    B     = B_nv (N = 1),  B_nic (k = 1),  min(B_nv, B_net) otherwise

B is the bus bandwidth of a ring: NCCL builds one ring per channel, each leaving a node through a
different GPU and NIC, so a node sends 2 (n-1)/n * S per all-reduce over m rails at once, while
each GPU pushes the same volume through its NVLink port. A group of one rank per node (k = 1)
gets one NIC: the other ranks of its node are in other groups using the other rails. Latency is
charged per algorithm step, each step at the latency of the link it crosses (NCCL's tuner):
a ring all-reduce has 2 (n-1) steps of which 2 (N-1) cross nodes, so with alpha_nv, alpha_net
the intra- and inter-node latencies

    ring all-reduce      2 (n-1)/n * S/B + 2 (n-N) alpha_nv + 2 (N-1) alpha_net
    ring all-gather /
      reduce-scatter       (n-1)/n * S/B +   (n-N) alpha_nv +   (N-1) alpha_net
    ring broadcast                   S/B +   (n-N) alpha_nv +   (N-1) alpha_net  (pipelined)
    tree all-reduce      2 S/B + 2 ((k-1) alpha_nv + L(N) alpha_net)     L(x) = ceil(log2 x), L(1) = 0
                         (a chain inside each node, NCCL's double binary tree across nodes: each
                         half of the data climbs one tree and comes back down)
    tree broadcast       L(N) (alpha_net + S/B_nic) + L(k) (alpha_nv + S/B_nv)   (binomial, unpipelined)
    two-level all-reduce intra reduce-scatter + inter all-reduce on S/k + intra all-gather:
        intra  2 (k-1)/k * S/B_nv + 2 (k-1) alpha_nv                  (0 when k = 1)
        inter  the fastest of ring, tree and SHARP over N nodes on S/k bytes per rank, each
               rank getting B_net / k of the node's rails                (0 when N = 1)
    two-level reduce-scatter / all-gather
               (k-1)/k * S/B_nv + (k-1) alpha_nv + (N-1)/N * S/B_net + (N-1) alpha_net
    all-to-all (pairwise, all exchanges posted at once)
               max((k-1)/n * S/B_nv, k (n-k)/n * S/B_net) + [k > 1] alpha_nv + [N > 1] alpha_net
    send/recv  alpha + S/B of the one link crossed (`ClusterProfile.link_for_group`)

In-network reduction replaces a reduction phase where the profile enables it: NVLS (NVLink
SHARP, the NVSwitch sums) makes the intra phase S / (intra_node.bw * nvls.efficiency) + 2 alpha_nv,
SHARP (the IB switches sum) makes the inter all-reduce (S/k) / (m * inter_node.bw * sharp.efficiency / k)
+ 2 alpha_net: each rank sends its data once and receives the sum once. On one node the two-level
all-reduce is its intra phase alone (NVLS when enabled).

`algorithm="auto"` takes the fastest algorithm the collective has, as NCCL's tuner does: trees
win for small messages on many nodes, rings for bandwidth, two-level and NVLS where the switch
or the NVLink share pays. NCCL runs reduce-scatter, all-gather and all-to-all without a tree:
asking for one there costs the ring (all-to-all: its only algorithm).

The link-level functions (`all_reduce_time_s(size, n, link)` and the others) are the same
alpha-beta formulas on one link, every step at that link's latency: what a group on a single
level of the network pays, and what `meshplan calibrate` fits.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from meshplan.planner.contracts.cluster import COLLECTIVE_KINDS, ClusterProfile, LinkProfile

COLLECTIVES = COLLECTIVE_KINDS
ALGORITHMS = ("ring", "tree", "hierarchical", "auto")
LINK_ALGORITHMS = ("ring", "tree", "auto")


def _check(size_bytes: float, group_size: int, algorithm: str, known: tuple[str, ...] = LINK_ALGORITHMS) -> None:
    if size_bytes < 0 or not math.isfinite(size_bytes):
        raise ValueError(f"collective size must be a finite number of bytes >= 0, got {size_bytes!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"collective group size must be a positive integer, got {group_size!r}")
    if algorithm not in known:
        raise ValueError(f"collective algorithm must be one of {known}, got {algorithm!r}")


def _log2_ceil(group_size: int) -> int:
    return max(1, math.ceil(math.log2(group_size)))


def _levels(count: int) -> int:
    """Binary-tree depth over `count` members: L(1) = 0, L(x) = ceil(log2 x)."""
    return math.ceil(math.log2(count)) if count > 1 else 0


# ---------------------------------------------------------------------------------------------
# One link (every hop on the same link)

def all_reduce_time_s(size_bytes: float, group_size: int, link: LinkProfile, algorithm: str = "auto") -> float:
    """Time for every rank to hold the sum of `size_bytes` over `group_size` ranks."""
    _check(size_bytes, group_size, algorithm)
    if group_size == 1 or size_bytes == 0:
        return 0.0
    n, bw, alpha = group_size, link.bw_for("all_reduce"), link.latency_s
    ring = 2 * (n - 1) / n * size_bytes / bw + 2 * (n - 1) * alpha
    tree = 2 * size_bytes / bw + 2 * _log2_ceil(n) * alpha
    return {"ring": ring, "tree": tree, "auto": min(ring, tree)}[algorithm]


def all_gather_time_s(size_bytes: float, group_size: int, link: LinkProfile, algorithm: str = "auto") -> float:
    """Time to gather `size_bytes` in total (each rank contributes size/n). Ring only in NCCL."""
    _check(size_bytes, group_size, algorithm)
    if group_size == 1 or size_bytes == 0:
        return 0.0
    return _scatter_gather_ring_s("all_gather", size_bytes, group_size, link)


def reduce_scatter_time_s(size_bytes: float, group_size: int, link: LinkProfile, algorithm: str = "auto") -> float:
    """Time to reduce a `size_bytes` tensor and leave each rank its 1/n shard. Ring only in NCCL."""
    _check(size_bytes, group_size, algorithm)
    if group_size == 1 or size_bytes == 0:
        return 0.0
    return _scatter_gather_ring_s("reduce_scatter", size_bytes, group_size, link)


def _scatter_gather_ring_s(kind: str, size_bytes: float, n: int, link: LinkProfile) -> float:
    return (n - 1) / n * size_bytes / link.bw_for(kind) + (n - 1) * link.latency_s


def send_recv_time_s(size_bytes: float, link: LinkProfile) -> float:
    """Point-to-point transfer of `size_bytes` (pipeline activations or their gradients)."""
    _check(size_bytes, 2, "auto")
    if size_bytes == 0:
        return 0.0
    return link.latency_s + size_bytes / link.bw_for("send_recv")


# ---------------------------------------------------------------------------------------------
# A group placed on nodes

@dataclass(frozen=True)
class Placement:
    """Where a group's ranks sit: `ranks_per_node` (k, the fullest node) on `num_nodes` (N)."""

    num_ranks: int
    ranks_per_node: int
    num_nodes: int

    def __post_init__(self):
        for name in ("num_ranks", "ranks_per_node", "num_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"placement.{name} must be a positive integer, got {value!r}")
        if self.ranks_per_node * self.num_nodes < self.num_ranks or self.ranks_per_node > self.num_ranks \
                or self.num_nodes > self.num_ranks:
            raise ValueError(f"a group of {self.num_ranks} ranks cannot sit {self.ranks_per_node} per node on "
                             f"{self.num_nodes} nodes")


def group_placement(group_size: int, stride: int, gpus_per_node: int) -> Placement:
    """The placement of ranks 0, stride, 2 stride, ... (group_size of them) on nodes of
    `gpus_per_node` consecutive ranks, the order meshplan's mesh numbers them in."""
    for name, value in (("group size", group_size), ("stride", stride), ("gpus per node", gpus_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"collective {name} must be a positive integer, got {value!r}")
    if stride >= gpus_per_node:  # consecutive members are at least a node apart
        return Placement(group_size, 1, group_size)
    if gpus_per_node % stride == 0:
        per_node = gpus_per_node // stride
        return Placement(group_size, min(group_size, per_node), math.ceil(group_size / per_node))
    counts = Counter(rank * stride // gpus_per_node for rank in range(group_size))  # irregular stride
    return Placement(group_size, max(counts.values()), len(counts))


def bus_bandwidth_factor(kind: str, group_size: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth (busbw = factor * size / time)."""
    n = group_size
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n, "broadcast": 1.0, "send_recv": 1.0}
    if kind not in factors:
        raise ValueError(f"collective kind must be one of {COLLECTIVES}, got {kind!r}")
    return factors[kind]


def ring_steps(kind: str, placement: Placement) -> tuple[int, int]:
    """(steps, of which cross nodes) of the ring algorithm, as NCCL's tuner counts them."""
    n, nodes = placement.num_ranks, placement.num_nodes
    per_pass = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}
    if kind not in per_pass:
        raise ValueError(f"the ring algorithm runs {tuple(per_pass)}, not {kind!r}")
    return per_pass[kind] * (n - 1), per_pass[kind] * (nodes - 1)


@dataclass(frozen=True)
class _Fabric:
    """The bandwidths and latencies one placement sees (see the module docstring)."""

    nvlink_bw: float  # B_nv
    nic_bw: float  # B_nic
    rails: int  # m
    ring_bw: float  # B
    alpha_nv: float
    alpha_net: float

    @classmethod
    def of(cls, placement: Placement, cluster: ClusterProfile, kind: str) -> _Fabric:
        k, nodes = placement.ranks_per_node, placement.num_nodes
        nvlink_bw, nic_bw = cluster.intra_node.bw_for(kind), cluster.inter_node.bw_for(kind)
        rails = min(k, cluster.nics_per_node)
        ring_bw = nvlink_bw if nodes == 1 else nic_bw if k == 1 else min(nvlink_bw, rails * nic_bw)
        return cls(nvlink_bw, nic_bw, rails, ring_bw, cluster.intra_node.latency_s, cluster.inter_node.latency_s)

    def latency_s(self, steps: int, inter_steps: int) -> float:
        return (steps - inter_steps) * self.alpha_nv + inter_steps * self.alpha_net


def _ring_s(kind: str, size_bytes: float, placement: Placement, fabric: _Fabric) -> float:
    steps, inter_steps = ring_steps(kind, placement)
    volume = bus_bandwidth_factor(kind, placement.num_ranks) * size_bytes
    return volume / fabric.ring_bw + fabric.latency_s(steps, inter_steps)


def _intra_all_reduce_s(size_bytes: float, k: int, fabric: _Fabric, cluster: ClusterProfile) -> float:
    """All-reduce of `size_bytes` among the k ranks of one node: ring, or NVLS when enabled."""
    if k == 1:
        return 0.0
    ring = 2 * (k - 1) / k * size_bytes / fabric.nvlink_bw + 2 * (k - 1) * fabric.alpha_nv
    if not cluster.nvls.enabled:
        return ring
    nvls = size_bytes / (cluster.intra_node.bw_bytes_per_s * cluster.nvls.efficiency) + 2 * fabric.alpha_nv
    return min(ring, nvls)


def _inter_all_reduce_s(size_bytes: float, placement: Placement, fabric: _Fabric, cluster: ClusterProfile) -> float:
    """All-reduce of `size_bytes` per rank among one rank per node, the k ranks of a node
    sharing its m rails: ring, tree, or SHARP when enabled."""
    nodes, k = placement.num_nodes, placement.ranks_per_node
    if nodes == 1:
        return 0.0
    per_rank_bw = fabric.rails * fabric.nic_bw / k
    ring = 2 * (nodes - 1) / nodes * size_bytes / per_rank_bw + 2 * (nodes - 1) * fabric.alpha_net
    tree = 2 * size_bytes / per_rank_bw + 2 * _levels(nodes) * fabric.alpha_net
    best = min(ring, tree)
    if cluster.sharp.enabled:
        sharp_bw = fabric.rails * cluster.inter_node.bw_bytes_per_s * cluster.sharp.efficiency / k
        best = min(best, size_bytes / sharp_bw + 2 * fabric.alpha_net)
    return best


def _all_reduce_times_s(size_bytes: float, placement: Placement, fabric: _Fabric,
                        cluster: ClusterProfile) -> dict[str, float]:
    k, nodes = placement.ranks_per_node, placement.num_nodes
    tree = 2 * size_bytes / fabric.ring_bw + 2 * ((k - 1) * fabric.alpha_nv + _levels(nodes) * fabric.alpha_net)
    two_level = (_intra_all_reduce_s(size_bytes, k, fabric, cluster)
                 + _inter_all_reduce_s(size_bytes / k, placement, fabric, cluster))
    return {"ring": _ring_s("all_reduce", size_bytes, placement, fabric), "tree": tree, "hierarchical": two_level}


def _scatter_gather_times_s(kind: str, size_bytes: float, placement: Placement, fabric: _Fabric) -> dict[str, float]:
    k, nodes = placement.ranks_per_node, placement.num_nodes
    intra = (k - 1) / k * size_bytes / fabric.nvlink_bw + (k - 1) * fabric.alpha_nv
    inter = 0.0
    if nodes > 1:  # S/k per rank at B_net/k each: the k factors cancel
        inter = (nodes - 1) / nodes * size_bytes / (fabric.rails * fabric.nic_bw) + (nodes - 1) * fabric.alpha_net
    return {"ring": _ring_s(kind, size_bytes, placement, fabric), "hierarchical": intra + inter}


def _all_to_all_s(size_bytes: float, placement: Placement, fabric: _Fabric) -> float:
    n, k, nodes = placement.num_ranks, placement.ranks_per_node, placement.num_nodes
    intra_s = (k - 1) / n * size_bytes / fabric.nvlink_bw
    inter_s = k * (n - k) / n * size_bytes / (fabric.rails * fabric.nic_bw) if nodes > 1 else 0.0
    return max(intra_s, inter_s) + (fabric.alpha_nv if k > 1 else 0.0) + (fabric.alpha_net if nodes > 1 else 0.0)


def _broadcast_times_s(size_bytes: float, placement: Placement, fabric: _Fabric) -> dict[str, float]:
    k, nodes = placement.ranks_per_node, placement.num_nodes
    tree = (_levels(nodes) * (fabric.alpha_net + size_bytes / fabric.nic_bw)
            + _levels(k) * (fabric.alpha_nv + size_bytes / fabric.nvlink_bw))
    return {"ring": _ring_s("broadcast", size_bytes, placement, fabric), "tree": tree}


def algorithm_times_s(kind: str, size_bytes: float, placement: Placement, cluster: ClusterProfile) -> dict[str, float]:
    """{algorithm: seconds} of every algorithm `kind` has on this placement (module docstring)."""
    _check(size_bytes, placement.num_ranks, "auto", ALGORITHMS)
    if kind not in COLLECTIVES or kind == "send_recv":
        raise ValueError(f"collective kind must be one of {COLLECTIVES[:-1]}, got {kind!r}")
    if placement.num_ranks == 1 or size_bytes == 0:
        return {"ring": 0.0}
    fabric = _Fabric.of(placement, cluster, kind)
    if kind == "all_reduce":
        return _all_reduce_times_s(size_bytes, placement, fabric, cluster)
    if kind in ("all_gather", "reduce_scatter"):
        return _scatter_gather_times_s(kind, size_bytes, placement, fabric)
    if kind == "all_to_all":
        return {"pairwise": _all_to_all_s(size_bytes, placement, fabric)}
    return _broadcast_times_s(size_bytes, placement, fabric)


def group_collective_time_s(kind: str, size_bytes: float, placement: Placement, cluster: ClusterProfile,
                            algorithm: str = "auto") -> float:
    """Cost of one collective on a placed group: the named algorithm, or the fastest ("auto").
    An algorithm the collective does not have costs its ring (all-to-all: pairwise)."""
    _check(size_bytes, placement.num_ranks, algorithm, ALGORITHMS)
    times = algorithm_times_s(kind, size_bytes, placement, cluster)
    if algorithm == "auto":
        return min(times.values())
    return times.get(algorithm, times.get("ring", min(times.values())))


# The search costs the same collective for many candidates (a TP all-reduce for every dp and ZeRO
# stage, a DP reduction for every micro-batch size): answers are kept per cluster object (held by
# its entry, so its id cannot be reused while cached), cleared when the cache grows past a bound.
_TIMES: dict[tuple, tuple[ClusterProfile, float]] = {}
_TIMES_MAX_ENTRIES = 200_000


def collective_time_s(kind: str, size_bytes: float, group_size: int, cluster: ClusterProfile,
                      stride: int = 1, algorithm: str = "auto") -> float:
    """Cost of one collective over `group_size` ranks spaced `stride` apart in the rank order,
    placed on the cluster's nodes of `gpus_per_node` (`group_placement`). Send/recv crosses one
    link: NVLink when both ranks share a node, else one NIC."""
    key = (kind, size_bytes, group_size, id(cluster), stride, algorithm)
    entry = _TIMES.get(key)
    if entry is not None and entry[0] is cluster:
        return entry[1]
    seconds = _collective_time_s(kind, size_bytes, group_size, cluster, stride, algorithm)
    if len(_TIMES) >= _TIMES_MAX_ENTRIES:
        _TIMES.clear()
    _TIMES[key] = (cluster, seconds)
    return seconds


def _collective_time_s(kind: str, size_bytes: float, group_size: int, cluster: ClusterProfile,
                       stride: int, algorithm: str) -> float:
    if kind not in COLLECTIVES:
        raise ValueError(f"collective kind must be one of {COLLECTIVES}, got {kind!r}")
    _check(size_bytes, group_size, algorithm, ALGORITHMS)
    if kind == "send_recv":
        return send_recv_time_s(size_bytes, cluster.link_for_group(max(group_size, 2), stride))
    placement = group_placement(group_size, stride, cluster.gpus_per_node)
    return group_collective_time_s(kind, size_bytes, placement, cluster, algorithm)
