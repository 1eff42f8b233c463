"""Shards spread over (emulated) nodes: the world split into two fake nodes, a 2-shard run placed on both."""

import json

import pytest

import hpcps.cluster.placement
import hpcps.runtime.run
from mpitest import share, train

pytestmark = pytest.mark.mpi(min_size=5)


def fake_nodes(size: int) -> list[int]:
    """Each rank's node in a world of ``size``: world ranks 0-2 on "node A" (0), the rest on "node B" (3)."""
    return [0, 0, 0, 3, 3][:size] + [3] * (size - 5)


@pytest.fixture
def two_nodes(world, monkeypatch):
    """The world split into two fake nodes (:func:`fake_nodes`), as placement and the run see it."""
    fake = fake_nodes(world.size)
    monkeypatch.setattr(hpcps.cluster.placement, "node_ids", lambda comm: fake)
    monkeypatch.setattr(hpcps.runtime.run, "node_ids", lambda comm: fake)
    return fake


@pytest.mark.timeout(120)
def test_two_shards_on_two_nodes_go_one_per_node_and_the_run_is_whole(world, mpi_tmp_path, two_nodes):
    """World ranks 0-2 are "node A", 3-4 "node B": shard 1 must be world rank 3 (block placement would
    put both shards on node A), and the run must train as any other (nothing lost, one version each)."""
    result, t = train(mpi_tmp_path / "spread.h5", paradigm="asp", servers=2, steps=20)
    facts = None
    if world.rank == 0:
        roles = {int(r["rank"]): r["role"].decode() for r in t["ranks"]}
        facts = {"placement": json.loads(t["attrs"]["placement"]), "roles": roles,
                 "pushed": int(t["summary"]["gradients_pushed"]), "applied": int(t["summary"]["gradients_applied"])}
    facts = share(world, facts)
    assert facts["placement"] == {"mode": "spread", "world_rank_of": [0, 3, 1, 2, 4]}
    assert [facts["roles"][r] for r in range(5)] == ["server", "server", "worker", "worker", "worker"]
    assert facts["pushed"] == facts["applied"] == 3 * 20


@pytest.mark.timeout(120)
def test_with_no_layout_flags_a_job_on_two_nodes_gets_a_shard_beside_the_workers_on_each(world, mpi_tmp_path,
                                                                                          two_nodes):
    """--servers auto on the same two nodes: two shards, one per node; --pull auto under bsp: the shards send
    the rounds; a model too small to pipeline: whole transfers. The run file's config says what ran."""
    result, t = train(mpi_tmp_path / "auto.h5", paradigm="bsp", steps=6)
    facts = None
    if world.rank == 0:
        config = json.loads(t["attrs"]["config"])
        facts = {"placement": json.loads(t["attrs"]["placement"]), "servers": int(t["attrs"]["n_servers"]),
                 "pull": t["attrs"]["pull"], "settled": (config["servers"], config["pull"], config["partition_mb"]),
                 "applied": int(t["summary"]["gradients_applied"])}
    facts = share(world, facts)
    assert facts["servers"] == 2 and facts["placement"]["world_rank_of"][:2] == [0, 3]
    assert facts["pull"] == "send" and facts["settled"] == (2, "send", 0.0)
    assert facts["applied"] == (world.size - 2) * 6


@pytest.mark.timeout(120)
def test_over_a_slow_link_the_workers_read_the_rounds_and_a_small_model_goes_in_partitions(world, mpi_tmp_path,
                                                                                           two_nodes, monkeypatch):
    """The same two nodes, their link read at 50 and then 1 Mbit/s (the probe replaced). The 38 kB model
    crosses 50 Mbit/s in 6 ms: the shards send the rounds (under 0.1 s) and it goes whole (under 33.6 ms);
    at 1 Mbit/s, 0.31 s: the workers read, and it goes in partitions, at the 0.25 MB floor."""
    settled = []
    for mbps in (50, 1):
        monkeypatch.setattr(hpcps.runtime.run, "link_between_nodes", lambda comm, nodes, mbps=mbps: mbps * 1e6)
        result, t = train(mpi_tmp_path / f"slow{mbps}.h5", paradigm="bsp", steps=4)
        config = json.loads(t["attrs"]["config"]) if world.rank == 0 else None
        settled.append(share(world, (config["pull"], config["partition_mb"]) if config else None))
    assert settled == [("send", 0.0), ("get", 0.25)]


@pytest.mark.timeout(60)
def test_the_link_probe_gives_every_rank_one_positive_rate(world):
    """link_between_nodes streams from rank 0 to the first rank of another node (here shared memory): every
    rank returns the same rate, in bits per second."""
    from hpcps.check.probe import link_between_nodes
    rate = link_between_nodes(world, fake_nodes(world.size))
    rates = world.allgather(rate)
    assert rate > 1e6 and rates == [rate] * world.size


@pytest.mark.timeout(60)
def test_options_that_leave_no_worker_fail_before_the_link_between_nodes_is_probed(world, mpi_tmp_path, two_nodes,
                                                                                    monkeypatch):
    """As many shards as ranks on the same two nodes: every rank raises the one error of the options, and
    the link's probe (a stream of a second or more over a slow link) never ran."""
    from hpcps.errors import UserError
    probed = []
    monkeypatch.setattr(hpcps.runtime.run, "link_between_nodes", lambda comm, nodes: probed.append(comm.rank) or 1e9)
    with pytest.raises(UserError, match=r"too small for --servers \d+"):
        train(mpi_tmp_path / "none.h5", paradigm="bsp", servers=world.size, steps=2)
    assert probed == []
