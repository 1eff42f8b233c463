"""Pushes: worker-side persistent sends, server-side per-worker receives.

The worker's gradient leaves straight from its flat gradient buffer (one
persistent send per shard, no copy); the header travels in a separate small
message ahead of it (format in :mod:`wire`). Buffer ownership: a started
push owns the worker's gradient buffer until :meth:`Pusher.test` returns
true; the worker must not run backward into it before then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from mpi4py import MPI

from hpcps.transport import wire


class Pusher:
    """Worker side: sends ``grads`` (sliced by ``bounds``) to every shard."""

    def __init__(self, comm: MPI.Comm, *, grads: np.ndarray, shard_ranks: Sequence[int],
                 bounds: Sequence[tuple[int, int]], worker_rank: int) -> None:
        self.comm = comm
        self.worker_rank = worker_rank
        self.shard_ranks = list(shard_ranks)
        self.headers = np.zeros((len(self.shard_ranks), wire.HEADER_LEN), np.int64)
        self.requests: list[MPI.Prequest] = []
        for s, (rank, (lo, hi)) in enumerate(zip(self.shard_ranks, bounds)):
            self.requests.append(comm.Send_init(self.headers[s], dest=rank, tag=wire.TAG_PUSH_HEADER))
            self.requests.append(comm.Send_init(grads[lo:hi], dest=rank, tag=wire.TAG_PUSH_DATA))
        self._done: list[tuple[MPI.Request, np.ndarray]] = []
        self._started = False

    def start(self, clock: int, versions: np.ndarray, lr: float) -> None:
        """Begin pushing the gradient with ``clock``; ``versions[s]`` is shard s's version it used."""
        if self._started and not self.test():
            raise RuntimeError("push started while the previous one is still in flight")
        for s in range(len(self.shard_ranks)):
            wire.encode_header(self.headers[s], wire.KIND_PUSH, self.worker_rank, clock, int(versions[s]), lr)
        MPI.Prequest.Startall(self.requests)
        self._started = True

    def test(self) -> bool:
        """True once the last push's buffers may be reused."""
        return MPI.Request.Testall(self.requests)

    def start_done(self, clock: int) -> None:
        """Tell every shard this worker leaves after ``clock`` pushes (after any push in flight)."""
        for s, rank in enumerate(self.shard_ranks):
            buf = np.zeros(wire.HEADER_LEN, np.int64)
            wire.encode_header(buf, wire.KIND_DONE, self.worker_rank, clock, -1, 0.0)
            self._done.append((self.comm.Isend(buf, dest=rank, tag=wire.TAG_PUSH_HEADER), buf))

    def test_done(self) -> bool:
        return MPI.Request.Testall([r for r, _ in self._done]) and self.test()

    def free(self) -> None:
        for req in self.requests:
            req.Free()
        self.requests = []


@dataclass(frozen=True, slots=True)
class PushEvent:
    """A complete push (gradient held in the inbox until released)."""

    worker: int
    clock: int
    version: int
    lr: float


@dataclass(frozen=True, slots=True)
class LeaveEvent:
    worker: int
    clock: int


class PushInbox:
    """Server side: per-worker persistent receives of headers and gradients.

    Worker ``i`` (index into ``worker_ranks``) goes through the states
    header -> payload -> held. A held gradient stays in :meth:`gradient`
    until :meth:`release`, and only then is that worker's next header
    received, so a worker's later messages (including ``DONE``) are never
    read before its previous gradient is dealt with.
    """

    def __init__(self, comm: MPI.Comm, *, worker_ranks: Sequence[int], shard_len: int) -> None:
        n = len(worker_ranks)
        self.headers = np.zeros((n, wire.HEADER_LEN), np.int64)
        self.grads = np.zeros((n, shard_len), np.float32)
        self.header_reqs = [comm.Recv_init(self.headers[i], source=r, tag=wire.TAG_PUSH_HEADER)
                            for i, r in enumerate(worker_ranks)]
        self.data_reqs = [comm.Recv_init(self.grads[i], source=r, tag=wire.TAG_PUSH_DATA)
                          for i, r in enumerate(worker_ranks)]
        MPI.Prequest.Startall(self.header_reqs)
        self.open = n

    def poll(self) -> list[PushEvent | LeaveEvent]:
        """Advance every worker's state; return the pushes and leaves that completed."""
        events: list[PushEvent | LeaveEvent] = []
        for i in MPI.Request.Testsome(self.header_reqs) or ():
            h = self.headers[i]
            if h[0] == wire.KIND_PUSH:
                self.data_reqs[i].Start()
            else:
                self.open -= 1
                events.append(LeaveEvent(i, int(h[2])))
        for i in MPI.Request.Testsome(self.data_reqs) or ():
            h = self.headers[i]
            events.append(PushEvent(i, int(h[2]), int(h[3]), wire.decode_lr(h)))
        return events

    def gradient(self, worker: int) -> np.ndarray:
        return self.grads[worker]

    def release(self, worker: int) -> None:
        """The held gradient of ``worker`` is used up; receive its next message."""
        self.header_reqs[worker].Start()

    def free(self) -> None:
        for req in self.header_reqs + self.data_reqs:
            req.Free()
        self.header_reqs = self.data_reqs = []
