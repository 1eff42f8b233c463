"""Spare workers (``--spare-workers K``): a worker that dies under run-through is replaced mid-run.

Run-through (Open MPI's ULFM, docs/running.md) lets the living go on without a dead worker, and its
share of the training is lost to the run. A spare is a rank launched with the job that trains nothing
until a worker dies, then takes that worker's place: its index, so its share of the data and its
random stream; its clock, so it pushes the gradients the dead worker had not delivered; its place in
the paradigm's bounds (:meth:`hpcps.policies.base.Policy.on_join`). A spare is part of every
communicator and RMA window from the start, so it pulls, pushes and is counted like any worker: what
a newcomer started by ``MPI_Comm_spawn`` would lack (it is outside the windows, which cannot be grown
without stopping every rank).

Who decides: shard 0, the only shard every worker pushes to first. When it finds a worker dead it
takes the next idle spare and tells it ``ASSIGN (worker, clock)``: ``clock`` is the dead worker's
gradients shard 0 received whole, so a gradient cut off by the death is computed again. It tells every
other shard ``JOIN (worker, spare rank)``. A shard takes the join once it has found the worker dead
itself (its lost gradients accounted for first); a spare's push that comes before the word waits.
Shard 0 assigns nobody when no spare is idle or the dead worker had pushed all its gradients. When
shard 0's loop is over it sends ``CLOSING`` to the shards (no word follows: a shard that found a death
may end) and ``RELEASE`` to the idle spares, which then end the run with everyone.

What is not carried over: the dead worker's inner optimizer state (``--local-steps``), which died with
it (the spare's starts afresh), and a gradient another shard received whole while shard 0 lost it,
which the spare pushes again (that shard applies that step of the dead worker's twice).

Messages: int64[3] ``(kind, worker, value)`` on the PS communicator, tag ``wire.TAG_SPARE``.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from mpi4py import MPI

from hpcps.transport import wire
from hpcps.transport.failures import DeadRanks, completed, found_dead
from hpcps.transport.poll import Backoff, wait_until

log = logging.getLogger("hpcps")

ASSIGN, RELEASE, JOIN, CLOSING = 1, 2, 3, 4


@dataclass(frozen=True, slots=True)
class JoinEvent:
    """Spare rank ``rank`` takes the place of worker ``worker`` (an index), pushing from gradient ``clock + 1``."""

    worker: int
    rank: int
    clock: int


class SpareDesk:
    """A central shard's side of the spares. Shard 0 (``coordinator``) assigns them; every shard learns the
    joins (:meth:`poll`, merged into its events) and whether it must wait for a word before it ends
    (:meth:`pending`). ``spares``: the spare ranks; ``shards``: the central shards' ranks; ``rounds``: the
    pushes each worker makes (a dead worker that made them all gets no spare)."""

    def __init__(self, comm: MPI.Comm, *, shard: int, shards: Sequence[int], spares: Sequence[int],
                 rounds: int, dead: DeadRanks | None = None) -> None:
        """``dead``: the run's dead ranks (run-through): a spare found dead is never assigned, and a word to
        one that died meanwhile is dropped (its place's death is then found again, and the next spare sent)."""
        self.comm, self.shard, self.shards, self.rounds, self.dead = comm, shard, list(shards), rounds, dead
        self.coordinator = shard == 0
        self.idle: deque[int] = deque(spares)
        self.ready: list[JoinEvent] = []  # joins to hand to the shard's loop
        self.words: list[np.ndarray] = []  # words from shard 0 not yet acted on (a join before its death here)
        self.deaths: set[int] = set()  # workers found dead here, awaiting shard 0's word (not shard 0)
        self.closed = False  # shard 0 said no word follows
        self._sends: list[tuple[MPI.Request, np.ndarray]] = []
        self._buf = np.zeros(3, np.int64)
        self._req = None if self.coordinator else comm.Recv_init(self._buf, source=self.shards[0], tag=wire.TAG_SPARE)
        if self._req is not None:
            self._req.Start()

    def died(self, worker: int, clock: int, rank: int, *, stopping: bool = False) -> None:
        """Worker ``worker`` (at ``rank``) was found dead here, after ``clock`` gradients received whole from it;
        ``stopping``: the run's stop flag is up (a signal, a target, a divergence), and no spare is assigned:
        the other workers are leaving, and a worker that died between its leaves to two shards would have a
        spare sent to a shard that saw it leave, which would wait for that spare's join for ever."""
        if not self.coordinator:
            if not self.closed:
                self.deaths.add(worker)
            return
        if self.dead is not None:
            self.idle = deque(r for r in self.idle if r not in self.dead.dead)
        if clock >= self.rounds:
            return
        if stopping:
            log.warning("shard 0: worker rank %d died while the run stops: no spare takes its place", rank)
            return
        if not self.idle:
            log.warning("shard 0: no spare worker left to take the place of worker rank %d", rank)
            return
        spare = self.idle.popleft()
        self._send(spare, ASSIGN, worker, clock)
        for s in self.shards[1:]:
            self._send(s, JOIN, worker, spare)
        self.ready.append(JoinEvent(worker, spare, clock))

    def poll(self, lost: Callable[[int], bool], clocks: Sequence[int],
             check: Callable[[], object] | None = None) -> list[JoinEvent]:
        """The joins this shard may take now: those whose worker its loop has found dead (``lost(worker)``);
        ``clocks``: each worker's gradients received whole here (a join's clock, on another shard);
        ``check()``: ask MPI which ranks died, while a word waits for a death not found here yet."""
        self._progress()
        while self._req is not None and self._req.Test():
            self.words.append(self._buf.copy())
            self._req.Start()
        kept = []
        for kind, worker, rank in (w.tolist() for w in self.words):
            if kind == CLOSING:
                self.closed = True
                self.deaths.clear()
            elif not lost(worker):
                kept.append(np.array([kind, worker, rank], np.int64))
            else:
                self.deaths.discard(worker)
                self.ready.append(JoinEvent(worker, rank, int(clocks[worker])))
        self.words = kept
        if kept and check is not None:
            check()
        ready, self.ready = self.ready, []
        return ready

    def pending(self) -> bool:
        """Whether this shard must go on after its workers have left: a join to take, or (not shard 0) a
        death shard 0 may still send a spare for."""
        return bool(self.ready or self.words or (self.deaths and not self.closed))

    def close(self, backoff: Backoff) -> None:
        """Shard 0, its loop over: tell the shards no word follows and the idle spares to end; every shard:
        wait for its sends and stop listening."""
        if self.coordinator:
            for s in self.shards[1:]:
                self._send(s, CLOSING, -1, -1)
            while self.idle:
                self._send(self.idle.popleft(), RELEASE, -1, -1)
        wait_until(lambda: self._progress() or not self._sends, backoff)
        if self._req is not None:
            self._req.Cancel()
            self._req.Wait()
            self._req.Free()
            self._req = None

    def _send(self, dest: int, kind: int, worker: int, value: int) -> None:
        buf = np.array([kind, worker, value], np.int64)
        try:
            self._sends.append((self.comm.Isend(buf, dest=dest, tag=wire.TAG_SPARE), buf))
        except MPI.Exception as exc:  # to a rank that died: nobody to tell
            found_dead(self.dead, exc)

    def _progress(self) -> None:
        self._sends = [(r, b) for r, b in self._sends if not completed(self.dead, r)]


def wait_for_place(comm: MPI.Comm, coordinator: int, backoff: Backoff | None = None) -> tuple[int, int] | None:
    """A spare's wait, from the start of the run: ``(worker, clock)`` when shard 0 gives it a dead worker's
    place, None when the run ends without needing it."""
    buf = np.zeros(3, np.int64)
    req = comm.Irecv(buf, source=coordinator, tag=wire.TAG_SPARE)
    wait_until(req.Test, backoff or Backoff(cap=0.01), watched=False)  # idle for as long as the run needs no spare
    kind, worker, clock = (int(v) for v in buf)
    return (worker, clock) if kind == ASSIGN else None
