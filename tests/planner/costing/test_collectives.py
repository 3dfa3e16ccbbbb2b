"""Topology-aware collectives (planner.costing.collectives): analytic cases against the formulas of
the module docstring, and nccl-tests bus bandwidths published for DGX A100 and DGX H100.

Bus bandwidth is nccl-tests' figure: busbw = factor * size / time, factor 2 (n-1)/n for all-reduce
(`bus_bandwidth_factor`), so a ring's busbw is the per-GPU bandwidth of its slowest hop.
"""
import tomllib
from dataclasses import replace

import pytest

from meshplan.planner.contracts.cluster import InNetworkReduction, LinkProfile, cluster_from_dict, dump_cluster_toml
from meshplan.planner.costing.collectives import (Placement, algorithm_times_s, all_reduce_time_s, bus_bandwidth_factor,
                                                  collective_time_s, group_collective_time_s, group_placement)
from meshplan.planner.costing.hardware import load_cluster

H100 = load_cluster("h100-sxm")
A100 = load_cluster("a100-80g")
BIG = 32e9  # 32 GB: latency is under 1% of the time at this size


def busbw(kind, size, n, seconds):
    return bus_bandwidth_factor(kind, n) * size / seconds


def plain(cluster, **changes):
    """The profile without in-network reduction (and any other change asked for)."""
    return replace(cluster, nvls=InNetworkReduction(), sharp=InNetworkReduction(), **changes)


# ---------------------------------------------------------------------------------------------
# Placement

@pytest.mark.parametrize("group_size, stride, ranks_per_node, num_nodes", [
    (8, 1, 8, 1),      # one full node
    (64, 1, 8, 8),     # eight full nodes
    (8, 8, 1, 8),      # one rank per node (a dp group across tp = 8)
    (16, 4, 2, 8),     # two per node (dp across tp = 4)
    (12, 1, 8, 2),     # a full node and half of one: the fuller node bounds
    (6, 3, 3, 2),      # ranks 0 3 6 | 9 12 15: a stride that does not divide the node
    (1, 1, 1, 1),
])
def test_group_placement_on_8_gpu_nodes(group_size, stride, ranks_per_node, num_nodes):
    assert group_placement(group_size, stride, 8) == Placement(group_size, ranks_per_node, num_nodes)


def test_placement_refuses_impossible_groups():
    with pytest.raises(ValueError, match="cannot sit 2 per node on 2 nodes"):
        Placement(8, 2, 2)
    with pytest.raises(ValueError, match="stride must be a positive integer, got 0"):
        group_placement(8, 0, 8)


def test_profiles_describe_rails_and_older_files_load_with_one_nic():
    assert (H100.nics_per_node, H100.nvls.enabled, H100.sharp.enabled) == (8, True, False)
    assert (A100.nics_per_node, A100.nvls.enabled) == (8, False)
    assert load_cluster("cpu").nics_per_node == 1
    data = tomllib.loads(dump_cluster_toml(H100))
    for key in ("nics_per_node", "nvls", "sharp"):  # a profile written before rails existed
        del data["topology"][key]
    old = cluster_from_dict(data)
    assert (old.nics_per_node, old.nvls.enabled, old.sharp.enabled) == (1, False, False)
    seconds = collective_time_s("all_reduce", BIG, 64, old)  # every group crosses nodes at one NIC
    assert busbw("all_reduce", BIG, 64, seconds) == pytest.approx(H100.inter_node.effective_bw_bytes_per_s, rel=1e-2)


# ---------------------------------------------------------------------------------------------
# Analytic cases

def test_full_node_group_runs_at_rails_times_nic_bandwidth():
    """64 GPUs in 8 full DGX H100 nodes: 8 rails at 50 GB/s x 0.85 (NVLink's 360 GB/s is faster).
    The NIC efficiency is set here, not read from the profile: the shipped one is fitted to
    NVIDIA's 47 GB/s per NIC (0.94), which makes the rails (376 GB/s) faster than NVLink, so the
    shipped profile's full-node ring is NVLink-bound (checked last)."""
    cluster = replace(H100, inter_node=replace(H100.inter_node, efficiency=0.85))
    seconds = collective_time_s("all_reduce", BIG, 64, cluster)
    rails_bw = cluster.nics_per_node * cluster.inter_node.bw_bytes_per_s * cluster.inter_node.efficiency
    assert rails_bw == pytest.approx(340e9)
    assert busbw("all_reduce", BIG, 64, seconds) == pytest.approx(rails_bw, rel=1e-2)
    times = algorithm_times_s("all_reduce", BIG, group_placement(64, 1, 8), cluster)
    assert min(times, key=times.get) == "ring"
    shipped_rails = H100.nics_per_node * H100.inter_node.effective_bw_bytes_per_s
    nvlink = H100.intra_node.effective_bw_bytes_per_s
    seconds = collective_time_s("all_reduce", BIG, 64, H100)
    assert busbw("all_reduce", BIG, 64, seconds) == pytest.approx(min(shipped_rails, nvlink), rel=2e-2)


def test_one_rank_per_node_gets_one_nic():
    """8 GPUs one per node (stride 8): each crossing is one NIC, 8x slower than the full nodes
    (at a NIC efficiency where the full nodes are rail-bound, not NVLink-bound: see above)."""
    seconds = collective_time_s("all_reduce", BIG, 8, H100, stride=8)
    nic_bw = H100.inter_node.effective_bw_bytes_per_s
    assert busbw("all_reduce", BIG, 8, seconds) == pytest.approx(nic_bw, rel=1e-2)
    cluster = replace(H100, inter_node=replace(H100.inter_node, efficiency=0.85))
    one_per_node = collective_time_s("all_reduce", BIG, 8, cluster, stride=8)
    full_nodes = collective_time_s("all_reduce", BIG, 64, cluster)
    assert one_per_node / full_nodes == pytest.approx(8 * (7 / 8) / (63 / 64), rel=1e-2)


def test_rails_bound_the_spread_and_the_default_is_one_nic():
    """k ranks per node spread over min(k, rails): 2 rails give 2 NICs; a profile that says
    nothing of rails (1, older files) keeps the single-NIC ring it always had."""
    two = plain(H100, nics_per_node=2)
    seconds = collective_time_s("all_reduce", BIG, 64, two, algorithm="ring")
    assert busbw("all_reduce", BIG, 64, seconds) == pytest.approx(2 * H100.inter_node.effective_bw_bytes_per_s, rel=1e-2)
    old = plain(H100, nics_per_node=1)
    seconds = collective_time_s("all_reduce", BIG, 64, old, algorithm="ring")
    assert busbw("all_reduce", BIG, 64, seconds) == pytest.approx(H100.inter_node.effective_bw_bytes_per_s, rel=1e-2)
    # two ranks per node (stride 4) use two of the eight rails
    seconds = collective_time_s("all_reduce", BIG, 16, H100, stride=4, algorithm="ring")
    assert busbw("all_reduce", BIG, 16, seconds) == pytest.approx(2 * H100.inter_node.effective_bw_bytes_per_s, rel=1e-2)


def test_nvlink_bounds_the_ring_when_the_rails_are_faster():
    fat = plain(H100, inter_node=replace(H100.inter_node, bw_bytes_per_s=400e9))
    seconds = collective_time_s("all_reduce", BIG, 64, fat, algorithm="ring")
    assert busbw("all_reduce", BIG, 64, seconds) == pytest.approx(H100.intra_node.effective_bw_bytes_per_s, rel=1e-2)


def test_ring_latency_is_per_step_at_the_link_each_step_crosses():
    """A tiny ring all-reduce over 8 nodes x 8: 2 (n-1) steps, 2 (N-1) of them across nodes."""
    cluster = plain(H100)
    size = 8.0
    seconds = collective_time_s("all_reduce", size, 64, cluster, algorithm="ring")
    alpha_nv, alpha_net = cluster.intra_node.latency_s, cluster.inter_node.latency_s
    bandwidth_s = 2 * 63 / 64 * size / 340e9
    assert seconds == pytest.approx(2 * (64 - 8) * alpha_nv + 2 * 7 * alpha_net + bandwidth_s)
    assert seconds < 2 * 63 * alpha_net  # every step at the fabric's latency was the old charge


def test_two_level_is_intra_plus_inter_terms():
    """Intra reduce-scatter + all-gather on NVLink, inter all-reduce of S/k per rank on its rail."""
    cluster = plain(A100)
    size, k, nodes = 1e9, 8, 4
    times = algorithm_times_s("all_reduce", size, Placement(k * nodes, k, nodes), cluster)
    b_nv, b_nic = cluster.intra_node.effective_bw_bytes_per_s, cluster.inter_node.effective_bw_bytes_per_s
    a_nv, a_net = cluster.intra_node.latency_s, cluster.inter_node.latency_s
    intra = 2 * (k - 1) / k * size / b_nv + 2 * (k - 1) * a_nv
    inter_ring = 2 * (nodes - 1) / nodes * (size / k) / b_nic + 2 * (nodes - 1) * a_net
    inter_tree = 2 * (size / k) / b_nic + 2 * 2 * a_net
    assert times["hierarchical"] == pytest.approx(intra + min(inter_ring, inter_tree))
    # reduce-scatter: one intra and one inter phase
    rs = algorithm_times_s("reduce_scatter", size, Placement(k * nodes, k, nodes), cluster)["hierarchical"]
    assert rs == pytest.approx((k - 1) / k * size / b_nv + (k - 1) * a_nv
                               + (nodes - 1) / nodes * size / (k * b_nic) + (nodes - 1) * a_net)


def test_tree_wins_small_messages_on_many_nodes_ring_large_ones():
    cluster = plain(H100)
    small = algorithm_times_s("all_reduce", 1e3, group_placement(4096, 1, 8), cluster)
    assert min(small, key=small.get) == "tree"
    assert small["tree"] == pytest.approx(2 * 1e3 / 340e9 + 2 * (7 * 6e-6 + 9 * 1.5e-5))
    large = algorithm_times_s("all_reduce", BIG, group_placement(64, 1, 8), cluster)
    assert min(large, key=large.get) == "ring"
    # at 4096 ranks the ring's 2 (n-1) steps cost more than its 1/n less volume saves, even at 32 GB
    huge = algorithm_times_s("all_reduce", BIG, group_placement(4096, 1, 8), cluster)
    assert min(huge, key=huge.get) == "tree"


def test_in_network_reduction_shortens_the_reduction():
    """NVLS: each GPU sends its data once to the switch and gets the sum back; SHARP likewise
    across nodes. Neither changes all-gather."""
    one_node = Placement(8, 8, 1)
    with_nvls = group_collective_time_s("all_reduce", BIG, one_node, H100)
    assert with_nvls == pytest.approx(BIG / (450e9 * H100.nvls.efficiency) + 2 * H100.intra_node.latency_s)
    assert with_nvls < group_collective_time_s("all_reduce", BIG, one_node, plain(H100))
    sharp = replace(plain(H100), sharp=InNetworkReduction(True, 0.9))
    per_node = Placement(8, 1, 8)  # one rank per node: the inter phase is the whole all-reduce
    expected = BIG / (50e9 * 0.9) + 2 * H100.inter_node.latency_s
    assert group_collective_time_s("all_reduce", BIG, per_node, sharp) == pytest.approx(expected)
    assert group_collective_time_s("all_gather", BIG, per_node, sharp) == pytest.approx(
        group_collective_time_s("all_gather", BIG, per_node, plain(H100)))


def test_all_to_all_and_broadcast_and_send_recv():
    cluster = plain(H100)
    b_nv, b_nic = cluster.intra_node.effective_bw_bytes_per_s, cluster.inter_node.effective_bw_bytes_per_s
    a_nv, a_net = cluster.intra_node.latency_s, cluster.inter_node.latency_s
    size = 1e9
    # 8 GPUs of one node: 7/8 of each buffer over NVLink
    assert collective_time_s("all_to_all", size, 8, cluster) == pytest.approx(7 / 8 * size / b_nv + a_nv)
    # 64 GPUs on 8 nodes: each node sends 8 x 56/64 of a buffer over its 8 rails
    assert collective_time_s("all_to_all", size, 64, cluster) == pytest.approx(
        8 * 56 / 64 * size / (8 * b_nic) + a_nv + a_net)
    # the one algorithm all-to-all has is what any request gets
    assert collective_time_s("all_to_all", size, 64, cluster, algorithm="tree") == \
        collective_time_s("all_to_all", size, 64, cluster)
    # pipelined ring broadcast over 2 nodes x 8: the rails (8 x 42.5 GB/s) are below NVLink's 360
    assert collective_time_s("broadcast", size, 16, cluster, algorithm="ring") == pytest.approx(
        size / min(b_nv, 8 * b_nic) + 14 * a_nv + a_net)
    # send/recv crosses one link: NVLink inside a node, one NIC across
    assert collective_time_s("send_recv", size, 2, cluster, stride=4) == pytest.approx(a_nv + size / b_nv)
    assert collective_time_s("send_recv", size, 2, cluster, stride=8) == pytest.approx(a_net + size / b_nic)
    # NCCL has no tree reduce-scatter: asking for one costs the ring
    assert collective_time_s("reduce_scatter", size, 64, cluster, algorithm="tree") == \
        collective_time_s("reduce_scatter", size, 64, cluster, algorithm="ring")


def test_trivial_and_bad_requests():
    assert collective_time_s("all_reduce", BIG, 1, H100) == 0.0
    assert collective_time_s("all_to_all", 0, 64, H100) == 0.0
    with pytest.raises(ValueError, match="kind"):
        collective_time_s("all_scatter", 1e6, 8, H100)
    with pytest.raises(ValueError, match="algorithm"):
        collective_time_s("all_reduce", 1e6, 8, H100, algorithm="butterfly")
    with pytest.raises(ValueError, match="bytes"):
        collective_time_s("all_reduce", -1.0, 8, H100)
    with pytest.raises(ValueError, match="algorithm"):  # one link has no two levels
        all_reduce_time_s(1e6, 8, LinkProfile(1e9, 1e-6), "hierarchical")


# ---------------------------------------------------------------------------------------------
# Published nccl-tests figures
#
# (size bytes, group, stride, published busbw GB/s, source). The inter-node efficiencies of the
# shipped profiles (0.85) were fitted when every group crossed nodes at one NIC and are not refitted
# here; they read 8-12% below these figures, so the tolerance is 15%: the test fails if the model
# moves further from NVIDIA's own numbers, not when a refit brings it closer.
PUBLISHED = [
    # NVIDIA's NCCL team: "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we
    # measure 192GB/s AllReduce BusBW" (github.com/NVIDIA/nccl/issues/812, 2023-03-31); ring over
    # 3+ nodes at large sizes: 4 nodes, 8 GiB.
    ("a100-80g", 2**33, 32, 1, 192.0, "github.com/NVIDIA/nccl/issues/812"),
    # NVIDIA's NCCL team: "For NDR @ 400Gbps you should see 46-48GB/s per NIC"
    # (github.com/NVIDIA/nccl-tests/issues/290, 2025-03-03): 8 NICs of a DGX H100, 47 GB/s each.
    ("h100-sxm", 2**33, 64, 1, 8 * 47.0, "github.com/NVIDIA/nccl-tests/issues/290"),
    # One DGX A100 node, all_reduce_perf up to 4 GiB: 232.54 GB/s (github.com/NVIDIA/nccl-tests/issues/175).
    ("a100-80g", 2**32, 8, 1, 232.54, "github.com/NVIDIA/nccl-tests/issues/175"),
]


@pytest.mark.parametrize("name, size, group, stride, published_gb_s, source", PUBLISHED)
def test_published_all_reduce_bus_bandwidth(name, size, group, stride, published_gb_s, source):
    seconds = collective_time_s("all_reduce", size, group, load_cluster(name), stride=stride)
    model_gb_s = busbw("all_reduce", size, group, seconds) / 1e9
    assert model_gb_s == pytest.approx(published_gb_s, rel=0.15), source


def test_h100_single_node_nvls_figure():
    """One DGX H100, 8 GiB all-reduce: nccl-tests prints busbw 479.41 GB/s
    (github.com/NVIDIA/nccl-tests/issues/347); NVIDIA's GTC talk S62129 gives 480 GB/s for NVLS.
    The profile's nvls.efficiency was set from this figure, so this checks the formula and the
    profile agree (2%), not the model's accuracy."""
    size = 8589934592
    seconds = collective_time_s("all_reduce", size, 8, H100)
    assert busbw("all_reduce", size, 8, seconds) / 1e9 == pytest.approx(479.41, rel=0.02)
    # without NVLS the ring reads NVLink's 360 GB/s (450 x 0.8)
    ring = collective_time_s("all_reduce", size, 8, plain(H100))
    assert busbw("all_reduce", size, 8, ring) / 1e9 == pytest.approx(360.0, rel=0.01)
