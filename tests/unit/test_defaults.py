"""What ``auto`` settles to (hpcps.options.defaults): servers from the nodes, the pull from the paradigm, the
partition size from the model and where the link lies."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from hpcps.cluster.placement import placement_order
from hpcps.options.config import make_config
from hpcps.options.defaults import (SEND_MAX_S, describe, partition_mb_for, pull_for, servers_for, settle_layout,
                                    settle_transfers)
from hpcps.options.planning import plan
from hpcps.policies import policy_class

MB = 2**20


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=6))
def test_one_shard_per_node_and_a_worker_beside_each_when_the_job_spans_nodes(per_node):
    """On nodes of 2+ ranks, spread placement puts exactly one shard and at least one worker on each node;
    a job on one node, or with a node of a single rank, keeps one shard."""
    nodes = [node for node, n in enumerate(per_node) for _ in range(n)]
    cfg = make_config({"paradigm": "bsp"})
    s = servers_for(cfg, nodes)
    if len(per_node) > 1 and min(per_node) >= 2:
        assert s == len(per_node)
        order = placement_order(nodes, s)
        shard_nodes = Counter(nodes[r] for r in order[:s])
        worker_nodes = Counter(nodes[r] for r in order[s:])
        assert shard_nodes == Counter(range(len(per_node)))
        assert set(worker_nodes) == set(range(len(per_node)))
    else:
        assert s == 1


def test_grouped_paradigms_and_spares_that_leave_no_worker_keep_one_shard():
    nodes = [0, 0, 1, 1]
    assert servers_for(make_config({"paradigm": "grouped", "groups": 1}), nodes) == 1
    assert servers_for(make_config({"paradigm": "asp", "spare_workers": 2}), nodes) == 1
    assert servers_for(make_config({"paradigm": "asp", "spare_workers": 1}), nodes) == 2


def test_rank_placement_gets_a_shard_per_node_only_where_the_first_ranks_sit_on_different_nodes():
    """--placement rank: the shards are ranks 0..S-1; block order (srun's default) would put them all on the
    first nodes, so auto keeps one shard there; a cyclic order puts one on each node."""
    rank = make_config({"paradigm": "bsp", "placement": "rank"})
    assert servers_for(rank, [0, 0, 1, 1, 2, 2]) == 1
    assert servers_for(rank, [0, 1, 2, 0, 1, 2]) == 3
    assert servers_for(make_config({"paradigm": "bsp"}), [0, 0, 1, 1, 2, 2]) == 3  # spread: one per node


def test_the_users_own_servers_and_pull_are_kept():
    cfg = make_config({"paradigm": "bsp", "servers": 3, "pull": "get"})
    assert settle_layout(cfg, [0, 0, 1, 1, 2, 2]) is cfg


@pytest.mark.parametrize("paradigm,flags,expected", [
    ("bsp", {}, "send"),
    ("localsgd", {}, "send"),
    ("diloco", {}, "send"),
    ("asp", {}, "get"),
    ("ssp", {}, "get"),
    ("dssp", {}, "get"),
    ("eager", {}, "get"),
    ("hsp", {}, "get"),
    ("bsp", {"compress": "bf16"}, "get"),  # 16-bit pulls read the window's copies
    ("bsp", {"compress": "topk:0.1"}, "send"),  # (topk compresses pushes; pulls stay fp32)
    ("bsp", {"shards_at_once": 2}, "get"),
    ("localsgd", {"overlap_steps": 2}, "get"),
])
def test_across_nodes_the_pull_is_sent_where_the_paradigm_releases_rounds_and_nothing_needs_reads(paradigm, flags,
                                                                                                   expected):
    cfg = make_config({"paradigm": paradigm, **flags})
    assert pull_for(cfg, policy_class(paradigm), spans_nodes=True) == expected
    assert pull_for(cfg, policy_class(paradigm), spans_nodes=False) == "get"  # within a node: no faster
    # what auto settles to is never refused (hpcps.options.effects): plan() checks the settled options
    nodes = [0, 0, 0, 1, 1, 1]
    assert settle_transfers(cfg, policy_class(paradigm), 4 * MB, True, True).pull == expected
    plan(cfg, 6, nodes)


@pytest.mark.parametrize("mb,expected", [(0.5, 0.0), (1.4, 0.0), (4.0, 0.25), (4.8, 0.3), (8.4, 0.525), (100.0, 4.0)])
def test_the_partition_is_a_sixteenth_of_the_model_within_bounds(mb, expected):
    cfg = make_config({"paradigm": "bsp"})
    assert partition_mb_for(cfg, policy_class("bsp"), int(mb * MB), spans_nodes=True, on_cpu=True) == expected


@pytest.mark.parametrize("mb,expected", [(1.4, 0.0), (4.0, 0.1), (4.8, 0.12), (8.4, 0.21), (100.0, 2.5), (400.0, 4.0)])
def test_where_the_shards_send_the_rounds_the_partition_is_a_fortieth_of_the_model_within_bounds(mb, expected):
    """Sent rounds come in rounds of one piece from each shard, so their pieces are finer (0.1-0.15 MB
    measured fastest on the 4.8 MB deep_mlp, against 0.286 MB); reads keep a sixteenth (above)."""
    cfg = make_config({"paradigm": "bsp"})
    assert partition_mb_for(cfg, policy_class("bsp"), int(mb * MB), True, True, pull="send") == expected
    # settled at 1 Gbit/s: the pull first (send below SEND_MAX_S), then the partitions for that pull
    settled = settle_transfers(cfg, policy_class("bsp"), int(mb * MB), True, True, link_bps=1e9)
    assert settled.pull == ("send" if mb * MB * 8 / 1e9 < SEND_MAX_S else "get")
    assert settled.partition_mb == partition_mb_for(cfg, policy_class("bsp"), int(mb * MB), True, True,
                                                    link_bps=1e9, pull=settled.pull)


@pytest.mark.parametrize("paradigm,flags,spans,cpu", [
    ("bsp", {}, False, True),  # one node: shared memory, nothing to hide
    ("bsp", {}, True, False),  # GPU workers
    ("eager", {}, True, True),  # pulls behind its computation already
    ("grouped", {"groups": 1}, True, True),
    ("localsgd", {}, True, True),  # a push per round
    ("bsp", {"compress": "bf16"}, True, True),
])
def test_whole_transfers_where_partitions_were_not_measured_faster(paradigm, flags, spans, cpu):
    cfg = make_config({"paradigm": paradigm, **flags})
    assert partition_mb_for(cfg, policy_class(paradigm), 10 * MB, spans, cpu) == 0.0


@pytest.mark.parametrize("mb,mbps,expected", [
    (1.4, 1000, 0.0),  # the language model at 1 Gbit/s: its 11 ms transfer leaves nothing to hide
    (1.4, 100, 0.25),  # at 100 Mbit/s: 117 ms (0.25 MB took 0.84x the step of whole transfers there)
    (4.8, 1000, 0.3),  # deep_mlp at 1 Gbit/s: 40 ms
    (4.8, 100_000, 0.0),  # at 100 Gbit/s: 0.4 ms
    (64.0, 100_000, 0.0),
    (500.0, 100_000, 4.0),  # 42 ms
])
def test_partitions_where_the_measured_link_makes_the_transfer_long_enough_to_hide(mb, mbps, expected):
    """A model is partitioned where its whole transfer over the link takes 33.6 ms or more (4 MB at 1 Gbit/s,
    the floor first measured there)."""
    cfg = make_config({"paradigm": "bsp"})
    assert partition_mb_for(cfg, policy_class("bsp"), int(mb * MB), True, True, link_bps=mbps * 1e6) == expected


def test_rounds_are_sent_where_the_models_transfer_is_short_and_read_where_it_is_long():
    """bsp across nodes: send while the whole model crosses the link in under 0.1 s (0.87x reads' step at
    40 ms), read from there (alike at 117-160 ms, sends 1.13-1.25x from 280 ms); an unmeasured link is taken
    for 1 Gbit/s; the pull is settled with the model, not before."""
    cfg, bsp = make_config({"paradigm": "bsp"}), policy_class("bsp")
    cells = [(4.8, 1000), (4.8, 500), (1.4, 1000), (1.4, 100), (4.8, 250), (33.4, 1000), (44.7, 1000), (4.8, 100)]
    assert [pull_for(cfg, bsp, True, mbps * 1e6, int(mb * MB)) for mb, mbps in cells] == \
        ["send"] * 3 + ["get"] * 5
    assert pull_for(cfg, bsp, True, None, int(4.8 * MB)) == "send"
    assert pull_for(cfg, bsp, True, None, int(12.5 * MB)) == "get"  # 105 ms at the reference 1 Gbit/s
    assert pull_for(cfg, policy_class("asp"), True, 1e9, MB) == "get"  # rounds not released together: as before
    assert settle_layout(cfg, [0, 0, 1, 1]).pull == "auto"
    assert settle_transfers(cfg, bsp, int(4.8 * MB), True, True, link_bps=94e6).pull == "get"


def test_the_line_names_the_link_it_measured():
    given_cfg = make_config({"paradigm": "bsp"})
    cfg = settle_layout(given_cfg, [0, 0, 1, 1])
    cfg = settle_transfers(cfg, policy_class("bsp"), int(1.4 * MB), True, True, link_bps=94.4e6)
    assert describe(given_cfg, cfg, 94.4e6) == ("defaults for this job: 2 server shards (one per node), pull get, "
                                                "partitions of 0.25 MB (the link between nodes measured at "
                                                "94 Mbit/s)")


def test_settled_values_and_the_line_that_names_them():
    given_cfg = make_config({"paradigm": "bsp"})
    cfg = settle_layout(given_cfg, [0, 0, 1, 1, 2, 2, 3, 3])
    cfg = settle_transfers(cfg, policy_class("bsp"), int(4.8 * MB), spans_nodes=True, on_cpu=True)
    assert (cfg.servers, cfg.pull, cfg.partition_mb) == (4, "send", 0.12)
    assert describe(given_cfg, cfg) == ("defaults for this job: 4 server shards (one per node), pull send, "
                                        "partitions of 0.12 MB")
    mine = make_config({"paradigm": "bsp", "servers": 1, "pull": "get", "partition_mb": 0})
    assert describe(mine, settle_transfers(mine, policy_class("bsp"), MB, True, True)) is None
