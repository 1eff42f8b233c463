"""Periodic checkpoints of the paradigms that do not stop everyone between two updates: a consistent cut,
taken while the run goes on.

Why a cut is needed: with several shards, each applies a worker's gradient
when its own slice arrives, so at any instant shard 0 may have applied a
worker's 7th gradient and shard 1 only its 6th. A checkpoint must hold, on
every shard, the same gradients of every worker, and record each worker's
clock at that point, so that the resumed run pushes exactly the rest.

Where the cut may fall depends on the paradigm (:meth:`hpcps.policies.base.Policy.periodic_cut`):

* :class:`ClockCut` (asp, ssp, dssp, eager, grouped's central shards: every
  gradient applied on arrival): anywhere, as a clock per worker.
* :class:`RoundCut` (hsp: rounds, and extra gradients applied alone between
  them): only at the close of a round, which every shard then closes over the
  same gradients, extras included (each worker's extras of a round are in
  its clock order before its next round's gradient). bsp cuts between rounds
  too, but from its publish hook: every worker waits there anyway
  (:func:`hpcps.runtime.checkpoints.schedule.checkpointer`).

The protocol (one :class:`Snapshots` per central shard, driven by the
shard's loop as a side task; messages on the shards' own communicator,
rank 0 coordinating):

1. **Pause.** When shard 0's version crosses a multiple of
   ``--checkpoint-every`` (or ``--checkpoint-interval`` seconds have passed),
   it tells every shard. Each holds what it has not taken up yet (for a
   round cut, what comes after the round it is in) and answers with its
   position: its clocks in hand, or the round it is in.
2. **Cut.** Shard 0 takes the most advanced position of any shard (per
   worker for clocks) and sends that cut. Every shard takes up pushes up to
   it and holds the later ones: they wait, their headers at the shard and
   their payloads at the senders.
3. **Write.** A shard that has handled (applied or dropped) exactly the
   cut's gradients writes its part (optimizer and paradigm state) and says
   its version and its workers' clocks. Shard 0 checks that every shard's
   clocks agree, reads every shard's parameters at those versions and
   writes the checkpoint (parameters, versions, the clocks).
4. **Resume.** Shard 0 tells every shard to take up what it held.

Nobody stops: workers go on computing and pushing; only pushes past the cut
wait (a worker waits for them only where its paradigm waits for a grant
anyway, or its next push needs the buffer). Gradients pushed after the last
checkpoint are lost when the job dies; the resumed run starts each worker at
its clock in the cut, so it pushes them again. The pause each checkpoint
cost (from the pause to the resume, on shard 0) is logged.

A round cut can lie beyond the run's last round (the pause came as the last
round closed): a shard whose loop is over without reaching the cut says so,
and shard 0 abandons that checkpoint (its parts are removed). At the end of
the run a shard whose workers have all left keeps answering
(:meth:`Snapshots.finish`) until shard 0, whose own loop is over, says no
checkpoint will follow.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from hpcps.transport.poll import Backoff

log = logging.getLogger("hpcps")

TAG_TO_SHARD = 47  # shard 0 -> a shard: ("pause", epoch) | ("cut", epoch, cut, path) | ("resume", epoch) | ("final",)
# a shard -> shard 0: ("position", epoch, shard, position) | ("written", epoch, shard, version, clocks)
#                   | ("abandoned", epoch, shard)
TAG_TO_COORDINATOR = 48


class ClockCut:
    """A cut anywhere, as a clock per worker: for paradigms that apply every gradient on arrival."""

    def hold_in_hand(self, server) -> list[int]:
        """Hold what ``server`` has not taken up; return its position, the clocks it has in hand."""
        clocks = server.inbox.clocks_in_hand(server.clocks)
        server.inbox.hold_after(clocks)
        return clocks

    def agree(self, positions: list[list[int]]) -> list[int]:
        """The cut: each worker's most advanced clock on any shard (a push one shard took up went to all)."""
        return np.max(np.array(positions), axis=0).tolist()

    def hold(self, server, cut: list[int]) -> None:
        server.inbox.hold_after(cut)

    def reached(self, server, cut: list[int]) -> bool:
        """Whether ``server`` has handled every push up to the cut, and no more."""
        return list(server.clocks) == list(cut) and not server.pending

    def release(self, server) -> None:
        server.inbox.hold_after(None)


class RoundCut:
    """A cut at the close of a round (hsp): positions and the cut are rounds of this run, counted from 0.

    A shard in round r (r rounds closed) holds each worker's messages after its (r+1)-th round gradient:
    it may close round r, and apply the extras before it, but nothing after. Every worker pushes one
    gradient to each round it is active in (:class:`hpcps.runtime.rounds.RoundSum`'s assumption), so
    a worker's (r+1)-th is its gradient of round r on every shard.
    """

    def hold_in_hand(self, server) -> int:
        position = server.round_sum.closed
        server.inbox.hold_after_regulars(position + 1)
        return position

    def agree(self, positions: list[int]) -> int:
        """The cut: the close of the latest round any shard is in (none is further than its close)."""
        return max(positions)

    def hold(self, server, cut: int) -> None:
        server.inbox.hold_after_regulars(cut + 1)

    def reached(self, server, cut: int) -> bool:
        return server.round_sum.closed == cut + 1 and not server.pending

    def release(self, server) -> None:
        server.inbox.hold_after_regulars(None)


class Snapshots:
    """One shard's side of the periodic checkpoints (module docstring).

    ``comm``: the shards' communicator (shard s is its rank s); ``server``: this shard's
    :class:`~hpcps.runtime.server.ShardServer` (its inbox, handled clocks, pending gradients, version);
    ``cut``: where the cut may fall (:class:`ClockCut`, :class:`RoundCut`);
    ``write_part(path)``: write this shard's part of checkpoint ``path``; ``write_main(path, clocks,
    versions)`` (shard 0): read every shard's parameters at ``versions``, write the checkpoint (named
    after shard 0's version, the parts moved beside it) and return its path; ``discard(path)`` (shard 0):
    remove the parts of an abandoned checkpoint; ``path_for(epoch)``: where the parts of the
    ``epoch``-th checkpoint are written meanwhile (its versions are known only once written).
    """

    def __init__(self, comm: MPI.Comm, *, every: int | None, interval: float | None,
                 write_part: Callable[[str], object], write_main: Callable[[str, list[int], list[int]], object],
                 path_for: Callable[[int], str], cut: ClockCut | RoundCut | None = None,
                 discard: Callable[[str], object] = lambda path: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.comm, self.shard, self.n_shards = comm, comm.rank, comm.size
        self.every, self.interval = every, interval
        self.write_part, self.write_main, self.path_for, self.clock = write_part, write_main, path_for, clock
        self.how = cut or ClockCut()
        self.discard = discard
        self.server = None  # set once the shard's server exists
        self.epoch = 0
        self.state = "idle"  # idle | pausing | draining | written | abandoned
        self.cut = None
        self.path = ""
        self.positions: dict[int, object] = {}  # shard 0: each shard's position at the pause
        self.answers: dict[int, tuple[int, list[int]] | None] = {}  # shard 0: (version, clocks) or None: abandoned
        self.last_version = 0  # shard 0's version at the last checkpoint (a resumed run's: its start)
        self.last_time = clock()
        self.paused_at, self.paused_version = 0.0, 0
        self.pauses: list[float] = []  # shard 0: seconds from each pause to its resume
        self.loop_over = False  # this shard's loop has ended: a cut not reached by now never will be
        self.final = False  # a shard: shard 0 said no checkpoint will follow

    # -- driven by the shard's loop ---------------------------------------------------------------

    def tick(self) -> bool:
        """One step of the protocol; true if it did something (the loop's timeline counts it)."""
        busy = self._receive()
        if self.shard == 0 and self.state == "idle" and self._due():
            self._pause()
            busy = True
        if self.state == "draining" and self.how.reached(self.server, self.cut):
            self._written()
            busy = True
        elif self.state == "draining" and self.loop_over:
            self._abandoned()
            busy = True
        return busy

    def finish(self, backoff: Backoff | None = None) -> None:
        """After this shard's loop: complete a checkpoint under way (or abandon one whose cut the run never
        reached); shard 0 then tells every shard that none follows, and every other shard answers until it
        hears so."""
        backoff = backoff or Backoff()
        self.loop_over = True
        if self.shard == 0:
            while self.state != "idle":
                if not self.tick():
                    backoff.pause()
            for s in range(1, self.n_shards):
                self.comm.send(("final",), dest=s, tag=TAG_TO_SHARD)
            return
        while not self.final:
            if not self.tick():
                backoff.pause()

    # -- the steps --------------------------------------------------------------------------------

    def _due(self) -> bool:
        server = self.server
        if server is None or not server.inbox.open:
            return False
        if self.every and server.version // self.every > self.last_version // self.every:
            return True  # crossed a multiple of --checkpoint-every (a loop step may apply several updates)
        return bool(self.interval) and self.clock() - self.last_time >= self.interval and \
            server.version > self.last_version

    def _pause(self) -> None:
        """Shard 0: start a checkpoint; hold this shard's later pushes; ask every shard for its position."""
        self.epoch += 1
        self.paused_at, self.paused_version = self.clock(), self.server.version
        self.positions = {0: self.how.hold_in_hand(self.server)}
        self.answers = {}
        self.state = "pausing"
        for s in range(1, self.n_shards):
            self.comm.send(("pause", self.epoch), dest=s, tag=TAG_TO_SHARD)
        self._maybe_cut()

    def _maybe_cut(self) -> None:
        if len(self.positions) < self.n_shards:
            return
        cut = self.how.agree([self.positions[s] for s in range(self.n_shards)])
        self.path = self.path_for(self.epoch)
        for s in range(1, self.n_shards):
            self.comm.send(("cut", self.epoch, cut, self.path), dest=s, tag=TAG_TO_SHARD)
        self._start_draining(cut)

    def _start_draining(self, cut) -> None:
        self.cut = cut
        self.how.hold(self.server, cut)
        self.state = "draining"

    def _written(self) -> None:
        self.write_part(self.path)
        self.state = "written"
        answer = (self.server.version, [int(c) for c in self.server.clocks])
        if self.shard == 0:
            self.answers[0] = answer
            self._maybe_conclude()
        else:
            self.comm.send(("written", self.epoch, self.shard, *answer), dest=0, tag=TAG_TO_COORDINATOR)

    def _abandoned(self) -> None:
        self.state = "abandoned"
        if self.shard == 0:
            self.answers[0] = None
            self._maybe_conclude()
        else:
            self.comm.send(("abandoned", self.epoch, self.shard), dest=0, tag=TAG_TO_COORDINATOR)

    def _maybe_conclude(self) -> None:
        """Shard 0, once every shard has answered: write the checkpoint, or abandon it; then resume."""
        if len(self.answers) < self.n_shards or self.state not in ("written", "abandoned"):
            return
        answers = [self.answers[s] for s in range(self.n_shards)]
        if any(a is None for a in answers):
            self.discard(self.path)
            log.info("the checkpoint begun at version %d is not written: the run ended before its cut (the close "
                     "of round %s of this run)", self.paused_version, self.cut)
        else:
            versions, clocks = [a[0] for a in answers], answers[0][1]
            if any(a[1] != clocks for a in answers):
                raise RuntimeError(f"checkpoint cut {self.cut}: the shards handled different gradients "
                                   f"(their clocks {[a[1] for a in answers]})")
            written = self.write_main(self.path, clocks, versions)
            log.info("checkpoint of version %d written to %s (pushes past the cut held for %.1f ms)",
                     versions[0], written, (self.clock() - self.paused_at) * 1e3)
        for s in range(1, self.n_shards):
            self.comm.send(("resume", self.epoch), dest=s, tag=TAG_TO_SHARD)
        self._resume()
        self.pauses.append(self.clock() - self.paused_at)

    def _resume(self) -> None:
        self.how.release(self.server)
        self.cut, self.state = None, "idle"
        self.last_version, self.last_time = self.server.version, self.clock()

    # -- messages ---------------------------------------------------------------------------------

    def _receive(self) -> bool:
        tag = TAG_TO_COORDINATOR if self.shard == 0 else TAG_TO_SHARD
        got = False
        status = MPI.Status()
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
            # from the rank probed, never a wildcard receive (MPICH over UCX's TCP: hpcps.transport.push)
            message = self.comm.recv(source=status.Get_source(), tag=tag)
            got = True
            kind = message[0]
            if kind == "pause":
                self.epoch = message[1]
                position = self.how.hold_in_hand(self.server)
                self.comm.send(("position", self.epoch, self.shard, position), dest=0, tag=TAG_TO_COORDINATOR)
                self.state = "pausing"
            elif kind == "cut":
                self.path = message[3]
                self._start_draining(message[2])
            elif kind == "resume":
                self._resume()
            elif kind == "final":
                self.final = True
            elif kind == "position":
                self.positions[message[2]] = message[3]
                self._maybe_cut()
            elif kind == "written":
                self.answers[message[2]] = (message[3], list(message[4]))
                self._maybe_conclude()
            elif kind == "abandoned":
                self.answers[message[2]] = None
                self._maybe_conclude()
        return got
