"""Hand-computed costs of the NCCL collectives' latency-bandwidth model."""
import pytest

from deepspeed_loco.perf.collectives import (Link, Topology, all_to_all_s, inter_node_all_to_all_s,
                                             intra_node_all_gather_s, intra_node_all_to_all_s, ring_all_gather_s,
                                             ring_reduce_scatter_s)

INTRA, INTER = Link(100e9, 1e-6), Link(10e9, 5e-6)


def test_all_to_all_bytes_hand_computed():
    # 4 peers, 1000 bytes each: 3/4 leave the rank, 750 B at 1000 B/s, plus one latency
    assert all_to_all_s(1000, 4, 1000.0, 0.5) == pytest.approx(0.75 + 0.5)


def test_single_rank_collectives_cost_nothing():
    topo = Topology(1, 1, INTRA, INTER)
    assert ring_all_gather_s(1e9, topo) == 0.0
    assert all_to_all_s(1e9, 1, 1.0, 1.0) == 0.0


def test_one_node_has_no_network_cost():
    one_node = Topology(8, 8, INTRA, INTER)
    slow_network = Topology(8, 8, INTRA, Link(1.0, 100.0))
    assert ring_all_gather_s(1e9, one_node) == ring_all_gather_s(1e9, slow_network)
    assert ring_all_gather_s(1e9, one_node) == pytest.approx(7 / 8 * 1e9 / 100e9 + 7 * 1e-6)
    assert inter_node_all_to_all_s(1e9, one_node) == 0.0


def test_ring_across_nodes_is_limited_by_the_nics():
    topo = Topology(16, 8, INTRA, INTER)
    # 15/16 of 1 GB through one node's NICs at 10 GB/s; 14 NVLink hops, 2 network hops
    assert ring_all_gather_s(1e9, topo) == pytest.approx(15 / 16 * 0.1 + 14e-6 + 10e-6)
    assert ring_reduce_scatter_s(1e9, topo) == ring_all_gather_s(1e9, topo)


def test_intra_node_collectives_ignore_the_other_nodes():
    topo = Topology(64, 8, INTRA, INTER)
    assert intra_node_all_gather_s(1e9, topo) == ring_all_gather_s(1e9, Topology(8, 8, INTRA, INTER))
    assert intra_node_all_to_all_s(1e9, topo) == pytest.approx(7 / 8 * 1e9 / 100e9 + 1e-6)


def test_inter_hop_shares_the_nics_among_the_node_gpus():
    topo = Topology(32, 8, INTRA, INTER)  # 4 nodes, each GPU gets 10/8 GB/s
    assert inter_node_all_to_all_s(1e9, topo) == pytest.approx(3 / 4 * 1e9 / (10e9 / 8) + 5e-6)
