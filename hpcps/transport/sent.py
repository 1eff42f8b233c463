"""Sent pulls (``--pull send``): under bsp each shard sends a round's parameters to its workers as the round
closes, instead of each worker reading them out of the window after its grant.

A bsp round ends the same way for every worker: the shard steps, publishes, grants everyone, and every
worker at once reads the same values. Read one-sidedly that costs a worker a round trip per shard (the
slot's version and pin, then its copies), and over TCP a ``Get`` is served as a message exchange
behind whatever else the shard's link carries. The shard knows when the values are ready and who wants
them, so it can simply send them: a header (the version and the stop flag), then its slice's ranges in
their local order (the flat order: a pass's first layers first), one message each with a tag of its own
(:data:`~hpcps.transport.wire.TAG_SENT` + k), as a push's pieces go the other way.
``tools/bench_piecewise.py`` measured it before it was built, and ``tools/bench_allreduce.py --pulls get
send`` measures it against DDP (docs/results.md). A round released a piece at a time
(:mod:`hpcps.runtime.release`) sends its header first (:meth:`ParamSender.announce`) and each range as it
is stepped (:meth:`ParamSender.send_range`), in whatever order: the tags match them.

:class:`ParamSender` is the shard's side; :class:`SentPull` the worker's: its receives are posted when
the worker's push has begun, and it answers as a window pull does (:class:`~hpcps.transport.window.Pull`:
versions, partitions in the pass's order, the whole), so partitioned pulls take either. A worker gets
exactly one sent round per grant, and posts exactly one :class:`SentPull` per push that waits for one:
the two sides' messages match in order (MPI keeps one sender's messages of one tag in the order they were
sent).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from mpi4py import MPI

from hpcps.cluster.slices import Slices
from hpcps.transport import wire
from hpcps.transport.poll import Backoff, wait_until


class ParamSender:
    """A shard's side: the round's parameters to each granted worker (by worker index).

    The values go from a copy of the shard's slice, kept until every send of it has completed: a round's
    sends have always completed before the next round can close (each worker received them before it
    pushed again), so the copy is free by then; :meth:`send` waits for it all the same."""

    def __init__(self, comm: MPI.Comm, *, worker_ranks: Sequence[int], ranges: Sequence[tuple[int, int, int]],
                 length: int) -> None:
        """``ranges``: ``(local, lo, hi)`` of the shard's slice (:meth:`Slices.local_ranges`): one message
        each, in this order; ``length``: the slice's values."""
        self.comm, self.worker_ranks = comm, list(worker_ranks)
        self.ranges = [(at, at + hi - lo) for at, lo, hi in ranges]
        self.copy = np.empty(length, np.float32)
        self.head = np.zeros(2, np.int64)
        self.pending: list[MPI.Request] = []
        self.announced = -1  # the version of the round under way a piece at a time (announce())
        self._dests: list[int] = []

    def send(self, workers: Sequence[int], params: np.ndarray, version: int, stop: bool,
             backoff: Backoff | None = None) -> None:
        """Send ``params`` (the slice, fp32), published as ``version``, to ``workers`` (indices, at least
        one): each gets the header, then the ranges; the workers take turns per range, starting at a
        different one each round so that no worker is always served last."""
        self.drain(backoff)
        self.copy[:] = params
        self.head[:] = (version, int(stop))
        dests = [self.worker_ranks[w] for w in workers]
        self.pending = [self.comm.Isend(self.head, dest=d, tag=wire.TAG_SENT_HEAD) for d in dests]
        turn = version % len(dests)
        dests = dests[turn:] + dests[:turn]
        for k, (a, b) in enumerate(self.ranges):
            self.pending += [self.comm.Isend(self.copy[a:b], dest=d, tag=wire.TAG_SENT + k) for d in dests]

    def announce(self, workers: Sequence[int], version: int, stop: bool, backoff: Backoff | None = None) -> None:
        """Begin a round sent a piece at a time (:mod:`hpcps.runtime.release`): its header to ``workers``
        now, its ranges with :meth:`send_range` as each is stepped (:meth:`send` then sends nothing more)."""
        self.drain(backoff)
        self.head[:] = (version, int(stop))
        dests = [self.worker_ranks[w] for w in workers]
        self.pending = [self.comm.Isend(self.head, dest=d, tag=wire.TAG_SENT_HEAD) for d in dests]
        turn = version % len(dests)
        self._dests, self.announced = dests[turn:] + dests[:turn], version

    def send_range(self, lo: int, hi: int, params: np.ndarray) -> None:
        """Send ``params[lo:hi]`` (one of the ranges, stepped) to the announced round's workers."""
        k = self.ranges.index((lo, hi))  # (a range of the slice, whole: its receive takes it by its tag)
        self.copy[lo:hi] = params[lo:hi]
        self.pending += [self.comm.Isend(self.copy[lo:hi], dest=d, tag=wire.TAG_SENT + k) for d in self._dests]

    def progress(self) -> None:
        """Move the sends (over TCP a large message leaves only while its rank calls into MPI)."""
        if self.pending and MPI.Request.Testall(self.pending):
            self.pending = []

    def drain(self, backoff: Backoff | None = None) -> None:
        """Wait politely for every send in flight."""
        wait_until(lambda: not self.pending or MPI.Request.Testall(self.pending), backoff,
                   what="the workers to receive its last sent round (--pull send)")
        self.pending = []


class SentPull:
    """A worker's side: one sent round, received into ``out`` (the flat vector, fp32), with the interface
    of a window's :class:`~hpcps.transport.window.Pull`: :meth:`versions`, :meth:`wait_part` (``parts``:
    the flat vector's partitions, each a list of ``(lo, hi)``, in the order the pass wants them; without
    them, one partition per shard), :meth:`test`, :meth:`wait`. Its receives are posted at once. ``watch()``
    (optional) makes each wait's watchdog (:class:`~hpcps.transport.poll.StallWatch`): a round that never
    comes is reported, then ends the run, rather than waited for forever."""

    __slots__ = ("heads", "heard", "received", "copies", "ranges", "done", "backoff", "watch")

    def __init__(self, comm: MPI.Comm, shard_ranks: Sequence[int], slices: Slices, out: np.ndarray,
                 parts: Sequence[Sequence[tuple[int, int]]] | None = None, backoff: Backoff | None = None,
                 watch: Callable[[], Callable[[float], object]] | None = None) -> None:
        self.backoff, self.watch = backoff, watch
        self.heads = np.zeros((len(shard_ranks), 2), np.int64)
        self.heard = [comm.Irecv(self.heads[s], source=r, tag=wire.TAG_SENT_HEAD) for s, r in enumerate(shard_ranks)]
        received: list[tuple[int, int, MPI.Request]] = []
        for s, rank in enumerate(shard_ranks):
            for k, (_at, lo, hi) in enumerate(slices.local_ranges(s)):
                received.append((lo, hi, comm.Irecv(out[lo:hi], source=rank, tag=wire.TAG_SENT + k)))
        self.received = [r for *_, r in received]
        self.ranges = [list(p) for p in parts] if parts is not None else [list(p) for p in slices.pieces]
        # per partition, the messages that hold some of it
        self.copies = [[r for lo, hi, r in received if any(lo < b and a < hi for a, b in ranges)]
                       for ranges in self.ranges]
        self.done = [False] * len(self.ranges)

    @property
    def n_parts(self) -> int:
        return len(self.ranges)

    def test(self) -> bool:
        """Whether the header and every range have come (drives MPI's progress)."""
        return MPI.Request.Testall(self.heard) and all(self.done[k] or MPI.Request.Testall(self.copies[k])
                                                       for k in range(self.n_parts))

    def announced(self) -> bool:
        """Whether every shard's header has come: each shard granted the push this round answers (a round
        released a piece at a time sends its header before its grant, which queues behind the values)."""
        return MPI.Request.Testall(self.heard)

    def versions(self) -> tuple[np.ndarray, bool]:
        """Wait politely for the shards' headers; return their versions and whether any raised the stop flag."""
        self._wait(lambda: MPI.Request.Testall(self.heard))
        return self.heads[:, 0].copy(), bool(self.heads[:, 1].any())

    def wait_part(self, k: int) -> None:
        """Wait politely for partition ``k``; its values are then in ``out``."""
        if k >= self.n_parts or self.done[k]:
            return
        self._wait(lambda: MPI.Request.Testall(self.copies[k]))
        self.done[k] = True

    def wait(self) -> tuple[np.ndarray, bool]:
        """Wait politely for all of it; return (shard versions, any stop flag raised)."""
        result = self.versions()
        for k in range(self.n_parts):
            self.wait_part(k)
        self._wait(lambda: MPI.Request.Testall(self.received))  # (a range in no partition)
        return result

    def _wait(self, test: Callable[[], bool]) -> None:
        wait_until(test, self.backoff, self.watch() if self.watch is not None else None)
