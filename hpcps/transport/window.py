"""Published parameters in an RMA window; one-sided pulls that never tear.

Each server shard owns a block of the window (layout in :mod:`wire`). The
shard *publishes* its master parameters into it; a worker *pulls* with
``Rget`` of every shard's header and data, polling the requests with a
backoff. A pull returns each shard's parameters together with the one
version they belong to. Two protocols guarantee that:

``pinned`` (used where the MPI library gives the unified memory model,
``MPI_WIN_UNIFIED``, as MPICH and Open MPI do)
    Every rank holds a shared ``Lock_all`` for the window's lifetime and
    nobody ever locks exclusively, so a pull needs nothing from the
    server's CPU: within a node it is a copy out of shared memory, across
    nodes an RDMA read (over TCP, which has no RDMA, the MPI library
    carries reads and atomics as messages its progress on the server
    answers: the server's polls serve them). The shard keeps :data:`SLOTS` copies of its
    parameters. A reader reads which slot holds the newest publish, *pins*
    that slot (an atomic increment of the slot's reader count), copies it
    with the version it holds, and unpins it. The shard writes a publish
    only into a slot that is neither the newest nor pinned: it *claims*
    the slot by swapping its reader count from 0 to a large negative value
    (compare-and-swap), writes it, says it is the newest, and releases the
    claim. A reader whose increment finds the slot claimed (a negative
    count: the shard took it for a newer publish between the reader's read
    of the newest slot and its pin) takes its increment back and starts
    over. So a pinned copy is never overwritten, and a pull never copies
    twice, however slow its link: a two-slot seqlock, which this replaced,
    let a 40 ms read over a 1 Gbit/s link be lapped by two publishes and
    read everything again.

    The shard claims the non-newest free slot it published longest ago.
    Where every such slot is pinned (readers slower than
    ``SLOTS - 1`` publishes), the shard keeps serving pushes and defers the
    publish (the newest version goes out at its next loop,
    :meth:`ParamWindow.publish_held`).

    What the MPI standard asks of this, and how it is met:

    * every header word (newest slot, versions, stop flag, reader counts)
      is written and read only by accumulate operations on ``MPI_INT64_T``
      (``Accumulate`` with ``REPLACE`` or ``SUM``, ``Fetch_and_op``,
      ``Compare_and_swap``, and ``Get_accumulate`` with ``NO_OP`` to read),
      which MPI makes atomic per element against each other;
    * every transfer's target type matches its origin type (``INT64_T``
      headers, ``FLOAT`` parameters);
    * the shard's stores to a slot are followed by ``Win_sync`` before its
      version and the newest-slot word say they are complete, and a reader
      reads the slot's version only once its pin is in place (the
      increment's request has completed, its old count fetched), so no
      store to the slot can overlap its copy.

``locked`` (the fallback for the separate memory model)
    The shard copies its parameters in under an exclusive lock on itself;
    readers ``Get`` under shared locks. With MPICH a shared lock after an
    exclusive one is granted only when the target is inside MPI, so pulls
    then wait for the server's next poll.

**Fan-in** (``fanin``, pinned): by default a pull reads every shard at once, so each reader's link
takes every shard's reply together, and each shard's link serves every reader together. Over TCP
that fan-in collapses on slow links (MPICH carries a ``Get`` as active messages; at 8 nodes on 10
Mbit/s, every other node's slice read at once took 4x the time of the same bytes read one node at a
time: ``tools/bench_patterns.py``). With ``fanin=K`` a pull reads at most ``K`` shards at once, in a
rotation that starts at shard ``first`` (the worker's index, so that each phase of a lock-step
round reads every shard once: a permutation), each shard's partitions in their order, and the next
shard's copies start as soon as one shard's have come.

``HPCPS_WINDOW={auto,pinned,locked}`` overrides the choice. Every rank
must say the same (it is checked: a mismatch ends every rank with one
message); ``auto`` is the default.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Sequence

import numpy as np
from mpi4py import MPI

from hpcps.cluster.slices import Slices
from hpcps.errors import UserError
from hpcps.transport import wire
from hpcps.transport.compress import Codec
from hpcps.transport.poll import Backoff, wait_until

PROTOCOLS = ("auto", "pinned", "locked")
SLOTS = 3  # pinned: copies of the parameters a shard keeps (wire.WIN_MAX_SLOTS at most)
CLAIMED = -(1 << 40)  # pinned: a slot's reader count while the shard writes it
_I64 = MPI.INT64_T
_HEADER_WORDS = wire.WINDOW_HEADER_BYTES // 8
_NOTHING = np.zeros(_HEADER_WORDS, np.int64)  # the ignored origin of NO_OP reads (read-only, shared by threads)


def choose_protocol(comm: MPI.Comm, wanted: str | None = None) -> str:
    """Collective over ``comm``: the protocol every rank will use.

    ``wanted`` (else ``$HPCPS_WINDOW``, else ``auto``) must be the same on
    every rank: a mismatch raises :class:`UserError` on all of them, never
    a window two ranks read differently. ``auto`` is ``pinned`` if every
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
    return "pinned" if memory_model(comm) == "unified" else "locked"


def memory_model(comm: MPI.Comm) -> str:
    """Collective over ``comm``: ``unified`` if every rank's MPI gives unified windows, else ``separate``."""
    probe = MPI.Win.Allocate(8, 1, comm=comm)
    try:
        unified = probe.Get_attr(MPI.WIN_MODEL) == MPI.WIN_UNIFIED
    finally:
        probe.Free()
    return "unified" if comm.allreduce(int(unified), op=MPI.MIN) else "separate"


def _ranges(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks[:8]) + (",..." if len(ranks) > 8 else "")


def _raised(heads: np.ndarray) -> bool:
    """Whether any shard's header (a row of ``heads``) has its stop flag raised for readers (a pending stop,
    :attr:`ParamWindow.stop_at_publish`, is not yet)."""
    return bool((heads[:, wire.WIN_STOP] == wire.STOP_RAISED).any())


class _Reads:
    """How a pull reads the shards' windows under each protocol (a mixin of :class:`ParamWindow`, whose window
    and attributes it uses; the protocols are the module docstring's): the pinned protocol's slots, pinned and
    read without a lock (:meth:`_begin_pinned`), and the locked protocol's reads under shared locks
    (:meth:`_read_locked`); and a pull of one version of every shard (:meth:`pull_one_version`)."""

    def _get_words(self, out: np.ndarray, shards, first: int, count: int, backoff: Backoff | None) -> None:
        """Atomic read (Get_accumulate NO_OP, INT64) of header words ``first..first+count`` of ``shards``."""
        win = self._live()
        requests = [win.Rget_accumulate([_NOTHING[:count], count, _I64], [out[s, first:first + count], count, _I64],
                                        self.shard_ranks[s], (8 * first, count, _I64), MPI.NO_OP) for s in shards]
        wait_until(lambda: MPI.Request.Testall(requests), backoff)

    def _pin(self, shards, slots: np.ndarray, found: np.ndarray, delta: int, backoff: Backoff | None) -> None:
        """Add ``delta`` to the reader count of slot ``slots[s]`` of each shard, atomically (``Rget_accumulate``
        with ``SUM``); ``found[s]``: the count before. Returns once every addition is done at its shard."""
        win = self._live()
        add = np.full(1, delta, np.int64)  # our own: two threads may pull at once
        requests = [win.Rget_accumulate([add, 1, _I64], [found[s:s + 1], 1, _I64], self.shard_ranks[s],
                                        (8 * (wire.WIN_PINS + int(slots[s])), 1, _I64), MPI.SUM) for s in shards]
        wait_until(lambda: MPI.Request.Testall(requests), backoff)

    def _begin_pinned(self, out: np.ndarray, backoff: Backoff | None,
                      parts: Sequence[Sequence[tuple[int, int]]] | None = None) -> "Pull":
        """Pin each shard's newest slot (a slot claimed meanwhile means: read the newest again), then
        start the copies of the pinned slots with their versions (the versions first, then the data:
        each shard's whole slice, or ``parts`` in their order)."""
        win = self._live()
        n = len(self.shard_ranks)
        heads = np.zeros((n, _HEADER_WORDS), np.int64)
        slots = np.zeros(n, np.int64)
        found = np.zeros(n, np.int64)
        pending = list(range(n))
        retry = Backoff(first=1e-5, cap=backoff.cap if backoff else 1e-3)
        while pending:
            self._get_words(heads, pending, 0, wire.WIN_NEWEST + 1, backoff)  # version, stop flag, newest slot
            slots[pending] = heads[pending, wire.WIN_NEWEST]
            self._pin(pending, slots, found, +1, backoff)
            claimed = [s for s in pending if found[s] < 0]
            if claimed:
                self._pin(claimed, slots, found.copy(), -1, backoff)
                self.retries += len(claimed)
                retry.pause()
            pending = claimed
        versions = np.zeros(n, np.int64)
        heard = [win.Rget_accumulate([_NOTHING[:1], 1, _I64], [versions[s:s + 1], 1, _I64], self.shard_ranks[s],
                                     (8 * (wire.WIN_SLOT_VERSION + int(slots[s])), 1, _I64), MPI.NO_OP)
                 for s in range(n)]
        if parts is not None:
            # the versions before any copy starts: an atomic read may be answered only after the copies
            # queued before it (MPICH over TCP serves it as a message behind them), and a partitioned
            # pull's pass must know its versions before the last partition has come
            wait_until(lambda: MPI.Request.Testall(heard), backoff)
        land = self._landing(out)
        if parts is None:
            parts = [list(ranges) for ranges in self.slices.pieces]  # one partition per shard: its whole slice
        pieces = [(k, piece) for k, ranges in enumerate(parts) for lo, hi in ranges
                  for piece in self.slices.split(lo, hi)]  # piece: (shard, at, lo, hi)
        if self.fanin:  # each shard's pieces in partition order, the shards in this rank's rotation
            groups = [[(k, p) for k, p in pieces if p[0] == s] for s in ((self.first + j) % n for j in range(n))]
            groups = [g for g in groups if g]
        else:
            groups = [pieces]
        return Pull(self, out, heard, (versions, _raised(heads)), backoff, slots, list(parts), land, groups=groups,
                    issue=lambda piece: self._get_range(win, land, *piece, slots))

    def _get_range(self, win: MPI.Win, land: np.ndarray, s: int, at: int, lo: int, hi: int,
                   slots: np.ndarray) -> MPI.Request:
        """Start the copy of ``[lo, hi)`` of the flat vector, at ``at`` of shard ``s``'s slice, out of its
        pinned slot."""
        offset = wire.WINDOW_HEADER_BYTES + self.item * (self.lengths[s] * int(slots[s]) + at)
        t = self.mpi_type
        return win.Rget([land[lo:hi], hi - lo, t], self.shard_ranks[s], (offset, hi - lo, t))

    def pull_one_version(self, out: np.ndarray, backoff: Backoff | None = None,
                         at: int | None = None) -> tuple[np.ndarray, bool]:
        """A pull (:meth:`pull`) of one version of the model where the shards' slots allow it, for a reader that
        must name the model it read (the held-out evaluation). A pull reads the shards one after the other
        while they go on publishing, and under bsp a shard read late may be a round ahead of one read early:
        a model no step held (one trajectory's version 69 evaluated 0.956 in one run and 0.941 in another,
        docs/results.md).

        Where the versions read differ, the shards ahead are read again at the lowest one, out of the slots
        that still hold it (pinned, :meth:`_read_at`: a round ahead, the previous publish is there), all of
        them or none. Where one has moved on (``SLOTS - 1`` publishes or more ahead, as asp's shards may be
        over a slow link), and under the locked protocol's single copy, the pull stands as read: reading
        everything again would cost the workers' links as much again, and the shards of an asynchronous
        paradigm move on meanwhile.

        ``at``: the version to read where every shard has moved past it by the time it is read, out of the
        slots that still hold it (else the lowest, as above): ``--eval-every``'s version under a paradigm of
        rounds, whose rounds may be quicker than an evaluation takes to start, and whose every shard's read
        is then quick too. Returns the versions read (one, where it succeeded) and whether any stop flag was
        raised."""
        versions, stop = self.pull(out, backoff)
        low = int(versions.min())
        for version in dict.fromkeys(v for v in (at, low) if v is not None and v <= low):
            ahead = [s for s in range(len(versions)) if versions[s] != version]
            if not ahead:
                break
            if self.protocol == "pinned" and self._read_at(out, version, ahead, backoff):
                versions[ahead] = version
                break
        return versions, stop

    def _read_at(self, out: np.ndarray, version: int, shards: Sequence[int], backoff: Backoff | None) -> bool:
        """Pinned: read each of ``shards``' slices into ``out`` as it was at ``version``, out of the slot that
        still holds it (a shard keeps its last :data:`SLOTS` publishes, and writes over the one it published
        longest ago), if every one of them still holds it; else read nothing. Returns whether it read.

        As a pull's pin: the slots' versions are read again once the pins are in place, and a slot claimed or
        written anew between the two reads is not read."""
        win = self._live()
        words = np.zeros((len(self.shard_ranks), _HEADER_WORDS), np.int64)
        first, count = wire.WIN_SLOT_VERSION, self.n_slots
        self._get_words(words, shards, first, count, backoff)
        slots = np.zeros(len(self.shard_ranks), np.int64)
        for s in shards:
            match = np.flatnonzero(words[s, first:first + count] == version)
            if not len(match):
                return False
            slots[s] = match[0]
        found = np.zeros(len(self.shard_ranks), np.int64)
        self._pin(shards, slots, found, +1, backoff)
        self._get_words(words, shards, first, count, backoff)  # (with the pins in place)
        held = all(found[s] >= 0 and words[s, first + int(slots[s])] == version for s in shards)
        land = self._landing(out)
        if held:
            copies = [self._get_range(win, land, s, at, lo, hi, slots) for s in shards
                      for at, lo, hi in self.slices.local_ranges(s)]
            wait_until(lambda: MPI.Request.Testall(copies), backoff)
        self._pin(shards, slots, np.zeros(len(self.shard_ranks), np.int64), -1, backoff)
        if held and land is not out:  # a 16-bit window: widen what came
            for s in shards:
                for _, lo, hi in self.slices.local_ranges(s):
                    self.codec.decode_params(land[lo:hi], out[lo:hi])
        return held

    def _read_locked(self, out: np.ndarray | None, backoff: Backoff | None) -> tuple[np.ndarray, bool]:
        win = self._live()
        heads = np.zeros((len(self.shard_ranks), _HEADER_WORDS), np.int64)
        requests = []
        land, t = (self._landing(out), self.mpi_type) if out is not None else (None, None)
        for s, rank in enumerate(self.shard_ranks):
            win.Lock(rank, MPI.LOCK_SHARED)
            requests.append(win.Rget([heads[s], _HEADER_WORDS, _I64], rank, (0, _HEADER_WORDS, _I64)))
            for at, lo, hi in (self.slices.local_ranges(s) if out is not None else ()):
                requests.append(win.Rget([land[lo:hi], hi - lo, t], rank,
                                         (wire.WINDOW_HEADER_BYTES + self.item * at, hi - lo, t)))
        wait_until(lambda: MPI.Request.Testall(requests), backoff)
        for rank in self.shard_ranks:
            win.Unlock(rank)
        if out is not None and land is not out:
            self.codec.decode_params(land, out)
        return heads[:, wire.WIN_VERSION].copy(), _raised(heads)


class ParamWindow(_Reads):
    """The run's parameter window (collective over ``comm`` to create and free).

    ``shard_ranks[s]`` is the rank (in ``comm``) of shard ``s``, whose
    parameters are the block ``bounds[s]`` of the flat vector, or (``slices``,
    :mod:`hpcps.cluster.slices`) the ranges ``slices.pieces[s]``, one after the
    other in the shard's memory. The calling
    rank exposes ``local_len`` values (0 unless it is a shard) per slot.
    ``protocol`` is ``auto``, ``pinned`` or ``locked`` (module docstring);
    None reads ``HPCPS_WINDOW``.

    ``codec`` (:mod:`hpcps.transport.compress`) says what the slots hold: fp32 (the default), or
    16-bit copies of the shard's parameters (``bf16``, ``fp16``), which a pull widens into its fp32
    ``out``. A 16-bit window also holds the shard's fp32 master weights after its slots
    (:attr:`master`, where the shard keeps and steps them), which an ``exact`` pull reads.

    ``fanin`` (pinned; 0: every shard at once): the shards this rank's pulls read at once, in a
    rotation from shard :attr:`first` (module docstring).
    """

    def __init__(self, comm: MPI.Comm, *, shard_ranks: Sequence[int],
                 bounds: Sequence[tuple[int, int]] | None = None, slices: Slices | None = None,
                 local_len: int = 0, protocol: str | None = None, codec: Codec | None = None,
                 fanin: int = 0, first: int = 0) -> None:
        if (bounds is None) == (slices is None):
            raise ValueError("a window is given either bounds or slices")
        if fanin < 0:
            raise ValueError("fanin is 0 (every shard at once) or the shards read at once")
        self.fanin = fanin if fanin < len(shard_ranks) else 0
        self.first = first % len(shard_ranks)  # where this rank's rotation of the shards starts (fanin)
        self.protocol = choose_protocol(comm, protocol)
        self.n_slots = SLOTS if self.protocol == "pinned" else 1
        self.codec = codec or Codec()
        self.item = self.codec.pull_dtype.itemsize
        self.mpi_type = MPI.FLOAT if self.codec.identity_pull else MPI.UINT16_T
        master_bytes = 0 if self.codec.identity_pull else 4 * local_len
        size = wire.WINDOW_HEADER_BYTES + self.item * local_len * self.n_slots + master_bytes if local_len else 0
        self.win: MPI.Win | None = MPI.Win.Allocate(size, 1, comm=comm)
        if self.protocol == "pinned":
            self.win.Lock_all(MPI.MODE_NOCHECK)  # shared, for the window's lifetime; nobody locks exclusively
        self.rank = comm.rank
        self.shard_ranks = list(shard_ranks)
        self.slices = slices or Slices.contiguous(bounds)
        self.lengths = [self.slices.length(s) for s in range(self.slices.n_shards)]
        self.header = None
        self.slots: list[np.ndarray] = []
        self.master: np.ndarray | None = None  # a 16-bit window: the shard's fp32 master weights
        self._staging = threading.local()  # a 16-bit window: each thread's buffer its pulls land in
        self._newest = 0  # pinned: the slot of our newest publish
        self._age = [0] * self.n_slots  # pinned: publish count when each slot was last written
        self._published = 0
        #: a paradigm of rounds (bsp): a stop asked for goes up at the shard's next publish, not at once (a worker
        #: that pulled before it and one that pulled after would otherwise end a round apart, and the round's last
        #: gradients be applied as a round of their own); set by the run for its central window, on every rank
        self.stop_at_publish = False
        self._held: tuple[np.ndarray, int] | None = None  # a publish deferred while every free slot is pinned
        self.deferred = 0  # publishes deferred for pinned slots (this shard)
        self.retries = 0  # times this rank's pulls found the newest slot claimed and started over
        self._word = np.zeros(1, np.int64)
        self._one = np.ones(1, np.int64)
        if local_len:
            mem = np.frombuffer(self.win.tomemory(), np.uint8)
            self.header = mem[: wire.WINDOW_HEADER_BYTES].view(np.int64)
            end = wire.WINDOW_HEADER_BYTES + self.item * local_len * self.n_slots
            body = mem[wire.WINDOW_HEADER_BYTES:end].view(self.codec.pull_dtype)
            self.slots = [body[i * local_len:(i + 1) * local_len] for i in range(self.n_slots)]
            if master_bytes:
                self.master = mem[end:end + master_bytes].view(np.float32)
            self.header[:] = 0  # before anyone can reach the window: window creation is collective
            if self.protocol == "pinned":
                self.win.Sync()

    # -- lifetime -------------------------------------------------------

    def _live(self) -> MPI.Win:
        if self.win is None:
            raise RuntimeError("parameter window used after free()")
        return self.win

    def free(self) -> None:
        """Collective: release the window (idempotent)."""
        if self.win is not None:
            self.header, self.slots, self.master = None, [], None
            if self.protocol == "pinned":
                self.win.Unlock_all()
            self.win.Free()
            self.win = None

    def __enter__(self) -> "ParamWindow":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    # -- server side ----------------------------------------------------

    def _store(self, index: int, value: int, op=MPI.REPLACE) -> None:
        """Pinned: update our own header word atomically for readers (Accumulate, flushed)."""
        win = self._live()
        self._word[0] = value
        win.Accumulate([self._word, 1, _I64], self.rank, (8 * index, 1, _I64), op)
        win.Flush(self.rank)

    def _claim(self, slot: int) -> bool:
        """Pinned: take ``slot`` for writing if no reader has it pinned (Compare_and_swap 0 -> CLAIMED)."""
        win = self._live()
        new, expected, found = (np.array([v], np.int64) for v in (CLAIMED, 0, -1))
        win.Compare_and_swap([new, 1, _I64], [expected, 1, _I64], [found, 1, _I64], self.rank,
                             8 * (wire.WIN_PINS + slot))
        win.Flush(self.rank)
        return int(found[0]) == 0

    def publish(self, params: np.ndarray, version: int) -> bool:
        """Expose ``params`` as ``version`` of this rank's shard, atomically for readers.

        Returns False when readers have every slot it could write pinned
        (``pinned``): the publish is deferred, not lost, and goes out at the
        next :meth:`publish_held` or :meth:`publish` once a slot is free.
        ``params`` must then stay unchanged until one of those is called.
        """
        win = self._live()
        if self.protocol == "locked":
            win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
            self.codec.encode_params(params, self.slots[0])
            self.header[wire.WIN_VERSION] = version
            if self.stop_at_publish and self.header[wire.WIN_STOP] == wire.STOP_PENDING:
                self.header[wire.WIN_STOP] = wire.STOP_RAISED  # (see _raise_pending)
            # the separate memory model: the stores of this epoch, and a 16-bit window's fp32 masters (stepped
            # in place before it), reach the public copy here; exact pulls read them only while no shard steps
            win.Sync()
            win.Unlock(self.rank)
            return True
        others = sorted((s for s in range(self.n_slots) if s != self._newest or not self._published),
                        key=lambda s: self._age[s])
        slot = next((s for s in others if self._claim(s)), None)
        if slot is None:
            if self._held is None:
                self.deferred += 1
            self._held = (params, version)
            return False
        self._held = None
        win.Sync()
        self.codec.encode_params(params, self.slots[slot])
        win.Sync()  # the slot's stores are visible before its version and the newest-slot word say so
        self._store(wire.WIN_SLOT_VERSION + slot, version)
        self._store(wire.WIN_NEWEST, slot)
        self._store(wire.WIN_VERSION, version)
        self._store(wire.WIN_PINS + slot, -CLAIMED, MPI.SUM)  # release: readers may pin it now
        self._published += 1
        self._newest, self._age[slot] = slot, self._published
        self._raise_pending()
        return True

    def _raise_pending(self) -> None:
        """After a publish, under :attr:`stop_at_publish`: a stop asked for since the last one goes up now, with
        this version, so every worker of the round that just closed sees it at the same pull."""
        if self.stop_at_publish and self._stop_word() == wire.STOP_PENDING:
            self._raise(wire.STOP_RAISED)

    def publish_held(self) -> bool:
        """Publish a deferred version once a slot is free; True if nothing is left deferred."""
        if self._held is None:
            return True
        return self.publish(*self._held)

    def set_stop(self) -> None:
        """Raise this shard's stop flag; workers see it at their next pull (under :attr:`stop_at_publish`,
        the pull of this shard's next publish)."""
        self._raise(wire.STOP_PENDING if self.stop_at_publish else wire.STOP_RAISED)

    def _raise(self, value: int) -> None:
        """This shard's own stop word up to ``value`` (never down)."""
        win = self._live()
        if self.protocol == "locked":
            win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
            self.header[wire.WIN_STOP] = max(int(self.header[wire.WIN_STOP]), value)
            win.Unlock(self.rank)
        else:
            self._store(wire.WIN_STOP, value, MPI.MAX)

    def _stop_word(self) -> int:
        win = self._live()
        if self.protocol == "pinned":
            win.Fetch_and_op([self._one, 1, _I64], [self._word, 1, _I64], self.rank, 8 * wire.WIN_STOP, MPI.NO_OP)
            win.Flush(self.rank)
            return int(self._word[0])
        win.Lock(self.rank, MPI.LOCK_SHARED)
        word = int(self.header[wire.WIN_STOP])
        win.Unlock(self.rank)
        return word

    def stop_raised(self) -> bool:
        """This shard's stop flag, as readers see it (raised by :meth:`set_stop` or any rank's
        :meth:`request_stop`; a pending one, under :attr:`stop_at_publish`, once this shard has published)."""
        return self._stop_word() == wire.STOP_RAISED

    def stop_once_published(self) -> bool:
        """The stop flag as readers will see it after this shard's next publish (a round sent before its
        publish says it in its header, :mod:`hpcps.runtime.release`); a stop asked for later goes out with
        the round after."""
        word = self._stop_word()
        return word == wire.STOP_RAISED or (self.stop_at_publish and word == wire.STOP_PENDING)

    # -- reader side ----------------------------------------------------

    def request_stop(self) -> None:
        """From any rank: raise every shard's stop flag (an atomic ``Accumulate`` into each header), so
        every reader sees it at its next pull (under :attr:`stop_at_publish`, the pull of each shard's next
        publish). Used to spread a signal one rank received, and for the loop's ``ps.stop()``."""
        win = self._live()
        one = np.array([wire.STOP_PENDING if self.stop_at_publish else wire.STOP_RAISED], np.int64)
        for rank in self.shard_ranks:
            if self.protocol == "locked":
                win.Lock(rank, MPI.LOCK_SHARED)
            win.Accumulate([one, 1, _I64], rank, (8 * wire.WIN_STOP, 1, _I64), MPI.MAX)
            if self.protocol == "locked":
                win.Unlock(rank)
            else:
                win.Flush(rank)

    def pull(self, out: np.ndarray, backoff: Backoff | None = None, *, exact: bool = False) -> tuple[np.ndarray, bool]:
        """Read every shard into its block of ``out``.

        Returns the shard versions (int64 array, one per shard) and whether
        any shard raised its stop flag. Waits politely. Safe to call from
        two threads at once under the pinned protocol only.

        ``exact``: a 16-bit window's fp32 master weights instead of the published copies. They
        are read as they are, under no protocol: only while no shard steps them (every shard
        finished, or held at a BSP round's end), and the versions returned are the published ones.
        """
        if exact and self.codec.identity_pull is False:
            return self._read_masters(out, backoff)
        return self.begin_pull(out, backoff).wait()

    def _read_masters(self, out: np.ndarray, backoff: Backoff | None) -> tuple[np.ndarray, bool]:
        win = self._live()
        versions, stop = self.peek(backoff), False
        requests = []
        for s, rank in enumerate(self.shard_ranks):
            if self.protocol == "locked":
                win.Lock(rank, MPI.LOCK_SHARED)
            offset = wire.WINDOW_HEADER_BYTES + self.item * self.lengths[s] * self.n_slots
            for at, lo, hi in self.slices.local_ranges(s):
                requests.append(win.Rget([out[lo:hi], hi - lo, MPI.FLOAT], rank,
                                         (offset + 4 * at, hi - lo, MPI.FLOAT)))
        wait_until(lambda: MPI.Request.Testall(requests), backoff)
        if self.protocol == "locked":
            for rank in self.shard_ranks:
                win.Unlock(rank)
        return versions, stop

    def _landing(self, out: np.ndarray) -> np.ndarray:
        """Where a pull's data land: ``out`` itself (fp32 window), or this thread's 16-bit buffer."""
        if self.codec.identity_pull:
            return out
        buf = getattr(self._staging, "buf", None)
        if buf is None or len(buf) != len(out):
            buf = self._staging.buf = np.empty(len(out), self.codec.pull_dtype)
        return buf

    def begin_pull(self, out: np.ndarray, backoff: Backoff | None = None,
                   parts: Sequence[Sequence[tuple[int, int]]] | None = None) -> "Pull":
        """Start a pull: put every request it sends on the wire, return a :class:`Pull` to wait on.

        Over a network (TCP), a rank's messages to a shard leave in order: a small request sent
        after a large push waits until the whole push has gone (40 ms for 4.9 MB at 1 Gbit/s).
        A worker that pulls while its push is in flight therefore begins the pull first, then
        starts the push, and the two move at once, one each way on the full-duplex link.

        ``parts`` (pinned): the flat vector in partitions, each a list of ``(lo, hi)`` ranges, in the
        order they are wanted (:mod:`hpcps.runtime.partitions`): the versions are read first, then
        each partition's copies are sent in that order, and :meth:`Pull.wait_part` waits for one.
        """
        if self.protocol == "locked":
            return Pull(self, out, None, self._read_locked(out, backoff), backoff)
        return self._begin_pinned(out, backoff, parts)

    def peek(self, backoff: Backoff | None = None) -> np.ndarray:
        """The newest published version of every shard (headers only: 64 bytes per shard)."""
        if self.protocol == "locked":
            return self._read_locked(None, backoff)[0]
        heads = np.zeros((len(self.shard_ranks), _HEADER_WORDS), np.int64)
        self._get_words(heads, range(len(self.shard_ranks)), 0, _HEADER_WORDS, backoff)
        return heads[:, wire.WIN_VERSION].copy()

class Pull:
    """A pull in flight (:meth:`ParamWindow.begin_pull`): it owns ``out``, and pins one slot of every
    shard, until :meth:`wait` returns. Its copies come as partitions (one per shard unless the pull
    was given ``parts``): :meth:`wait_part` waits for one, and a 16-bit window's values are widened
    into ``out`` partition by partition, as each is waited for.

    ``groups``: the copies, as lists of ``(partition, piece)`` started a group at a time, at most the
    window's ``fanin`` groups in flight (every group at once without one); ``issue(piece)`` starts
    one copy. Waiting on the pull (any of its calls) starts the next group once one has come."""

    __slots__ = ("window", "out", "heard", "result", "backoff", "slots", "copies", "ranges", "done", "land",
                 "missing", "queue", "flight", "issue")

    def __init__(self, window: ParamWindow, out: np.ndarray, heard, result, backoff: Backoff | None,
                 slots: np.ndarray | None = None, ranges: list | None = None, land: np.ndarray | None = None,
                 groups: list | None = None, issue=None) -> None:
        self.window, self.out, self.heard, self.result = window, out, heard, result
        self.backoff, self.slots = backoff, slots
        #: where the copies land (``out``, or a 16-bit window's buffer of the thread that began the pull: a
        #: pull begun on one thread may be waited on another, which must widen what came, not its own buffer)
        self.land = out if land is None else land
        self.ranges = ranges or []
        self.copies: list[list[MPI.Request]] = [[] for _ in self.ranges]  # per partition: its copies started
        self.missing = [0] * len(self.ranges)  # per partition: its copies not started yet
        for group in groups or ():
            for k, _ in group:
                self.missing[k] += 1
        self.queue = deque(groups or ())
        self.flight: list[list[MPI.Request]] = []  # the groups started and not yet come
        self.issue = issue
        self.done = [False] * len(self.ranges)  # partitions waited for (and widened)
        self._advance()

    def _advance(self) -> None:
        """Forget the groups that have come; start the next while fewer than the fan-in are in flight.
        Nothing to do once every group has started (at once, without a fan-in): a poll then tests only the
        copies it waits for, as before groups."""
        if not self.queue:
            return
        self.flight = [g for g in self.flight if not MPI.Request.Testall(g)]
        limit = self.window.fanin or len(self.queue)
        while self.queue and len(self.flight) < limit:
            group = []
            for k, piece in self.queue.popleft():
                request = self.issue(piece)
                self.copies[k].append(request)
                self.missing[k] -= 1
                group.append(request)
            self.flight.append(group)

    def _came(self, k: int) -> bool:
        self._advance()
        return self._here(k)

    def _here(self, k: int) -> bool:
        """Whether partition ``k``'s copies have all started and come."""
        return not self.missing[k] and MPI.Request.Testall(self.copies[k])

    @property
    def n_parts(self) -> int:
        return len(self.ranges)

    def test(self) -> bool:
        """Whether every copy has arrived (drives MPI progress, and starts the copies the fan-in held)."""
        if self.heard is None:
            return True
        self._advance()
        return MPI.Request.Testall(self.heard) and all(self.done[k] or self._here(k) for k in range(self.n_parts))

    def versions(self) -> tuple[np.ndarray, bool]:
        """Wait politely for the versions of the pinned slots only (they are read first); return them and
        whether any stop flag was raised."""
        if self.heard is not None:
            wait_until(lambda: MPI.Request.Testall(self.heard), self.backoff)
        versions, stop = self.result
        return versions, stop  # (each pull reads into an array of its own)

    def wait_part(self, k: int) -> None:
        """Wait politely for partition ``k``'s copies; its values are then in ``out``."""
        if k >= self.n_parts or self.done[k]:  # (a locked window's pull has arrived whole already)
            return
        wait_until(lambda: self._came(k), self.backoff)
        self.done[k] = True
        land = self.land
        if land is not self.out:  # a 16-bit window: widen what came into fp32
            for lo, hi in self.ranges[k]:
                self.window.codec.decode_params(land[lo:hi], self.out[lo:hi])

    def wait(self) -> tuple[np.ndarray, bool]:
        """Wait politely for the copies, unpin, and return (shard versions, any stop flag raised)."""
        if self.heard is not None:
            # (no unpinning on an exception: a copy may still be in flight, and the shard must not write the
            # slot under it; the run is ending, and a pinned slot only defers the shard's publishes)
            for k in range(self.n_parts):
                self.wait_part(k)
            wait_until(lambda: MPI.Request.Testall(self.heard), self.backoff)
            shards = list(range(len(self.slots)))
            self.window._pin(shards, self.slots, np.zeros(len(shards), np.int64), -1, self.backoff)
            self.heard = None
        return self.result
