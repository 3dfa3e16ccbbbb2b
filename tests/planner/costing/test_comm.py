"""Alpha-beta collectives against the textbook formulas (Thakur et al. 2005; NCCL docs)."""
import math

import pytest

from meshplan.planner.costing.collectives import (all_gather_time_s, all_reduce_time_s, collective_time_s,
                          reduce_scatter_time_s, send_recv_time_s)
from meshplan.planner.contracts.cluster import LinkProfile
from meshplan.planner.costing.hardware import load_cluster

LINK = LinkProfile(bw_bytes_per_s=100e9, latency_s=5e-6, efficiency=0.8)
BW = 100e9 * 0.8


@pytest.mark.parametrize("n", [2, 3, 8, 64])
@pytest.mark.parametrize("size", [1e3, 1e6, 1e9])
def test_ring_all_reduce_formula(n, size):
    expected = 2 * (n - 1) / n * size / BW + 2 * (n - 1) * 5e-6
    assert all_reduce_time_s(size, n, LINK, "ring") == pytest.approx(expected, rel=1e-12)


def test_all_gather_and_reduce_scatter_are_half_a_ring_all_reduce():
    for n in (2, 8, 16):
        half = all_reduce_time_s(1e8, n, LINK, "ring") / 2
        assert all_gather_time_s(1e8, n, LINK) == pytest.approx(half)
        assert reduce_scatter_time_s(1e8, n, LINK) == pytest.approx(half)


def test_auto_picks_tree_for_small_messages_on_large_groups_and_ring_for_large():
    n = 512
    small_ring, small_tree = all_reduce_time_s(1e3, n, LINK, "ring"), all_reduce_time_s(1e3, n, LINK, "tree")
    assert small_tree < small_ring
    assert all_reduce_time_s(1e3, n, LINK) == small_tree
    big_ring = all_reduce_time_s(1e10, 4, LINK, "ring")
    assert big_ring < all_reduce_time_s(1e10, 4, LINK, "tree")
    assert all_reduce_time_s(1e10, 4, LINK) == big_ring
    assert all_reduce_time_s(1e3, n, LINK, "tree") == pytest.approx(2 * 1e3 / BW + 2 * math.ceil(math.log2(n)) * 5e-6)


def test_trivial_groups_and_p2p():
    assert all_reduce_time_s(1e9, 1, LINK) == 0.0
    assert all_gather_time_s(0, 8, LINK) == 0.0
    assert send_recv_time_s(1e6, LINK) == pytest.approx(5e-6 + 1e6 / BW)


def test_group_crossing_nodes_uses_the_slower_link():
    cluster = load_cluster("a100-80g")
    inside = collective_time_s("all_reduce", 1e9, 8, cluster, stride=1, algorithm="ring")
    across = collective_time_s("all_reduce", 1e9, 8, cluster, stride=8, algorithm="ring")
    assert inside == pytest.approx(all_reduce_time_s(1e9, 8, cluster.intra_node, "ring"))
    assert across == pytest.approx(all_reduce_time_s(1e9, 8, cluster.inter_node, "ring"))
    assert across > 5 * inside  # NVLink 300 GB/s vs 25 GB/s per GPU
    # 2 ranks 4 apart stay in an 8-GPU node; 2 ranks 8 apart do not
    assert collective_time_s("send_recv", 1e6, 2, cluster, stride=4) < collective_time_s("send_recv", 1e6, 2, cluster, stride=8)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="group size"):
        all_reduce_time_s(1e6, 0, LINK)
    with pytest.raises(ValueError, match="bytes"):
        all_reduce_time_s(-1, 4, LINK)
    with pytest.raises(ValueError, match="algorithm"):
        all_reduce_time_s(1e6, 4, LINK, "butterfly")
