"""Paradigms that apply on arrival receive into a small pool of buffers: nothing lost with one buffer."""

import pytest

import hpcps.runtime.assembly
from hpcps.transport.push import PushInbox
from mpitest import share, train

pytestmark = pytest.mark.mpi(min_size=5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("paradigm", ["asp", "ssp", "dssp", "eager"])
def test_one_receive_buffer_for_four_workers_loses_nothing(world, mpi_tmp_path, paradigm, monkeypatch):
    """With a pool of 1 the four workers' payloads take turns in one buffer (the others wait at their
    senders): every gradient is still applied once, one update each, and the bounds still hold."""
    monkeypatch.setattr(hpcps.runtime.assembly, "RECEIVE_POOL", 1)
    held = []  # on the shard: (pooled, most gradients held at once)

    class Spy(PushInbox):
        def _give_buffers(self):
            super()._give_buffers()
            held.append((self.pooled, len(self.buffer_of), len(self.grads)))

    monkeypatch.setattr(hpcps.runtime.assembly, "PushInbox", Spy)
    steps = 30
    _, t = train(mpi_tmp_path / f"pool-{paradigm}.h5", paradigm=paradigm, steps=steps, seed=2)
    facts = None
    if world.rank == 0:
        up, it = t["servers/updates"], t["workers/iterations"]
        facts = {"pushed": int(t["summary"]["gradients_pushed"]), "applied": int(t["summary"]["gradients_applied"]),
                 "versions": sorted(up["version"].tolist()), "per_worker": sorted(
                     int((it["rank"] == r).sum()) for r in set(it["rank"].tolist())),
                 "pooled": {p for p, _, _ in held}, "most_held": max(n for _, n, _ in held),
                 "buffers": {b for _, _, b in held}}
    facts = share(world, facts)
    assert facts["pushed"] == facts["applied"] == 4 * steps
    assert facts["versions"] == list(range(4 * steps))  # one update per gradient, none twice
    assert facts["per_worker"] == [steps] * 4
    assert facts["pooled"] == {True} and facts["buffers"] == {1} and facts["most_held"] == 1


@pytest.mark.timeout(180)
def test_bsp_sums_its_rounds_in_a_pool_bit_for_bit_whatever_the_arrival_order(world, mpi_tmp_path, monkeypatch):
    """BSP sums each round in worker order as it arrives (hpcps.runtime.rounds): with one buffer (payloads
    strictly in worker order) and with two and worker 0 three times slower (payloads out of order,
    later ones waiting), the shard never holds more than its pool, applies one update per round, and
    ends with the same parameters bit for bit."""
    held = []

    class Spy(PushInbox):
        def _give_buffers(self):
            super()._give_buffers()
            held.append((self.pooled, len(self.buffer_of), len(self.grads)))

    monkeypatch.setattr(hpcps.runtime.assembly, "PushInbox", Spy)
    steps, runs = 15, {}
    for pool, slowdown in ((1, []), (2, ["1=3"])):
        monkeypatch.setattr(hpcps.runtime.assembly, "RECEIVE_POOL", pool)
        held.clear()
        result, t = train(mpi_tmp_path / f"bsp-pool{pool}.h5", paradigm="bsp", steps=steps, seed=3,
                          slowdown=slowdown, compute_time=0.01)
        if world.rank == 0:
            runs[pool] = {"params": result.params, "pushed": int(t["summary"]["gradients_pushed"]),
                          "applied": int(t["summary"]["gradients_applied"]),
                          "versions": sorted(set(t["servers/updates"]["version"].tolist())),
                          "held": {(p, b) for p, _, b in held}, "most_held": max(n for _, n, _ in held)}
    facts = None
    if world.rank == 0:
        facts = {"equal": bool((runs[1]["params"] == runs[2]["params"]).all()),
                 **{f"{k}{pool}": r[k] for pool, r in runs.items() for k in r if k != "params"}}
    facts = share(world, facts)
    for pool in (1, 2):
        assert facts[f"pushed{pool}"] == facts[f"applied{pool}"] == 4 * steps
        assert facts[f"versions{pool}"] == list(range(steps))  # one update per round
        assert facts[f"held{pool}"] == {(True, pool)} and facts[f"most_held{pool}"] <= pool
    assert facts["equal"]
