"""Shard placement: one shard per node, round-robin, the rest in launcher order (pure policy)."""

import pytest

from hpcps.cluster.placement import placement_order


def test_one_node_keeps_the_launchers_order():
    assert placement_order([0] * 5, 2) == [0, 1, 2, 3, 4]


def test_shards_go_one_per_node_round_robin_in_block_placement():
    nodes = [0] * 4 + [4] * 4 + [8] * 4  # 3 nodes of 4 ranks, numbered in blocks
    order = placement_order(nodes, 4)
    assert order[:4] == [0, 4, 8, 1]  # shard 3 wraps around to the first node's second rank
    assert order[4:] == [2, 3, 5, 6, 7, 9, 10, 11]  # everyone else keeps its order
    assert sorted(order) == list(range(12))


def test_uneven_nodes_are_skipped_when_they_run_out_and_too_many_shards_are_refused():
    assert placement_order([0, 1, 1, 1], 3) == [0, 1, 2, 3]
    assert placement_order(["a", "b", "a", "b"], 2) == [0, 1, 2, 3]  # cyclic launcher order: already spread
    with pytest.raises(ValueError, match="3 shards but only 2 ranks"):
        placement_order([0, 1], 3)
