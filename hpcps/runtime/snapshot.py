"""Periodic checkpoints of the paradigms that apply every gradient on arrival: a consistent cut, taken while
the run goes on.

Why a cut is needed: with several shards, each applies a worker's gradient
when its own slice arrives, so at any instant shard 0 may have applied a
worker's 7th gradient and shard 1 only its 6th. A checkpoint must hold, on
every shard, the same gradients of every worker, and record each worker's
clock at that point, so that the resumed run pushes exactly the rest.

The protocol (one :class:`Snapshots` per central shard, driven by the
shard's loop as a side task; messages on the shards' own communicator,
rank 0 coordinating):

1. **Pause.** When shard 0's version crosses a multiple of
   ``--checkpoint-every`` (or ``--checkpoint-interval`` seconds have passed),
   it tells every shard. Each holds what it has not taken up yet
   (:meth:`hpcps.transport.push.PushInbox.hold_after` its clocks in hand) and
   answers with those clocks.
2. **Cut.** Shard 0 takes, per worker, the most advanced clock of any shard
   (a push one shard took up has been sent to all of them) and sends that
   cut. Every shard takes up pushes up to it, and holds the later ones:
   they wait, their headers at the shard and their payloads at the senders.
3. **Write.** A shard whose handled clocks reach the cut has applied
   exactly the cut's gradients: it writes its part (optimizer and paradigm
   state) and says its version. Shard 0 then reads every shard's parameters
   at those versions and writes the checkpoint (parameters, versions, the
   cut as the workers' clocks).
4. **Resume.** Shard 0 tells every shard to take up what it held.

Nobody stops: workers go on computing and pushing; only pushes past the cut
wait (a worker waits for them only where its paradigm waits for a grant
anyway, or its next push needs the buffer). Gradients pushed after the last
checkpoint are lost when the job dies; the resumed run starts each worker at
its clock in the cut, so it pushes them again. The pause each checkpoint
cost (from the pause to the resume, on shard 0) is logged.

At the end of the run a shard whose workers have all left keeps answering
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

TAG_TO_SHARD = 47  # shard 0 -> a shard: ("pause", epoch) | ("cut", epoch, clocks, path) | ("resume", epoch) | ("final",)
TAG_TO_COORDINATOR = 48  # a shard -> shard 0: ("clocks", epoch, shard, clocks) | ("written", epoch, shard, version)


class Snapshots:
    """One shard's side of the periodic checkpoints (module docstring).

    ``comm``: the shards' communicator (shard s is its rank s); ``server``: this shard's
    :class:`~hpcps.runtime.server.ShardServer` (its inbox, handled clocks, pending gradients, version);
    ``write_part(path)``: write this shard's part of checkpoint ``path``; ``write_main(path, clocks,
    versions)`` (shard 0): read every shard's parameters at ``versions``, write the checkpoint (named
    after shard 0's version, the parts moved beside it) and return its path; ``path_for(epoch)``: where the
    parts of the ``epoch``-th checkpoint are written meanwhile (its versions are known only once written).
    """

    def __init__(self, comm: MPI.Comm, *, every: int | None, interval: float | None,
                 write_part: Callable[[str], object], write_main: Callable[[str, list[int], list[int]], object],
                 path_for: Callable[[int], str], clock: Callable[[], float] = time.perf_counter) -> None:
        self.comm, self.shard, self.n_shards = comm, comm.rank, comm.size
        self.every, self.interval = every, interval
        self.write_part, self.write_main, self.path_for, self.clock = write_part, write_main, path_for, clock
        self.server = None  # set once the shard's server exists
        self.epoch = 0
        self.state = "idle"  # idle | pausing (shard 0) | draining | written
        self.cut: list[int] | None = None
        self.path = ""
        self.clocks: dict[int, list[int]] = {}  # shard 0: each shard's clocks in hand at the pause
        self.versions: dict[int, int] = {}  # shard 0: each shard's version at the cut
        self.last_version = 0  # shard 0's version at the last checkpoint (a resumed run's: its start)
        self.last_time = clock()
        self.paused_at = 0.0
        self.pauses: list[float] = []  # shard 0: seconds from each pause to its resume
        self.final = False  # a shard: shard 0 said no checkpoint will follow

    # -- driven by the shard's loop ---------------------------------------------------------------

    def tick(self) -> bool:
        """One step of the protocol; true if it did something (the loop's timeline counts it)."""
        busy = self._receive()
        if self.shard == 0 and self.state == "idle" and self._due():
            self._pause()
            busy = True
        if self.state == "draining" and self._at_cut():
            self._written()
            busy = True
        return busy

    def finish(self, backoff: Backoff | None = None) -> None:
        """After this shard's loop: complete a checkpoint under way; shard 0 then tells every shard that
        none follows, and every other shard answers until it hears so."""
        backoff = backoff or Backoff()
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
        """Shard 0: start a checkpoint; hold this shard's later pushes; ask every shard for its clocks."""
        self.epoch += 1
        self.paused_at = self.clock()
        self.clocks = {0: self._hold()}
        self.versions = {}
        self.state = "pausing"
        for s in range(1, self.n_shards):
            self.comm.send(("pause", self.epoch), dest=s, tag=TAG_TO_SHARD)
        self._maybe_cut()

    def _hold(self) -> list[int]:
        """Hold whatever this shard has not taken up; return its clocks in hand."""
        server = self.server
        clocks = server.inbox.clocks_in_hand(server.clocks)
        server.inbox.hold_after(clocks)
        return clocks

    def _maybe_cut(self) -> None:
        if len(self.clocks) < self.n_shards:
            return
        cut = np.max(np.array([self.clocks[s] for s in range(self.n_shards)]), axis=0).tolist()
        self.path = self.path_for(self.epoch)
        for s in range(1, self.n_shards):
            self.comm.send(("cut", self.epoch, cut, self.path), dest=s, tag=TAG_TO_SHARD)
        self._start_draining(cut)

    def _start_draining(self, cut: list[int]) -> None:
        self.cut = cut
        self.server.inbox.hold_after(cut)
        self.state = "draining"

    def _at_cut(self) -> bool:
        """Whether this shard has handled (applied or dropped) every push up to the cut, and no more."""
        server = self.server
        return list(server.clocks) == self.cut and not server.pending

    def _written(self) -> None:
        self.write_part(self.path)
        self.state = "written"
        if self.shard == 0:
            self.versions[0] = self.server.version
            self._maybe_write_main()
        else:
            self.comm.send(("written", self.epoch, self.shard, self.server.version), dest=0, tag=TAG_TO_COORDINATOR)

    def _maybe_write_main(self) -> None:
        if len(self.versions) < self.n_shards or self.state != "written":
            return
        versions = [self.versions[s] for s in range(self.n_shards)]
        written = self.write_main(self.path, self.cut, versions)
        for s in range(1, self.n_shards):
            self.comm.send(("resume", self.epoch), dest=s, tag=TAG_TO_SHARD)
        self._resume()
        pause = self.clock() - self.paused_at
        self.pauses.append(pause)
        log.info("checkpoint of version %d written to %s (pushes past the cut held for %.1f ms)",
                 versions[0], written, pause * 1e3)

    def _resume(self) -> None:
        self.server.inbox.hold_after(None)
        self.cut, self.state = None, "idle"
        self.last_version, self.last_time = self.server.version, self.clock()

    # -- messages ---------------------------------------------------------------------------------

    def _receive(self) -> bool:
        tag = TAG_TO_COORDINATOR if self.shard == 0 else TAG_TO_SHARD
        got = False
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=tag):
            message = self.comm.recv(source=MPI.ANY_SOURCE, tag=tag)
            got = True
            kind = message[0]
            if kind == "pause":
                self.epoch = message[1]
                self.comm.send(("clocks", self.epoch, self.shard, self._hold()), dest=0, tag=TAG_TO_COORDINATOR)
                self.state = "pausing"
            elif kind == "cut":
                self.path = message[3]
                self._start_draining(list(message[2]))
            elif kind == "resume":
                self._resume()
            elif kind == "final":
                self.final = True
            elif kind == "clocks":
                self.clocks[message[2]] = list(message[3])
                self._maybe_cut()
            elif kind == "written":
                self.versions[message[2]] = message[3]
                self._maybe_write_main()
        return got
