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
    bracketed by a counter (``2k-1`` while writing, ``2k`` when done). A
    reader reads the counter, copies the slot of the newest complete
    publish *j* together with that slot's version, synchronizes
    (``MPI_Win_sync``) and reads the counter again: the copy is good unless
    publish ``j+2``, the next one to write that slot, had begun (counter
    ``>= 2j+3``); otherwise it retries. Two slots mean a reader is never
    turned away by the publish in progress, only by one that laps it.

    What the MPI standard asks of this, and how it is met:

    * every header word (counter, versions, stop flag, hold count) is
      written and read only by accumulate operations on ``MPI_INT64_T``
      (the shard applies ``Accumulate`` with ``REPLACE`` to its own window and
      flushes; readers ``Get_accumulate`` with ``NO_OP``), which MPI makes
      atomic per element against each other;
    * every transfer's target type matches its origin type (``INT64_T``
      headers, ``FLOAT`` parameters);
    * the shard's stores to a slot are followed by ``Win_sync`` before the
      counter says they are complete, and the reader calls ``Win_sync``
      between its copy and its re-read, so the re-read is ordered after it;
    * the version a pull returns is read with the copy it belongs to and
      stands or falls with it: read after the first counter read (which
      was written after the slot's version), and checked by the re-read;
    * the only racing accesses left are a copy that may overlap the
      shard's stores to the other or (once lapped) the same slot, and a
      copy that raced is always thrown away.

    Retries are bounded: a reader lapped :data:`MAX_LAPS` times in a row on
    one shard raises that shard's *hold* count (``Accumulate`` ``SUM``).
    A shard checks the count before each publish and, while it is
    non-zero, keeps serving pushes but defers publishing (the newest
    version goes out at its next loop, :meth:`ParamWindow.publish_held`),
    so the held reader's next copy cannot be lapped; it then lowers the
    count.

``locked`` (the fallback for the separate memory model)
    The shard copies its parameters in under an exclusive lock on itself;
    readers ``Get`` under shared locks. With MPICH a shared lock after an
    exclusive one is granted only when the target is inside MPI, so pulls
    then wait for the server's next poll.

``HPCPS_WINDOW={auto,seqlock,locked}`` overrides the choice. Every rank
must say the same (it is checked: a mismatch ends every rank with one
message); ``auto`` is the default.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
from mpi4py import MPI

from hpcps.errors import UserError
from hpcps.transport import wire
from hpcps.transport.poll import Backoff, wait_until

PROTOCOLS = ("auto", "seqlock", "locked")
MAX_LAPS = 8  # seqlock: a reader lapped this often in a row holds the shard's publishes for one copy
_I64 = MPI.INT64_T
_HEADER_WORDS = wire.WINDOW_HEADER_BYTES // 8
_NOTHING = np.zeros(_HEADER_WORDS, np.int64)  # the ignored origin of NO_OP reads (read-only, shared by threads)


def choose_protocol(comm: MPI.Comm, wanted: str | None = None) -> str:
    """Collective over ``comm``: the protocol every rank will use.

    ``wanted`` (else ``$HPCPS_WINDOW``, else ``auto``) must be the same on
    every rank: a mismatch raises :class:`UserError` on all of them, never
    a window two ranks read differently. ``auto`` is ``seqlock`` if every
    rank's MPI gives unified windows, else ``locked``.
    """
    wanted = wanted or os.environ.get("HPCPS_WINDOW", "auto")
    said = comm.allgather(wanted)
    if len(set(said)) > 1:
        ranks = {w: [r for r, x in enumerate(said) if x == w] for w in dict.fromkeys(said)}
        raise UserError("HPCPS_WINDOW differs between ranks (" +
                        "; ".join(f"{w!r} on ranks {_ranges(r)}" for w, r in ranks.items()) +
                        "): export one value to the whole job")
    if wanted not in PROTOCOLS:
        raise UserError(f"HPCPS_WINDOW={wanted!r}: expected one of {', '.join(PROTOCOLS)}")
    if wanted != "auto":
        return wanted
    probe = MPI.Win.Allocate(8, 1, comm=comm)
    try:
        unified = probe.Get_attr(MPI.WIN_MODEL) == MPI.WIN_UNIFIED
    finally:
        probe.Free()
    return "seqlock" if comm.allreduce(int(unified), op=MPI.MIN) else "locked"


def _ranges(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks[:8]) + (",..." if len(ranks) > 8 else "")


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
        self._held: tuple[np.ndarray, int] | None = None  # seqlock: a publish deferred while a reader holds us
        self.deferred = 0  # publishes deferred for held readers (this shard)
        self.holds = 0  # times this rank's pulls had to hold a shard
        self._word = np.zeros(1, np.int64)
        self._one = np.ones(1, np.int64)
        if local_len:
            mem = np.frombuffer(self.win.tomemory(), np.uint8)
            self.header = mem[: wire.WINDOW_HEADER_BYTES].view(np.int64)
            body = mem[wire.WINDOW_HEADER_BYTES:].view(np.float32)
            self.slots = [body[i * local_len:(i + 1) * local_len] for i in range(self.n_slots)]
            self.header[:] = 0  # before anyone can reach the window: window creation is collective
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
    def _store(self, index: int, value: int) -> None:
        """Seqlock: set our own header word atomically for readers (Accumulate REPLACE, flushed)."""
        win = self._live()
        self._word[0] = value
        win.Accumulate([self._word, 1, _I64], self.rank, (8 * index, 1, _I64), MPI.REPLACE)
        win.Flush(self.rank)

    def _load(self, index: int) -> int:
        """Seqlock: read our own header word atomically (Fetch_and_op NO_OP, flushed)."""
        win = self._live()
        win.Fetch_and_op([self._one, 1, _I64], [self._word, 1, _I64], self.rank, 8 * index, MPI.NO_OP)
        win.Flush(self.rank)
        return int(self._word[0])

    def publish(self, params: np.ndarray, version: int) -> bool:
        """Expose ``params`` as ``version`` of this rank's shard, atomically for readers.

        Returns False when a lapped reader holds this shard (seqlock): the
        publish is deferred, not lost, and goes out at the next
        :meth:`publish_held` or :meth:`publish` once the reader is done.
        ``params`` must then stay unchanged until one of those is called.
        """
        win = self._live()
        if self.protocol == "locked":
            win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
            np.copyto(self.slots[0], params)
            self.header[wire.WIN_VERSION] = version
            win.Unlock(self.rank)
            return True
        if self._load(wire.WIN_HOLD) > 0:
            if self._held is None:
                self.deferred += 1
            self._held = (params, version)
            return False
        self._held = None
        k = self._published + 1
        self._store(wire.WIN_SEQ, 2 * k - 1)
        win.Sync()
        np.copyto(self.slots[k % 2], params)
        win.Sync()  # the slot's stores are visible before its version and the counter say so
        self._store(wire.WIN_SLOT_VERSION + k % 2, version)
        self._store(wire.WIN_SEQ, 2 * k)
        self._store(wire.WIN_VERSION, version)
        self._published = k
        return True

    def publish_held(self) -> bool:
        """Publish a deferred version once no reader holds this shard; True if nothing is left deferred."""
        if self._held is None:
            return True
        return self.publish(*self._held)

    def set_stop(self) -> None:
        """Raise this shard's stop flag; workers see it at their next pull."""
        win = self._live()
        if self.protocol == "locked":
            win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
            self.header[wire.WIN_STOP] = 1
            win.Unlock(self.rank)
        else:
            self._store(wire.WIN_STOP, 1)

    def stop_raised(self) -> bool:
        """This shard's stop flag, as readers see it (raised by :meth:`set_stop` or any rank's
        :meth:`request_stop`)."""
        win = self._live()
        if self.protocol == "seqlock":
            return self._load(wire.WIN_STOP) != 0
        win.Lock(self.rank, MPI.LOCK_SHARED)
        raised = bool(self.header[wire.WIN_STOP])
        win.Unlock(self.rank)
        return raised

    # -- reader side ----------------------------------------------------
    def request_stop(self) -> None:
        """From any rank: raise every shard's stop flag (an atomic ``Accumulate`` into each header), so
        every reader sees it at its next pull. Used to spread a signal one rank received."""
        win = self._live()
        one = np.ones(1, np.int64)
        for rank in self.shard_ranks:
            if self.protocol == "locked":
                win.Lock(rank, MPI.LOCK_SHARED)
            win.Accumulate([one, 1, _I64], rank, (8 * wire.WIN_STOP, 1, _I64), MPI.REPLACE)
            if self.protocol == "locked":
                win.Unlock(rank)
            else:
                win.Flush(rank)

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
        heads = np.zeros((len(self.shard_ranks), _HEADER_WORDS), np.int64)
        self._get_words(heads, range(len(self.shard_ranks)), 0, _HEADER_WORDS, backoff)
        return heads[:, wire.WIN_VERSION].copy()

    def _get_words(self, out: np.ndarray, shards, first: int, count: int, backoff: Backoff | None) -> None:
        """Atomic read (Get_accumulate NO_OP, INT64) of header words ``first..first+count`` of ``shards``."""
        win = self._live()
        requests = [win.Rget_accumulate([_NOTHING[:count], count, _I64], [out[s, first:first + count], count, _I64],
                                        self.shard_ranks[s], (8 * first, count, _I64), MPI.NO_OP) for s in shards]
        wait_until(lambda: MPI.Request.Testall(requests), backoff)

    def _hold(self, s: int, delta: int) -> None:
        win = self._live()
        word = np.array([delta], np.int64)  # our own: two threads may pull at once
        win.Accumulate([word, 1, _I64], self.shard_ranks[s], (8 * wire.WIN_HOLD, 1, _I64), MPI.SUM)
        win.Flush(self.shard_ranks[s])

    def _read_seqlock(self, out: np.ndarray, backoff: Backoff | None) -> tuple[np.ndarray, bool]:
        win = self._live()
        n = len(self.shard_ranks)
        before = np.zeros((n, _HEADER_WORDS), np.int64)
        slot_version = np.zeros((n, 1), np.int64)
        after = np.zeros((n, 1), np.int64)
        pending = list(range(n))
        laps = [0] * n
        held: list[int] = []
        retry = Backoff(first=1e-5, cap=backoff.cap if backoff else 1e-3)
        try:
            while True:
                self._get_words(before, pending, 0, _HEADER_WORDS, backoff)  # first read: counter, stop flag
                requests = []
                for s in pending:
                    lo, hi = self.bounds[s]
                    j = int(before[s, wire.WIN_SEQ]) // 2  # the newest complete publish
                    offset = wire.WINDOW_HEADER_BYTES + 4 * (hi - lo) * (j % 2)
                    requests.append(win.Rget([out[lo:hi], hi - lo, MPI.FLOAT], self.shard_ranks[s],
                                             (offset, hi - lo, MPI.FLOAT)))
                    requests.append(win.Rget_accumulate([_NOTHING[:1], 1, _I64], [slot_version[s], 1, _I64],
                                                        self.shard_ranks[s],
                                                        (8 * (wire.WIN_SLOT_VERSION + j % 2), 1, _I64), MPI.NO_OP))
                wait_until(lambda: MPI.Request.Testall(requests), backoff)
                win.Sync()  # the copy is ordered before the re-read
                self._get_words(after, pending, wire.WIN_SEQ, 1, backoff)
                lapped = [s for s in pending
                          if after[s, 0] >= 2 * (before[s, wire.WIN_SEQ] // 2) + 3]  # publish j+2 began
                for s in lapped:
                    laps[s] += 1
                    if laps[s] == MAX_LAPS:  # hold the shard's publishes for our next copy
                        self._hold(s, +1)
                        held.append(s)
                        self.holds += 1
                pending = lapped
                if not pending:
                    break
                retry.pause()
        finally:
            for s in held:
                self._hold(s, -1)
        return slot_version[:, 0].copy(), bool(before[:, wire.WIN_STOP].any())

    def _read_locked(self, out: np.ndarray | None, backoff: Backoff | None) -> tuple[np.ndarray, bool]:
        win = self._live()
        heads = np.zeros((len(self.shard_ranks), _HEADER_WORDS), np.int64)
        requests = []
        for s, (rank, (lo, hi)) in enumerate(zip(self.shard_ranks, self.bounds)):
            win.Lock(rank, MPI.LOCK_SHARED)
            requests.append(win.Rget([heads[s], _HEADER_WORDS, _I64], rank, (0, _HEADER_WORDS, _I64)))
            if out is not None:
                requests.append(win.Rget([out[lo:hi], hi - lo, MPI.FLOAT], rank,
                                         (wire.WINDOW_HEADER_BYTES, hi - lo, MPI.FLOAT)))
        wait_until(lambda: MPI.Request.Testall(requests), backoff)
        for rank in self.shard_ranks:
            win.Unlock(rank)
        return heads[:, wire.WIN_VERSION].copy(), bool(heads[:, wire.WIN_STOP].any())
