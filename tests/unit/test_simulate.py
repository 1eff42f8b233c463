"""The discrete-event model: closed-form rates on timelines simple enough to work out by hand."""

from pathlib import Path

import pytest

from hpcps.cli import main
from hpcps.analysis.simulate import Links, Machine, simulate, sweep

C, L = 0.01, 0.001  # compute and transfer seconds
FREE = Machine(latency=L, bandwidth=1e30, server_s=0.0, apply_rate=1e30)  # transfers cost L, the server nothing


def test_asp_worker_runs_at_one_over_compute_plus_two_transfers():
    """Pull L, compute C, push L; the next pull waits for the push's update (read-my-writes), not for any other
    worker: a period of C + 2L, and no wait counted."""
    r = simulate("asp", 4, steps=50, nbytes=0, compute_time=C, machine=FREE)
    assert r.per_worker_rate == {w: pytest.approx(1 / (C + 2 * L)) for w in range(4)}
    assert r.throughput == pytest.approx(4 / (C + 2 * L)) and r.mean_wait_s == 0.0


def test_bsp_runs_everyone_at_the_stragglers_pace_and_counts_the_wait():
    """A round: pull L, the straggler's 3C, push L; fast workers wait 2C each round."""
    r = simulate("bsp", 4, steps=40, nbytes=0, compute_time=C, slowdown={3: 3.0}, machine=FREE)
    assert r.per_worker_rate == {w: pytest.approx(1 / (3 * C + 2 * L)) for w in range(4)}
    assert r.mean_wait_s == pytest.approx(3 / 4 * 2 * C)  # three of four workers wait 2C, the straggler none
    assert r.mean_staleness == 0.0


@pytest.mark.parametrize("paradigm, every", [("bsp", 4), ("diloco", None), ("localsgd", 5)])
def test_local_steps_pay_one_pull_and_one_push_per_round_of_h_batches(paradigm, every):
    """A round: pull L, H computations, push L: H batches per H*C + 2L (diloco: H = 8 by default); 40 batches
    make ceil(40/H) pushes per worker, the last round shorter where H does not divide them."""
    h = every or 8
    r = simulate(paradigm, 4, steps=40, nbytes=0, compute_time=C, machine=FREE, local_steps=every)
    rounds = -(-40 // h)
    wall = 40 * C + 2 * L * rounds
    assert r.per_worker_rate == {w: pytest.approx(40 / wall) for w in range(4)}
    assert r.gradients == 4 * rounds and r.mean_staleness == 0.0


@pytest.mark.parametrize("overlap", [0, 2, 5])
def test_overlapped_rounds_hide_the_pull_behind_their_first_batches(overlap):
    """One worker, H=6, 30 batches (5 rounds): without overlap a round is L + 6C + L (pull, compute, push);
    with T of them overlapped, each round after the first computes T batches while its push and the next
    pull (2L) go, so a round after the first costs max(T C, 2L) + (6 - T) C, the first L + 6C, and the
    last push L."""
    r = simulate("diloco", 1, steps=30, nbytes=0, compute_time=C, machine=FREE, local_steps=6,
                 overlap_steps=overlap)
    wall = L + 6 * C + 4 * (max(overlap * C, 2 * L) + (6 - overlap) * C) + L if overlap else 5 * (6 * C + 2 * L)
    assert r.per_worker_rate[0] == pytest.approx(30 / wall)
    assert r.gradients == 5


def test_overlap_steps_must_be_fewer_than_the_local_steps():
    with pytest.raises(ValueError, match="--overlap-steps must be less than --local-steps"):
        simulate("diloco", 2, steps=8, nbytes=0, compute_time=C, machine=FREE, local_steps=4, overlap_steps=4)


def test_the_free_form_of_local_steps_is_asp_over_rounds():
    """asp with H local steps: a period of H*C + 2L per round (the pull after the push's update)."""
    r = simulate("asp", 3, steps=60, nbytes=0, compute_time=C, machine=FREE, local_steps=6)
    assert r.per_worker_rate[0] == pytest.approx(60 / (10 * (6 * C + 2 * L)))  # (as asp without: N x (C + 2L))


def test_eager_hides_the_pull():
    r = simulate("eager", 2, steps=30, nbytes=0, compute_time=C, machine=FREE)
    assert r.per_worker_rate[0] == pytest.approx(1 / C)


@pytest.mark.parametrize("server_s", [C, 2 * C])
def test_eager_workers_wait_for_a_server_slower_than_them_rather_than_queue_without_end(server_s):
    """Four workers computing a gradient each C, a server that handles one in ``server_s`` >= C: each worker
    pushes once its gradient of two pushes ago was handled (as the runtime's worker waits), so the job runs at
    the server's pace, 1/server_s gradients a second (not the workers' 4/C), with at most two gradients of
    each worker in the server's queue. A gradient's staleness is then the updates out between its pull (at its
    worker's push before) and that push, about one per worker, and the at most 2 x 4 - 1 gradients queued ahead
    of it: under 3 x 4, where a queue without end would grow it with every step."""
    machine = Machine(latency=L, bandwidth=1e30, server_s=server_s, apply_rate=1e30)
    r = simulate("eager", 4, steps=200, nbytes=0, compute_time=C, machine=machine)
    assert r.throughput == pytest.approx(1 / server_s, rel=0.02)
    assert r.mean_staleness < 3 * 4


def test_ssp_lies_between_bsp_and_asp_with_a_straggler():
    rates = {p: simulate(p, 4, steps=60, nbytes=0, compute_time=C, slowdown={3: 3.0}, machine=FREE).throughput
             for p in ("bsp", "ssp", "asp")}
    assert rates["bsp"] < rates["ssp"] < rates["asp"]


def test_server_apply_cost_bounds_bsp_rounds():
    """Applying a round of 4 gradients of 1 MB at 1 GB/s takes 4 ms, on top of every round."""
    machine = Machine(latency=L, bandwidth=1e30, server_s=0.0, apply_rate=1e9)
    r = simulate("bsp", 4, steps=20, nbytes=10**6, compute_time=C, machine=machine)
    assert r.per_worker_rate[0] == pytest.approx(1 / (C + 2 * L + 4e-3))


def test_per_gradient_update_cost_lengthens_a_straggled_bsp_round_by_n_times_it():
    """With a 2x straggler the fast workers' pushes are handled while it computes; closing the round then
    costs server_s for its push plus update_s for each of the n gradients: round = 2C + 2L + server_s + n u."""
    u, s = 4e-4, 1e-4
    for n in (4, 16):
        machine = Machine(latency=L, bandwidth=1e30, server_s=s, apply_rate=1e30, update_s=u)
        r = simulate("bsp", n, steps=20, nbytes=0, compute_time=C, slowdown={n - 1: 2.0}, machine=machine)
        assert r.per_worker_rate[0] == pytest.approx(1 / (2 * C + 2 * L + s + n * u))


def test_grouped_groups_keep_their_own_pace_after_a_central_round_trip():
    """A round: pull, compute, push (2L), the update to the central server, its receipt, the pull (3L)."""
    r = simulate("grouped", 4, groups=2, steps=20, nbytes=0, compute_time=C, slowdown={3: 3.0}, machine=FREE)
    assert r.per_worker_rate[0] == r.per_worker_rate[1] == pytest.approx(1 / (C + 5 * L))
    assert r.per_worker_rate[2] == r.per_worker_rate[3] == pytest.approx(1 / (3 * C + 5 * L))  # the straggler's group
    one = simulate("grouped", 4, groups=1, steps=20, nbytes=0, compute_time=C, slowdown={3: 3.0}, machine=FREE)
    assert one.per_worker_rate[0] == pytest.approx(1 / (3 * C + 5 * L))  # G=1: everyone at the straggler's pace


def test_grouped_central_staleness_is_one_behind_the_other_group():
    """Two equal groups reach the central server together: after the first update every group update lands
    one version after the group's own pull, so the mean is (2 steps - 1) / (2 steps)."""
    steps = 10
    r = simulate("grouped", 4, groups=2, steps=steps, nbytes=0, compute_time=C, machine=FREE)
    assert r.mean_staleness == pytest.approx((2 * steps - 1) / (2 * steps))
    with pytest.raises(ValueError, match="--groups 5 with 4 workers"):
        simulate("grouped", 4, groups=5, steps=5, nbytes=0, compute_time=C)


def test_unmodelled_paradigms_are_refused():
    with pytest.raises(ValueError, match="not modelled"):
        simulate("hsp", 4, steps=5, nbytes=0, compute_time=C)
    assert len(sweep(["asp", "bsp"], [2, 3], steps=5, nbytes=0, compute_time=C)) == 4


def test_cli_simulate_table_plot_and_bad_paradigm(tmp_path, capsys):
    assert main(["simulate", "--paradigm", "asp", "bsp", "--workers", "4", "16", "--steps", "5",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| asp | 16 |" in out and (tmp_path / "simulated_throughput.png").stat().st_size > 10_000
    assert main(["simulate", "--paradigm", "hsp", "--workers", "4"]) == 2
    assert "not modelled" in capsys.readouterr().err


# -- per-node links: transfers are flows on the server's link, capped by each worker's ---------------------

B, R = 10 ** 6, 10 ** 8  # bytes of a transfer; a worker link's bytes/s (a transfer alone: 10 ms)
LINKED = Machine(latency=0.0, server_s=0.0, apply_rate=1e30)


PULL_WITH_PUSH = f"{Path(__file__).resolve().parents[2] / 'examples' / 'pull_with_push.py'}:PullWithPush"


def test_a_worker_that_never_waits_overlaps_its_pull_with_its_push_over_links():
    """Pull B/R, compute C; the push and the next pull go opposite ways at once: a period of C + B/R (the
    plug-in of examples/pull_with_push.py). asp, whose pull waits for its push's update, takes C + 2B/R."""
    links = Links(server=R, workers=(R,))
    never = simulate(PULL_WITH_PUSH, 1, steps=30, nbytes=B, compute_time=C, machine=LINKED, links=links)
    assert never.per_worker_rate[0] == pytest.approx(1 / (C + B / R))
    asp = simulate("asp", 1, steps=30, nbytes=B, compute_time=C, machine=LINKED, links=links)
    assert asp.per_worker_rate[0] == pytest.approx(1 / (C + 2 * B / R))


@pytest.mark.parametrize("server_factor", [1, 4])
def test_bsp_pulls_and_pushes_share_the_servers_link(server_factor):
    """4 workers at R, the server at F x R: the 4 pulls share its up-link (4B/(F R) when F < 4), the
    pushes its down-link alike; a round is C + 2 x 4B / min(F R, 4R)."""
    links = Links(server=server_factor * R, workers=(R,) * 4)
    r = simulate("bsp", 4, steps=20, nbytes=B, compute_time=C, machine=LINKED, links=links)
    transfer = 4 * B / min(server_factor * R, 4 * R)
    assert r.per_worker_rate[0] == pytest.approx(1 / (C + 2 * transfer))


def test_a_slow_link_makes_a_network_straggler_and_its_share_goes_to_the_others():
    """Worker 3's link at R/4, the server at 4R: bsp's round waits for its 4B/R pull and push; the fast
    workers' transfers are not slowed by it (max-min: its unused share goes to them)."""
    links = Links(server=4 * R, workers=(R, R, R, R / 4))
    r = simulate("bsp", 4, steps=20, nbytes=B, compute_time=C, machine=LINKED, links=links)
    assert r.per_worker_rate[0] == pytest.approx(1 / (C + 2 * 4 * B / R))


def test_links_come_from_the_words_hpcps_emulate_takes():
    links = Links.from_words(["1gbit", "0=4gbit", "2=250mbit"], 3)
    assert links.server == 5e8 and links.workers == (1.25e8, 3.125e7, 1.25e8)
    with pytest.raises(ValueError, match="nodes are 0 to 3"):
        Links.from_words(["7=1gbit"], 3)


def test_one_fair_link_splits_its_capacity_and_gives_what_a_capped_transfer_leaves_to_the_others():
    from hpcps.analysis.fairshare import FairNetwork

    link = FairNetwork({"link": 100.0})
    link.add(0.0, "a", 100.0, ("link",), 100.0)
    link.add(0.0, "b", 100.0, ("link",), 30.0)
    assert link.rates() == {"a": 70.0, "b": 30.0}
    t, key = link.next_done()
    assert key == "a" and t == pytest.approx(100 / 70)
    link.finish(t, "a")
    assert link.rates() == {"b": 30.0} and link.next_done()[0] == pytest.approx(100 / 30)


@pytest.mark.parametrize("args, message", [
    (["--bandwidth", "0"], "--bandwidth must be above 0"),
    (["--apply-rate", "-1"], "--apply-rate must be above 0"),
    (["--latency", "-1"], "--latency must be 0 or more"),
    (["--steps", "0"], "--steps must be 1 or more"),
    (["--compute-time", "0"], "--compute-time must be above 0"),
    (["--workers", "0"], "--workers must be 1 or more"),
    (["--straggler", "0.5"], "--straggler must be 1 or more"),
])
def test_odd_simulator_inputs_are_one_error_line_never_a_traceback_or_nan(args, message, capsys):
    assert main(["simulate", "--paradigm", "bsp", "--workers", "4", *args]) == 2
    err = capsys.readouterr().err
    assert f"hpcps: error: simulate: {message}" in err and "Traceback" not in err
