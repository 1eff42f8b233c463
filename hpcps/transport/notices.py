"""Notices from server shards to workers: receipts, grants, goodbyes.

Format in :mod:`wire`. The server's sends are nonblocking; each keeps its
small buffer alive until the send completes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from mpi4py import MPI

from hpcps.transport import wire
from hpcps.transport.failures import completed, found_dead
from hpcps.transport.poll import Backoff, wait_until


class Notifier:
    """Server side: send notices to workers (by worker index).

    Sends in flight are kept (with their buffers) until they complete, and
    forgotten at :meth:`progress`, which the server calls when it is idle,
    and on a send once ``max_pending`` are kept, so a server that is never
    idle does not keep every notice it ever sent.
    """

    def __init__(self, comm: MPI.Comm, *, worker_ranks: Sequence[int], max_pending: int = 256, dead=None) -> None:
        """``dead``: a :class:`~hpcps.transport.failures.DeadRanks` over ``comm`` (run-through): a notice to a
        worker that died is dropped, and so is one in flight to it when it died."""
        self.comm = comm
        self.dead = dead
        self.worker_ranks = list(worker_ranks)
        self.max_pending = max_pending
        self._pending: list[tuple[MPI.Request, np.ndarray]] = []

    def send(self, worker: int, flags: int, clock: int = -1, version: int = -1, staleness: int = -1,
             lr: float = float("nan")) -> None:
        """One notice to ``worker``; a receipt carries the rate its gradient was applied at (``lr``)."""
        buf = np.array([flags, clock, version, staleness, 0], np.int64)
        buf[4:5].view(np.float64)[0] = lr
        dest = self.worker_ranks[worker]
        if self.dead is not None and dest in self.dead.dead:
            return
        try:
            req = self.comm.Isend(buf, dest=dest, tag=wire.TAG_NOTICE)
        except MPI.Exception as exc:
            found_dead(self.dead, exc)
            return
        self._pending.append((req, buf))
        if len(self._pending) >= self.max_pending:
            self.progress()

    def progress(self) -> None:
        """Forget the notices whose sends completed."""
        if self._pending:
            self._pending = [(r, b) for r, b in self._pending if not completed(self.dead, r)]

    def drain(self, backoff: Backoff | None = None) -> None:
        def done() -> bool:
            self.progress()
            return not self._pending
        wait_until(done, backoff)


@dataclass(frozen=True, slots=True)
class Notice:
    shard: int
    flags: int
    clock: int
    version: int
    staleness: int
    lr: float = float("nan")  # a receipt's: the learning rate the gradient was applied at


class NoticeBox:
    """Worker side: one persistent receive per shard; restarted until ``BYE``."""

    def __init__(self, comm: MPI.Comm, *, shard_ranks: Sequence[int]) -> None:
        n = len(shard_ranks)
        self.bufs = np.zeros((n, wire.NOTICE_LEN), np.int64)
        self.reqs = [comm.Recv_init(self.bufs[s], source=r, tag=wire.TAG_NOTICE)
                     for s, r in enumerate(shard_ranks)]
        MPI.Prequest.Startall(self.reqs)
        self.open = n

    def poll(self) -> list[Notice]:
        out = []
        for s in MPI.Request.Testsome(self.reqs) or ():
            flags, clock, version, staleness = (int(v) for v in self.bufs[s, :4])
            out.append(Notice(s, flags, clock, version, staleness, float(self.bufs[s, 4:5].view(np.float64)[0])))
            if flags & wire.BYE:
                self.open -= 1
            else:
                self.reqs[s].Start()
        return out

    def free(self) -> None:
        for req in self.reqs:
            req.Free()
        self.reqs = []
