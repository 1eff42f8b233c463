"""Messages that come after their sender's place changed hands: the push inbox and the spare desk with a fake
communicator (no MPI job): what ULFM may deliver late cannot kill the shard a spare was meant to save."""

from __future__ import annotations

from collections import deque

import numpy as np
from mpi4py import MPI

from hpcps.runtime.spares import ASSIGN, JOIN, SpareDesk
from hpcps.transport import wire
from hpcps.transport.push import LostEvent, PushInbox, RunThrough


class FakeComm:
    """Point-to-point as the inbox and the desk use it: matched probes over a queue of (source, tag, values),
    receives that never complete, sends that complete at once (recorded)."""

    def __init__(self) -> None:
        self.queue: deque[tuple[int, int, np.ndarray]] = deque()
        self.sent: list[tuple[int, int, list]] = []

    def Improbe(self, source, tag, status):
        for k, (src, t, values) in enumerate(self.queue):
            if t == tag and source in (MPI.ANY_SOURCE, src):
                del self.queue[k]
                status.Set_source(src)
                status.Set_tag(t)
                return _Message(values)
        return None

    def Iprobe(self, source, tag, status):
        for src, t, _ in self.queue:
            if source in (MPI.ANY_SOURCE, src) and tag in (MPI.ANY_TAG, t):
                status.Set_source(src)
                status.Set_tag(t)
                return True
        return False

    def Irecv(self, buf, source, tag):
        return MPI.COMM_SELF.Irecv(buf, source=0, tag=4242)  # a real request that nobody completes

    def Isend(self, buf, dest, tag):
        self.sent.append((dest, tag, buf.tolist()))
        return _Request(True)

    def Recv_init(self, buf, source, tag):
        return _Request(False)


class _Message:
    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def Recv(self, buf) -> None:
        buf[:] = self.values


class _Request:
    def __init__(self, done: bool) -> None:
        self.done = done

    def Test(self) -> bool:
        return self.done

    def Start(self) -> None:
        pass


class Dead:
    """The run's dead ranks, as :class:`~hpcps.transport.failures.DeadRanks` shows them to the inbox."""

    def __init__(self) -> None:
        self.dead: set[int] = set()

    def check(self) -> None:
        pass


def _header(rank: int, clock: int) -> np.ndarray:
    header = np.zeros(wire.HEADER_LEN, np.int64)
    wire.encode_header(header, wire.KIND_PUSH, rank, clock, 0, 0.1)
    return header


def test_a_dead_workers_late_header_after_a_spare_took_its_place_is_dropped():
    """Regression: ``rejoin`` dropped the dead rank from the inbox's ranks, so its header that ULFM delivered
    after the join raised 'push header from rank 1, which is not a worker of this server' and killed the shard."""
    comm, dead = FakeComm(), Dead()
    inbox = PushInbox(comm, worker_ranks=[1, 2], shard_len=4, runthrough=RunThrough(dead, spares=[3]))
    dead.dead.add(1)  # worker 0 (rank 1) found dead, its place given to spare rank 3
    assert [e for e in inbox.poll() if isinstance(e, LostEvent)] == [LostEvent(0, ())]
    inbox.rejoin(0, 3)
    comm.queue.append((1, wire.TAG_PUSH_HEADER, _header(1, 5)))  # sent before it died, delivered now
    comm.queue.append((3, wire.TAG_PUSH_HEADER, _header(3, 5)))  # the spare's first push, of the same clock
    assert inbox.poll() == []
    assert inbox.clocks_in_hand([4, 0]) == [5, 0]  # the spare's header is taken up, the dead one's dropped
    assert 1 in inbox.retired and inbox.worker_ranks == [3, 2]
    inbox.free()  # (cancels the spare's payload receive)


def test_shard_0_assigns_no_spare_once_the_run_stops():
    """Regression: a worker that died between its leaves to shard 1 and shard 0 under a stop got a spare from
    shard 0, whose join shard 1 (which saw it leave) waited for until the spare's stall abort."""
    comm = FakeComm()
    desk = SpareDesk(comm, shard=0, shards=[0, 1], spares=[5], rounds=10)
    desk.died(0, 3, 2, stopping=True)
    assert comm.sent == [] and desk.poll(lambda w: True, [3, 0]) == [] and list(desk.idle) == [5]
    desk.died(0, 3, 2)  # not stopping: the spare is sent, shard 1 told
    assert [(dest, kind) for dest, _, (kind, *_) in comm.sent] == [(5, ASSIGN), (1, JOIN)]


def test_a_stall_report_says_what_mpi_holds_unmatched_from_a_silent_worker():
    """The shard's stall line tells a matching fault (bytes here, no receive took them: the wildcard receive
    of MPICH over UCX's TCP) from bytes that never came."""
    comm = FakeComm()
    inbox = PushInbox(comm, worker_ranks=[1, 2], shard_len=4)
    comm.queue.append((2, wire.TAG_PUSH_DATA, np.zeros(4, np.float32)))  # worker 1's (rank 2) payload, unmatched
    assert inbox.unmatched(0) is None
    assert inbox.unmatched(1) == "a push payload"
