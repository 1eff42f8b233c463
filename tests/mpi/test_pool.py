"""Paradigms that apply on arrival receive into a small pool of buffers: nothing lost with one buffer."""

import pytest

import hpcps.run
from hpcps.transport.push import PushInbox
from mpitest import share, train

pytestmark = pytest.mark.mpi(min_size=5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("paradigm", ["asp", "ssp", "dssp", "eager"])
def test_one_receive_buffer_for_four_workers_loses_nothing(world, mpi_tmp_path, paradigm, monkeypatch):
    """With a pool of 1 the four workers' payloads take turns in one buffer (the others wait at their
    senders): every gradient is still applied once, one update each, and the bounds still hold."""
    monkeypatch.setattr(hpcps.run, "RECEIVE_POOL", 1)
    held = []  # on the shard: (pooled, most gradients held at once)

    class Spy(PushInbox):
        def _give_buffers(self):
            super()._give_buffers()
            held.append((self.pooled, len(self.buffer_of), len(self.grads)))

    monkeypatch.setattr(hpcps.run, "PushInbox", Spy)
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
