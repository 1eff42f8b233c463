"""Published parameters in an RMA window; one-sided pulls that never tear.

Each server shard owns a block of the window (layout in :mod:`wire`). The
shard *publishes* its master parameters into it; a worker *pulls* with
``Rget`` of every shard's header and data, polling the requests with a
backoff. A pull returns each shard's parameters together with the one
version they belong to. Two protocols guarantee that:

``seqlock`` (used where the MPI library gives the unified memory model,
``MPI_WIN_UNIFIED``, as MPICH and Open MPI do)
    Every rank holds a shared ``Lock_all`` for the window's lifetime and
    nobody ever locks exclusively, so a pull needs nothing from the
    server's CPU: within a node it is a copy out of shared memory, across
    nodes an RDMA read. The shard writes publish *k* into slot ``k % 2``,
    bracketed by a counter (``2k-1`` while writing, ``2k`` when done, each
    step followed by ``MPI_Win_sync``). A reader reads the counter, copies
    the slot of the newest complete publish *j*, and reads the counter
    again: the copy is good unless publish ``j+2``, the next one to write
    that slot, had begun (counter ``>= 2j+3``); otherwise it retries. Two
    slots mean a reader is never turned away by the publish in progress,
    only by one that laps it.

``locked`` (the fallback for the separate memory model)
    The shard copies its parameters in under an exclusive lock on itself;
    readers ``Get`` under shared locks. With MPICH a shared lock after an
    exclusive one is granted only when the target is inside MPI, so pulls
    then wait for the server's next poll.

``HPCPS_WINDOW={auto,seqlock,locked}`` overrides the choice (all ranks must
agree; ``auto`` is the default).
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
from mpi4py import MPI

from hpcps.transport import wire
from hpcps.transport.poll import Backoff, wait_until

PROTOCOLS = ("auto", "seqlock", "locked")


def choose_protocol(comm: MPI.Comm, wanted: str | None = None) -> str:
    """Collective over ``comm``: ``seqlock`` if every rank's MPI gives unified windows (or ``wanted`` says)."""
    wanted = wanted or os.environ.get("HPCPS_WINDOW", "auto")
    if wanted not in PROTOCOLS:
        raise ValueError(f"HPCPS_WINDOW={wanted!r}: expected one of {', '.join(PROTOCOLS)}")
    if wanted != "auto":
        return wanted
    probe = MPI.Win.Allocate(8, 1, comm=comm)
    try:
        unified = probe.Get_attr(MPI.WIN_MODEL) == MPI.WIN_UNIFIED
    finally:
        probe.Free()
    return "seqlock" if comm.allreduce(int(unified), op=MPI.MIN) else "locked"


class ParamWindow:
    """The run's parameter window (collective over ``comm`` to create and free).

    ``shard_ranks[s]`` is the rank (in ``comm``) of shard ``s``, whose
    parameters are the block ``bounds[s]`` of the flat vector. The calling
    rank exposes ``local_len`` float32 values (0 unless it is a shard).
    ``protocol`` is ``auto``, ``seqlock`` or ``locked`` (module docstring);
    None reads ``HPCPS_WINDOW``.
    """

    def __init__(self, comm: MPI.Comm, *, shard_ranks: Sequence[int],
                 bounds: Sequence[tuple[int, int]], local_len: int = 0, protocol: str | None = None) -> None:
        self.protocol = choose_protocol(comm, protocol)
        self.n_slots = 2 if self.protocol == "seqlock" else 1
        size = wire.WINDOW_HEADER_BYTES + 4 * local_len * self.n_slots if local_len else 0
        self.win: MPI.Win | None = MPI.Win.Allocate(size, 1, comm=comm)
        if self.protocol == "seqlock":
            self.win.Lock_all(MPI.MODE_NOCHECK)  # shared, for the window's lifetime; nobody locks exclusively
        self.rank = comm.rank
        self.shard_ranks = list(shard_ranks)
        self.bounds = list(bounds)
        self.header = None
        self.slots: list[np.ndarray] = []
        self._published = 0
        if local_len:
            mem = np.frombuffer(self.win.tomemory(), np.uint8)
            self.header = mem[: wire.WINDOW_HEADER_BYTES].view(np.int64)
            body = mem[wire.WINDOW_HEADER_BYTES:].view(np.float32)
            self.slots = [body[i * local_len:(i + 1) * local_len] for i in range(self.n_slots)]
            self.header[:] = 0
            if self.protocol == "seqlock":
                self.win.Sync()

    # -- lifetime -------------------------------------------------------
    def _live(self) -> MPI.Win:
        if self.win is None:
            raise RuntimeError("parameter window used after free()")
        return self.win

    def free(self) -> None:
        """Collective: release the window (idempotent)."""
        if self.win is not None:
            self.header, self.slots = None, []
            if self.protocol == "seqlock":
                self.win.Unlock_all()
            self.win.Free()
            self.win = None

    def __enter__(self) -> "ParamWindow":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    # -- server side ----------------------------------------------------
    def publish(self, params: np.ndarray, version: int) -> None:
        """Expose ``params`` as ``version`` of this rank's shard, atomically for readers."""
        win, h = self._live(), self.header
        if self.protocol == "locked":
            win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
            np.copyto(self.slots[0], params)
            h[wire.WIN_VERSION] = version
            win.Unlock(self.rank)
            return
        k = self._published + 1
        h[wire.WIN_SEQ] = 2 * k - 1
        win.Sync()
        np.copyto(self.slots[k % 2], params)
        h[wire.WIN_SLOT_VERSION + k % 2] = version
        win.Sync()
        h[wire.WIN_SEQ] = 2 * k
        h[wire.WIN_VERSION] = version
        win.Sync()
        self._published = k

    def set_stop(self) -> None:
        """Raise this shard's stop flag; workers see it at their next pull."""
        win = self._live()
        if self.protocol == "locked":
            win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
            self.header[wire.WIN_STOP] = 1
            win.Unlock(self.rank)
        else:
            self.header[wire.WIN_STOP] = 1
            win.Sync()

    # -- reader side ----------------------------------------------------
    def pull(self, out: np.ndarray, backoff: Backoff | None = None) -> tuple[np.ndarray, bool]:
        """Read every shard into its block of ``out``.

        Returns the shard versions (int64 array, one per shard) and whether
        any shard raised its stop flag. Waits politely. Safe to call from
        two threads at once under the seqlock protocol only.
        """
        if self.protocol == "locked":
            return self._read_locked(out, backoff)
        return self._read_seqlock(out, backoff)

    def peek(self, backoff: Backoff | None = None) -> np.ndarray:
        """The newest published version of every shard (headers only: 64 bytes per shard)."""
        if self.protocol == "locked":
            return self._read_locked(None, backoff)[0]
        heads = np.zeros((len(self.shard_ranks), 8), np.int64)
        self._get_headers(heads, range(len(self.shard_ranks)), backoff)
        return heads[:, wire.WIN_VERSION].copy()

    def _get_headers(self, heads: np.ndarray, shards, backoff: Backoff | None) -> None:
        win = self._live()
        requests = [win.Rget(heads[s], self.shard_ranks[s], (0, wire.WINDOW_HEADER_BYTES, MPI.BYTE)) for s in shards]
        wait_until(lambda: MPI.Request.Testall(requests), backoff)

    def _read_seqlock(self, out: np.ndarray, backoff: Backoff | None) -> tuple[np.ndarray, bool]:
        win = self._live()
        n = len(self.shard_ranks)
        before, after = np.zeros((n, 8), np.int64), np.zeros((n, 8), np.int64)
        pending = list(range(n))
        retry = Backoff(first=1e-5, cap=backoff.cap if backoff else 1e-3)
        while True:
            self._get_headers(before, pending, backoff)
            requests = []
            for s in pending:
                lo, hi = self.bounds[s]
                j = int(before[s, wire.WIN_SEQ]) // 2  # the newest complete publish
                offset = wire.WINDOW_HEADER_BYTES + 4 * (hi - lo) * (j % 2)
                requests.append(win.Rget(out[lo:hi], self.shard_ranks[s], (offset, 4 * (hi - lo), MPI.BYTE)))
            wait_until(lambda: MPI.Request.Testall(requests), backoff)
            self._get_headers(after, pending, backoff)
            pending = [s for s in pending
                       if after[s, wire.WIN_SEQ] >= 2 * (before[s, wire.WIN_SEQ] // 2) + 3]  # lapped: read again
            if not pending:
                break
            retry.pause()
        slot = (before[:, wire.WIN_SEQ] // 2) % 2
        versions = after[np.arange(n), wire.WIN_SLOT_VERSION + slot].copy()
        return versions, bool(after[:, wire.WIN_STOP].any())

    def _read_locked(self, out: np.ndarray | None, backoff: Backoff | None) -> tuple[np.ndarray, bool]:
        win = self._live()
        heads = np.zeros((len(self.shard_ranks), 8), np.int64)
        requests = []
        for s, (rank, (lo, hi)) in enumerate(zip(self.shard_ranks, self.bounds)):
            win.Lock(rank, MPI.LOCK_SHARED)
            requests.append(win.Rget(heads[s], rank, (0, wire.WINDOW_HEADER_BYTES, MPI.BYTE)))
            if out is not None:
                requests.append(win.Rget(out[lo:hi], rank, (wire.WINDOW_HEADER_BYTES, 4 * (hi - lo), MPI.BYTE)))
        wait_until(lambda: MPI.Request.Testall(requests), backoff)
        for rank in self.shard_ranks:
            win.Unlock(rank)
        return heads[:, wire.WIN_VERSION].copy(), bool(heads[:, wire.WIN_STOP].any())
