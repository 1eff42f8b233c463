"""``--pull send``: under bsp the shards send each round's parameters to the workers (hpcps.transport.sent)
instead of each worker reading them out of the window. The values are the same, so a run is bit for bit the
window's; every push is followed by exactly one sent round; a stop raised by a worker reaches every worker
through the sent headers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hpcps
from hpcps.data.loaders import load_dataset
from hpcps.data.sharding import batch_indices
from mpitest import force_transfer, share, train

pytestmark = pytest.mark.mpi(min_size=5)


def _count_sent_pulls(monkeypatch) -> list:
    """Record each sent round a worker takes (one per push that waits for its grant)."""
    import hpcps.runtime.assembly as assembly

    made = []

    class Recording(assembly.SentPull):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(assembly, "SentPull", Recording)
    return made


@pytest.mark.timeout(180)
@pytest.mark.parametrize("extra", [{}, {"partition_mb": 0.004}, {"paradigm": "diloco", "local_steps": 3},
                                   {"partition_mb": 0.004, "transfer": "staged"}],
                         ids=["whole", "partitions", "diloco", "staged-partitions"])
def test_a_round_the_shards_send_ends_bit_for_bit_as_one_the_workers_read(world, mpi_tmp_path, monkeypatch, extra):
    """2 shards, 3 workers, 8 steps: with the rounds sent, the final parameters equal those of the run whose
    workers read the window (whole pulls; striped partitions pushed during backward and pulled in the pass's
    order; diloco's outer rounds of 3 local steps; a GPU worker's path, the values landing in a staging
    buffer and going up partition by partition, on the CPU), every gradient applied, and each worker took
    one sent round per push; each run file records which way its rounds came, and whether they left the
    shards a piece at a time."""
    extra = dict(extra)
    if "transfer" in extra:
        force_transfer(monkeypatch, extra.pop("transfer"))
    made = _count_sent_pulls(monkeypatch)
    common = {"paradigm": "bsp", "servers": 2, "steps": 8, "seed": 4, "lr": 0.1, **extra}
    read, r = train(mpi_tmp_path / "get.h5", pull="get", **common)
    assert not made  # (the window's pulls)
    sent, t = train(mpi_tmp_path / "send.h5", pull="send", **common)
    counts = world.gather(len(made), root=0)
    rounds = 8 if "local_steps" not in extra else math.ceil(8 / extra["local_steps"])
    facts = None
    if world.rank == 0:
        s, up = t["summary"], t["servers/updates"]
        facts = {"same": bool(np.array_equal(read.params, sent.params)),
                 "moved": float(np.abs(read.params - sent.params).max()),
                 "counts": counts, "pushed": int(s["gradients_pushed"]), "applied": int(s["gradients_applied"]),
                 "versions": sorted(set(up["version"][up["shard"] == 0].tolist())),
                 "recorded": (str(r["attrs"]["pull"]), str(t["attrs"]["pull"])),
                 "release": (str(r["attrs"]["release"]), str(t["attrs"]["release"]))}
    facts = share(world, facts)
    assert facts["same"], facts["moved"]
    assert facts["counts"] == [0, 0, rounds, rounds, rounds]  # ranks 0-1 the shards, 2-4 the workers
    assert facts["pushed"] == facts["applied"] == 3 * rounds
    assert facts["versions"] == list(range(rounds))  # one update per round
    assert facts["recorded"] == ("get", "send")  # the run file says how the rounds came
    # and how they left the shards: a piece at a time where bsp's shards send striped slices, else whole
    assert facts["release"] == ("whole", "pieces" if "partition_mb" in extra else "whole")


@pytest.mark.timeout(120)
def test_a_stop_asked_by_one_worker_reaches_every_worker_through_the_sent_rounds(world, mpi_tmp_path, monkeypatch):
    """The user's loop, ``ps.stop()`` by worker 0 at step 3 of 12, rounds sent: every worker ends after the
    same step (the stop flag travels in each shard's header), and every gradient pushed was applied."""
    made = _count_sent_pulls(monkeypatch)
    data = load_dataset("digits")
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)

    def make():
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    ps = hpcps.init(make, device="cpu", optimizer="sgd", lr=0.05, paradigm="bsp", servers=2, steps=12, pull="send",
                    progress=False, out=str(mpi_tmp_path / "stop.h5"), exit_on_error=False, comm=world)
    steps = 0
    with ps:
        while ps.running:
            idx = batch_indices(len(y), batch_size=16, n_workers=ps.n_workers, worker=ps.worker_index,
                                step=ps.iteration, seed=0)
            F.cross_entropy(ps.model(x[idx]), y[idx]).backward()
            if ps.iteration == 3 and ps.worker_index == 0:
                ps.stop("enough")
            ps.step()
            steps += 1
    ran = world.gather((steps, len(made)), root=0)
    facts = None
    if world.rank == 0:
        import h5py

        with h5py.File(ps.result.path) as f:
            s = dict(f["summary"].attrs)
        facts = {"ran": ran, "stopped_by": str(s["stopped_by"]), "pushed": int(s["gradients_pushed"]),
                 "applied": int(s["gradients_applied"])}
    facts = share(world, facts)
    workers = facts["ran"][2:]
    assert len({n for n, _ in workers}) == 1 and 4 <= workers[0][0] < 12, facts  # all alike, stopped early
    assert all(n == took for n, took in workers), facts  # a sent round per push
    assert facts["stopped_by"] == "loop: enough"
    assert facts["pushed"] == facts["applied"] == 3 * workers[0][0]


@pytest.mark.timeout(60)
def test_a_round_that_never_comes_is_reported_and_ends_the_wait(world):
    """A sent round whose shard never sends (each rank alone, on its own communicator): the wait's stall watch
    says what it waits for, then ends it (RunAborted), rather than waiting forever."""
    import logging

    from mpi4py import MPI

    from hpcps.cluster.slices import Slices
    from hpcps.errors import RunAborted
    from hpcps.transport.poll import StallWatch
    from hpcps.transport.sent import SentPull

    comm = MPI.COMM_SELF.Dup()
    said = []
    watch = lambda: StallWatch(warn=0.05, abort=0.3, log=logging.getLogger("test"), error=RunAborted,  # noqa: E731
                               describe=lambda: said.append(1) or "a round that never comes")
    pull = SentPull(comm, [0], Slices.contiguous([(0, 10)]), np.zeros(10, np.float32), watch=watch)
    with pytest.raises(RunAborted, match="a round that never comes"):
        pull.versions()
    for request in [*pull.heard, *pull.received]:  # (nothing will ever match them)
        request.Cancel()
        request.Wait()
    comm.Free()
    assert len(said) >= 2  # warned, then aborted


@pytest.mark.timeout(60)
def test_a_round_sent_a_piece_at_a_time_lands_whatever_the_order_its_pieces_are_sent_in(world):
    """A round released a piece at a time (hpcps.runtime.release): rank 0 announces it (the header before
    any values), then sends its slice's ranges in the order they are stepped, the last first; each worker
    sees the header before the values, and every range lands in its place."""
    from mpi4py import MPI

    from hpcps.cluster.slices import Slices
    from hpcps.transport.sent import ParamSender, SentPull

    comm = world.Dup()
    slices = Slices((((0, 16), (16, 48), (48, 64)),))  # one shard (rank 0), three ranges
    workers = list(range(1, comm.size))
    if comm.rank == 0:
        params = np.arange(64, dtype=np.float32)
        sender = ParamSender(comm, worker_ranks=workers, ranges=slices.local_ranges(0), length=64)
        sender.announce(range(len(workers)), 7, False)
        comm.Barrier()  # every worker saw the header, no values yet
        for lo, hi in ((48, 64), (0, 16), (16, 48)):
            sender.send_range(lo, hi, params)
        sender.drain()
        facts = None
    else:
        out = np.zeros(64, np.float32)
        pull = SentPull(comm, [0], slices, out)
        while not pull.announced():
            MPI.Request.Testall(pull.heard)
        early = [pull.test()]  # the header, and no value yet
        comm.Barrier()
        versions, stop = pull.wait()
        facts = (early, int(versions[0]), stop, bool(np.array_equal(out, np.arange(64, dtype=np.float32))))
    everyone = comm.gather(facts, root=0)
    comm.Free()
    if world.rank == 0:
        assert everyone[1:] == [([False], 7, False, True)] * len(workers)


@pytest.mark.timeout(180)
def test_a_checkpoint_of_rounds_sent_in_pieces_resumes_bit_for_bit_with_reads_and_with_sends(world, mpi_tmp_path):
    """2 shards, 3 workers, striped slices, SGD with momentum: a checkpoint written while the rounds go out a
    piece at a time (the optimizer's chunks cut at the pieces, and its parts saying so) resumes, with the
    workers reading the window (chunks not cut) and with the rounds sent again, to the parameters of the
    run never stopped, to the last bit."""
    common = {"paradigm": "bsp", "servers": 2, "seed": 5, "lr": 0.1, "momentum": 0.9, "partition_mb": 0.004}
    ckpt = mpi_tmp_path / "ckpt"
    train(mpi_tmp_path / "first.h5", pull="send", steps=4, checkpoint_every=2, checkpoint_dir=str(ckpt), **common)
    straight, _ = train(mpi_tmp_path / "straight.h5", pull="get", steps=4, **common)
    resumed = {pull: train(mpi_tmp_path / f"resumed-{pull}.h5", pull=pull, steps=4,
                           resume=str(ckpt / "step-000002.h5"), **common)[0] for pull in ("get", "send")}
    facts = None
    if world.rank == 0:
        part = torch.load(ckpt / "step-000002.optim-0.pt", weights_only=True)
        facts = {"spans": len(part.get("hpcps_spans", [])),
                 "same": {pull: bool(np.array_equal(r.params, straight.params)) for pull, r in resumed.items()}}
    facts = share(world, facts)
    assert facts["spans"] > 1  # the part says where its state is cut: at the pieces
    assert facts["same"] == {"get": True, "send": True}
