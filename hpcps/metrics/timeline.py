"""Where each rank's time goes: contiguous phase spans, recorded as rows of ``/timeline``.

A rank's :class:`Timeline` is always in exactly one phase: :meth:`Timeline.enter`
closes the span of the phase it was in and opens the next, so the spans of a
rank tile its time from its first mark to its last, with no gap and no
overlap, and *every* second lands in a phase. What is not named lands in the
phase entered last before it; the code enters ``other`` wherever it leaves
what it instruments (the user's loop between steps, the shard's side
tasks), so that share is visible instead of hidden.

Consecutive entries of the same phase make one span; a shard that polls
and sleeps ten thousand times between two gradients records one ``wait``
span. Every span is kept, so a rank's seconds per phase are exact sums.

Recording costs one ``perf_counter`` read and a tuple per span; it is off
unless the run asks for it (``--timeline``), and then :class:`NullTimeline`
stands in, whose ``enter`` does nothing. (Pure: no MPI.)
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

#: phase codes of ``/timeline``; shard phases, then worker phases, then shared ones
PHASES = {
    0: "other",      # not instrumented: the loop's own code between steps, bookkeeping
    # a server shard
    1: "wait",       # polling and sleeping with no gradient complete: waiting for the workers
    2: "receive",    # the MPI calls that completed a gradient's receive (its last bytes' copy)
    3: "scan",       # the finiteness check of a gradient (a worker's verdict; a shard's, for one without)
    4: "sum",        # adding a gradient into its round's sum
    5: "step",       # the optimizer's step and the buffers' update: one new version
    6: "publish",    # writing the new version into the window
    7: "notify",     # receipts and grants to the workers
    8: "metrics",    # rank 0: writing other ranks' metric rows to the file
    9: "evaluate",   # rank 0: starting or recording an evaluation (or running one, in the foreground)
    10: "checkpoint",  # a periodic checkpoint's protocol and writing this shard's part (rank 0: the file)
    # a worker
    20: "data",      # the built-in loop: reading the step's batch
    21: "compute",   # forward and backward (the user's loop: from a step's start to ps.step)
    22: "emulated",  # the emulated compute time on top (--compute-time, --slowdown)
    23: "push",      # pushing the gradient, and waiting for it to leave
    24: "grant",     # blocked on the paradigm's grant
    25: "pull",      # the pull of the parameters the next step computes on (its wait, under eager)
}
CODES = {name: code for code, name in PHASES.items()}


class Timeline:
    """The phase spans of one rank (``rank``), as rows ``(rank, phase, step, t_begin, t_end)`` of
    ``table``; ``clock`` is the run's clock (seconds since its start, on rank 0's time base).

    ``step`` is what the rank is at: a shard's version, a worker's step, set with :meth:`at`.
    """

    enabled = True

    def __init__(self, rank: int, add: Callable[[str, tuple], object], clock: Callable[[], float],
                 table: str = "timeline") -> None:
        self.rank, self.add, self.clock, self.table = rank, add, clock, table
        self.phase: int | None = None
        self.since = 0.0
        self.step = 0
        self.step_of_span = 0

    def at(self, step: int) -> None:
        """The step (version) later spans belong to; the open span keeps the step it began at."""
        self.step = step

    def enter(self, phase: str, t: float | None = None) -> None:
        """Close the open span at ``t`` (now by default) and open ``phase``."""
        code = CODES[phase]
        if code == self.phase:
            return
        t = self.clock() if t is None else t
        if self.phase is not None and t > self.since:
            self.add(self.table, (self.rank, self.phase, self.step_of_span, self.since, t))
        self.phase, self.since, self.step_of_span = code, t, self.step

    def relabel(self, phase: str) -> None:
        """The open span turns out to be ``phase`` (from its beginning)."""
        if self.phase is not None:
            self.phase = CODES[phase]

    @contextmanager
    def within(self, phase: str) -> Iterator[None]:
        """``phase`` for the ``with`` block, then back to the phase that was open (a wait or a sleep
        inside another phase: a layer's wait for its parameters inside the pass)."""
        was = self.phase
        self.enter(phase)
        try:
            yield
        finally:
            if was is not None:
                self.enter(PHASES[was])

    def close(self) -> None:
        """Close the open span (at the end of the rank's run)."""
        if self.phase is not None:
            t = self.clock()
            if t > self.since:
                self.add(self.table, (self.rank, self.phase, self.step_of_span, self.since, t))
        self.phase = None


class NullTimeline:
    """A run without ``--timeline``: nothing recorded, nothing read."""

    enabled = False

    def at(self, step: int) -> None:
        pass

    def enter(self, phase: str, t: float | None = None) -> None:
        pass

    def relabel(self, phase: str) -> None:
        pass

    def within(self, phase: str):
        return nullcontext()

    def close(self) -> None:
        pass
