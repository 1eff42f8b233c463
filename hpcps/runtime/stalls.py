"""A shard's watch over its workers' silence: who owes it a message and has been silent too long.

A worker waiting for its grant is silent by design, and so is one whose push waits for the shard to take its
payload (a receive buffer, or its turn to stream), or whose payload is streaming in (over a slow link one
gradient may take longer than the limits); the suspects are the others. The longest silence goes to a
:class:`~hpcps.transport.poll.StallWatch`, which warns every ``--stall-warn`` seconds and ends the run past
``--stall-abort`` (checked twice a second), naming the silent workers, those waiting for their grant, and
what MPI holds from a silent one unmatched. Before its first push a worker's silence counts only past
:data:`FIRST_STEP_GRACE` times ``--stall-warn``: its first step may compile or warm up. Were the shard itself
stuck, its workers' own watches end the run (at twice the limit).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from hpcps.errors import RunAborted
from hpcps.transport.poll import StallWatch

log = logging.getLogger("hpcps")

#: a worker's first step (torch.compile, cuDNN autotuning, a cold file system) may take this many times
#: ``--stall-warn`` before its silence counts
FIRST_STEP_GRACE = 10


def silences(now: float, heard: Sequence[float], owing: Sequence[int], pushed: set[int],
             warn: float) -> list[tuple[float, int]]:
    """``(silence, worker)`` of the ``owing`` workers silent for ``warn`` seconds or more, shortest first.

    A worker's first step may compile (torch.compile) or warm up for minutes: before its first push
    (``pushed``) only what exceeds ``(FIRST_STEP_GRACE - 1) x warn`` counts as silence.
    """
    grace = (FIRST_STEP_GRACE - 1) * warn
    counted = ((now - heard[w] - (0.0 if w in pushed else grace), w) for w in owing)
    return sorted((t, w) for t, w in counted if t >= warn)


class ShardStalls:
    """Shard ``shard``'s watch over its workers (``worker_ranks``, by index; the shard's own list, which a
    spare's join renames): when each was last ``heard`` of (the run's clock) and which have ``pushed``;
    ``inbox``: the pushes the shard holds up or takes in (:class:`~hpcps.transport.push.PushInbox`);
    ``clocks()``: each worker's last gradient; ``awaiting()``: the workers waiting for their grant."""

    def __init__(self, shard: int, worker_ranks: list[int], inbox, clocks: Callable[[], list[int]],
                 awaiting: Callable[[], set[int]], *, warn: float, abort: float | None) -> None:
        self.shard, self.worker_ranks, self.inbox, self.clocks, self.awaiting = shard, worker_ranks, inbox, clocks, \
            awaiting
        self.warn = warn
        self.heard = [0.0] * len(worker_ranks)
        self.pushed: set[int] = set()  # workers heard from in this run: the others may still be compiling
        self.silent: list[tuple[float, int]] = []
        self.held_up: list[int] = []  # workers whose push waits for this shard's buffer or turn
        self.streaming: list[int] = []  # workers whose push is coming in (a slow link: not silent)
        self.next_check = 0.0
        self.watch = StallWatch(warn=warn, abort=abort, describe=self.describe, log=log, error=RunAborted)

    def joined(self, worker: int, now: float) -> None:
        """A spare took ``worker``'s place at ``now``: its first step may warm up as any worker's first did."""
        self.pushed.discard(worker)
        self.heard[worker] = now

    def check(self, now: float, excused: set[int]) -> None:
        """At ``now``, at most twice a second: the longest silence of a worker that owes the shard a message
        (not ``excused``: gone, or waiting for its grant) to the watch, which warns or ends the run."""
        if now < self.next_check:
            return
        self.next_check = now + 0.5
        self.held_up = self.inbox.waiting_for_shard()
        self.streaming = self.inbox.payloads_coming()
        excused = excused | set(self.held_up) | set(self.streaming)
        owing = [w for w in range(len(self.worker_ranks)) if w not in excused]
        self.silent = silences(now, self.heard, owing, self.pushed, self.warn)
        if self.silent:
            self.watch(self.silent[-1][0])
        else:
            self.watch.reset()

    def describe(self) -> str:
        """The stall's line: who is silent (for how long, their last gradient, what MPI holds from them
        unmatched), who waits for a grant, whose pushes wait for the shard or stream in."""
        ranks = self.worker_ranks
        names = ", ".join(f"{ranks[w]} (silent {t:.0f} s, last gradient {self.clocks()[w]}{self._held(w)})"
                          for t, w in reversed(self.silent))
        blocked = ", ".join(str(ranks[w]) for w in sorted(self.awaiting())) or "none"
        held_up = ", ".join(str(ranks[w]) for w in sorted(self.held_up))
        held_up = f"; pushes waiting for this shard to receive them: {held_up}" if held_up else ""
        streaming = ", ".join(str(ranks[w]) for w in self.streaming)
        streaming = f"; pushes streaming in: {streaming}" if streaming else ""
        return (f"shard {self.shard}: no message from worker rank(s) {names}; workers waiting for their grant: "
                f"{blocked}{held_up}{streaming}")

    def _held(self, worker: int) -> str:
        """``; MPI holds <what> from it unmatched`` where a probe finds a message of the silent ``worker`` that no
        receive took (bytes arrived, matching failed), else nothing (no bytes came)."""
        unmatched = self.inbox.unmatched(worker)
        return f"; MPI holds {unmatched} from it, unmatched" if unmatched else ""
