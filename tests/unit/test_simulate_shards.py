"""The model of a shard on every node: the network's fair shares and steps worked out by hand, and the one-node
case against the one-server model it must reduce to."""

import math

import pytest

from hpcps.analysis.fairshare import FairNetwork
from hpcps.cli import main
from hpcps.analysis.simulate import Machine, simulate
from hpcps.analysis.simulate_shards import node_rates, simulate_shards

C, L, R, M = 0.05, 0.001, 125e6, 4_800_000  # compute s, latency s, a node's link in bytes/s, the model's bytes
NET = Machine(latency=L, bandwidth=1e30, server_s=0.0, apply_rate=1e30)  # the links' time and L, nothing else


def test_a_transfer_gets_what_its_tightest_link_leaves_it_and_the_others_share_the_rest():
    """Links a (10) and b (4): a transfer over a and b is held to 4 by b, so the one over a alone gets 6; a
    third over a, capped at 1, leaves the first 5 (a's 10 less 4 and 1)."""
    net = FairNetwork({"a": 10.0, "b": 4.0})
    net.add(0.0, "ab", 8.0, ("a", "b"))
    net.add(0.0, "a", 60.0, ("a",))
    assert net.rates() == {"ab": 4.0, "a": 6.0}
    net.add(0.0, "capped", 1.0, ("a",), cap=1.0)
    assert net.rates() == {"ab": 4.0, "a": 5.0, "capped": 1.0}
    assert net.next_done() == (1.0, "capped")
    net.finish(1.0, "capped")
    assert net.next_done() == (pytest.approx(2.0), "ab")  # 8 - 4 = 4 bytes left at 4: 1 s more
    net.set_cap(1.0, "ab", 2.0)
    assert net.rates() == {"ab": 2.0, "a": 8.0} and net.next_done() == (pytest.approx(3.0), "ab")


def test_a_transfer_within_a_node_runs_at_its_cap():
    net = FairNetwork({"a": 10.0})
    net.add(0.0, "local", 5.0, (), cap=2.5)
    assert net.next_done() == (2.0, "local")
    with pytest.raises(ValueError, match="time went backwards"):
        net.add(-1.0, "late", 1.0, ("a",))


@pytest.mark.parametrize("paradigm", ["bsp", "asp", "ssp", "dssp"])
@pytest.mark.parametrize("jitter", ["none", "lognormal"])
def test_one_node_is_the_one_server_model(paradigm, jitter):
    """On one node every transfer stays within it, at the machine's bandwidth, and the one shard is the one
    server: the same job to the last figure, with a straggler, jitter and the server's costs."""
    machine = Machine(latency=L, bandwidth=5e8, server_s=2e-4, apply_rate=1e9, update_s=1e-4)
    kw = dict(steps=40, nbytes=10**6, compute_time=0.01, machine=machine, slowdown={3: 3.0}, jitter=jitter)
    sharded, single = simulate_shards(paradigm, 1, 4, **kw), simulate(paradigm, 4, **kw)
    assert sharded.wall_s == pytest.approx(single.wall_s, rel=1e-12)
    assert sharded.per_worker_rate == pytest.approx(single.per_worker_rate, rel=1e-12)
    assert sharded.mean_staleness == single.mean_staleness
    assert sharded.mean_wait_s == pytest.approx(single.mean_wait_s, abs=1e-12)


@pytest.mark.parametrize("nodes, per_node", [(2, 1), (4, 1), (4, 2)])
def test_bsp_whole_transfers_pay_compute_then_push_then_pull(nodes, per_node):
    """No overlap: a node's link carries its workers' parts for the N-1 other shards each way, per_node (N-1)/N
    of the model, T of it at R; push and pull each take T + L after the compute, and a round closes at once."""
    t = per_node * (nodes - 1) / nodes * M / R
    r = simulate_shards("bsp", nodes, per_node, steps=10, nbytes=M, compute_time=C, rates=(R,) * nodes, machine=NET)
    assert r.wall_s / 10 == pytest.approx(C + 2 * (t + L))
    assert r.mean_staleness == 0.0


@pytest.mark.parametrize("compute", [0.01, 0.05])
def test_the_push_goes_during_backward_and_cannot_end_before_it(compute):
    """All the compute in backward, the push fed as backward makes it: the push's transfer T = 3/4 M / R (28.8
    ms) hides behind a longer backward pass, and a shorter one waits for the link: max(compute, T) + L, then
    the pull's T + L."""
    t = 3 / 4 * M / R
    r = simulate_shards("bsp", 4, steps=10, nbytes=M, compute_time=compute, backward=1.0, rates=(R,) * 4, machine=NET)
    assert r.wall_s / 10 == pytest.approx(max(compute, t) + L + t + L)


@pytest.mark.parametrize("compute", [0.01, 0.05])
def test_partitioned_pulls_let_the_forward_pass_run_as_they_come(compute):
    """All the compute in forward: it ends at the later of its own length and the pull's T + L, then the push's
    T + L; without partitions the pull comes first whole: compute + 2 (T + L)."""
    t = 3 / 4 * M / R
    kw = dict(steps=10, nbytes=M, compute_time=compute, forward=1.0, rates=(R,) * 4, machine=NET)
    assert simulate_shards("bsp", 4, partitioned=True, **kw).wall_s / 10 == pytest.approx(max(compute, t + L) + t + L)
    assert simulate_shards("bsp", 4, **kw).wall_s / 10 == pytest.approx(compute + 2 * (t + L))


def test_the_defaults_layout_reaches_the_bound_of_a_step_on_an_ideal_machine():
    """The bound ``tools/bench_allreduce.py`` prints (compute - F - B + max(B, T) + max(F, T)) is the model's
    step where the shards cost nothing and nothing waits on latency: a third of the compute in forward, two
    thirds in backward, partitions, sent rounds."""
    t, f, b = 3 / 4 * M / R, C / 3, 2 * C / 3
    ideal = Machine(latency=0.0, bandwidth=1e30, server_s=0.0, apply_rate=1e30)
    r = simulate_shards("bsp", 4, steps=10, nbytes=M, compute_time=C, forward=1 / 3, backward=2 / 3,
                        partitioned=True, pull="send", rates=(R,) * 4, machine=ideal)
    assert r.wall_s / 10 == pytest.approx(max(b, t) + max(f, t))


def test_alike_nodes_under_bsp_grant_at_once_so_sent_and_read_rounds_take_the_same_step():
    """Every shard closes its round when the last push comes in, at the same moment on alike links: the shards
    sending their parts then, or the workers reading them then, move the same bytes at the same time."""
    kw = dict(steps=10, nbytes=M, compute_time=C, machine=NET, rates=node_rates(["1gbit"], 4))
    assert kw["rates"] == (R,) * 4
    send, get = (simulate_shards("bsp", 4, pull=p, **kw).wall_s for p in ("send", "get"))
    assert send == pytest.approx(get)


def test_asp_with_a_straggler_never_waits_for_it():
    """asp's grant follows each worker's own push: a fast worker's step is its own C + 2 (T + L), the 3x
    straggler's 3C + 2 (T + L) (within 10%: their transfers share links at times); under bsp everyone's is
    the straggler's, the round waiting for it."""
    t = 3 / 4 * M / R
    kw = dict(steps=20, nbytes=M, compute_time=C, rates=(R,) * 4, machine=NET, slowdown={3: 3.0})
    r = simulate_shards("asp", 4, **kw)
    assert r.per_worker_rate[0] == pytest.approx(1 / (C + 2 * (t + L)), rel=0.1)
    assert r.per_worker_rate[3] == pytest.approx(1 / (3 * C + 2 * (t + L)), rel=0.1)
    assert r.mean_staleness > 0
    b = simulate_shards("bsp", 4, **kw)
    assert b.per_worker_rate[0] == pytest.approx(1 / (3 * C + 2 * (t + L)), rel=0.01) and b.mean_staleness == 0


@pytest.mark.parametrize("paradigm, why", [("eager", "does not wait for its grant; it pulls eagerly"),
                                           ("localsgd", "takes local steps"), ("grouped", "has group servers"),
                                           ("hsp", "extra gradients")])
def test_what_the_model_lacks_is_refused_by_name(paradigm, why):
    with pytest.raises(ValueError, match=why):
        simulate_shards(paradigm, 2, steps=5, nbytes=M, compute_time=C)


@pytest.mark.parametrize("kw, match", [(dict(forward=0.6, backward=0.6), "together at most 1"),
                                       (dict(pull="put"), "--pull must be one of get, send"),
                                       (dict(paradigm="asp", pull="send"), "does not release every worker"),
                                       (dict(rates=(R,)), "link rates for 1 nodes, not 2")])
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        simulate_shards(kw.pop("paradigm", "bsp"), 2, steps=5, nbytes=M, compute_time=C, **kw)


def test_no_node_rates_is_every_transfer_at_the_machines_bandwidth():
    machine = Machine(latency=L, bandwidth=M / 0.01, server_s=0.0, apply_rate=math.inf)
    r = simulate_shards("bsp", 4, steps=10, nbytes=M, compute_time=C, machine=machine)
    assert r.wall_s / 10 == pytest.approx(C + 2 * (0.01 / 4 + L))  # each part, a quarter of M, alone


def test_cli_models_a_shard_per_node_with_the_runs_own_options(capsys):
    """``hpcps simulate --nodes``: 4 nodes at 1 Gbit/s, 1.2 M parameters, bsp with everything overlapped as
    the defaults' layout runs it: the step of the bound (max(B, T) + max(F, T) = 33.5 + 28.8 ms, the latency
    and the shards' small costs above it)."""
    assert main(["simulate", "--nodes", "4", "--workers", "4", "--paradigm", "bsp", "--params", "1200000",
                 "--compute-time", "0.05", "--compute-forward", "0.33", "--compute-backward", "0.67", "--partitioned",
                 "--pull", "send", "--link", "1gbit", "--steps", "20"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| bsp | 4 |"))
    rate = float(row.split("|")[3])
    step = max(0.67 * C, 3 / 4 * M / R) + max(0.33 * C, 3 / 4 * M / R)
    assert 4 / rate == pytest.approx(step, rel=0.02) and 4 / rate > step


@pytest.mark.parametrize("args, message", [
    (["--pull", "send"], "--pull models a shard per node: give --nodes too"),
    (["--pull", "get"], "--pull models a shard per node: give --nodes too"),
    (["--partitioned"], "--partitioned models a shard per node"),
    (["--nodes", "2", "--groups", "3"], "grouped is not modelled with --nodes"),
    (["--nodes", "3"], "--workers 4 is not a multiple of --nodes 3"),
    (["--nodes", "2", "--local-steps", "4"], "--nodes models no local steps"),
    (["--nodes", "2", "--paradigm", "eager"], "not modelled with a shard per node"),
    (["--nodes", "2", "--link", "5=1gbit"], "--link"),
])
def test_cli_refuses_what_the_model_of_a_shard_per_node_cannot_describe(args, message, capsys):
    assert main(["simulate", "--workers", "4", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
