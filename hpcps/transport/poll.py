"""Polite waiting: poll a completion test with a sleeping backoff.

Blocking MPI waits spin. On an oversubscribed node (a laptop, CI: 2 cores
and 5+ ranks) a spinning rank steals the CPU of the rank it waits for, and
the measurements lie. Every wait in hpcps therefore polls a ``Test``-style
call (which also drives MPI progress) and sleeps between tries, starting
short and doubling up to a cap, and starting short again after progress.

No wait blocks forever. A wait with a watch of its own (a :class:`StallWatch`
naming what it waits for) keeps it; while a run lasts, every other wait gets
the run's (:func:`watch_every_wait`: a warning, then the job's end, naming
the function that waits and where). And once a SIGTERM or SIGINT has come
(:func:`note_signal`, from the run's handlers), a watched wait that lasts
:data:`SIGNAL_GRACE` seconds beyond it ends the job (``HPCPS_SIGNAL_GRACE``, default 30):
the step the signal asked to finish will never end, and a batch system kills
30 s after its SIGTERM anyway.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable

from hpcps.cluster.launcher import launcher_rank

#: after SIGTERM or SIGINT, how long a wait goes on before the job ends, where ``HPCPS_SIGNAL_GRACE`` does not
#: say (a batch system kills 30 s after its SIGTERM, Slurm's default KillWait; a node that died, or a box taken
#: down, never comes)
DEFAULT_SIGNAL_GRACE = 30.0


def signal_grace(environ=os.environ) -> float:
    """The grace after a stop signal: ``HPCPS_SIGNAL_GRACE`` seconds (a site whose batch system kills later or
    sooner than 30 s after its SIGTERM), else :data:`DEFAULT_SIGNAL_GRACE`; a value that is no number of seconds
    above 0 is said on stderr (by the launcher's rank 0) and the default kept."""
    given = environ.get("HPCPS_SIGNAL_GRACE")
    if given is None:
        return DEFAULT_SIGNAL_GRACE
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:  # (NaN too)
        if launcher_rank(environ) == 0:  # (read at import, before any communicator: one line, not one a rank)
            print(f"hpcps: HPCPS_SIGNAL_GRACE={given!r} is no number of seconds above 0: the grace after a stop "
                  f"signal stays {DEFAULT_SIGNAL_GRACE:g} s", file=sys.stderr)
        return DEFAULT_SIGNAL_GRACE
    return seconds


SIGNAL_GRACE = signal_grace()

#: the stop signal that came (its name, and when on the monotonic clock), set by the run's handlers
_signalled: list[tuple[str, float]] = []
#: while a run lasts: the watch of a wait that brings none, made from the waiting function's name and place
_every: list[Callable[[str], "StallWatch"]] = []


def note_signal(name: str) -> None:
    """A SIGTERM or SIGINT came (``name``): from now on a watched wait ends the job :data:`SIGNAL_GRACE`
    seconds after it. (Called in a signal handler: it only appends.)"""
    if not _signalled:
        _signalled.append((name, time.monotonic()))


def clear_signal() -> None:
    """The run that caught the signal is over (a later run in this process starts without it)."""
    _signalled.clear()


def watch_every_wait(make: Callable[[str], "StallWatch"]) -> Callable[[], None]:
    """From now on, a :func:`wait_until` without a watch of its own (and not marked unwatched) gets
    ``make(text)``, ``text`` saying what it waits for (``for ...``, or ``in`` the waiting function, at its place
    in the source). Returns the undo."""
    _every.append(make)

    def undo() -> None:
        if make in _every:
            _every.remove(make)
    return undo


class Backoff:
    """Sleep schedule between polls: ``first`` seconds, doubling up to ``cap``."""

    __slots__ = ("first", "cap", "delay")

    def __init__(self, first: float = 20e-6, cap: float = 1e-3) -> None:
        if not 0 < first <= cap:
            raise ValueError("need 0 < first <= cap")
        self.first = first
        self.cap = cap
        self.delay = first

    def reset(self) -> None:
        """Something happened: poll eagerly again."""
        self.delay = self.first

    def pause(self) -> None:
        """Nothing happened: sleep, then wait longer next time."""
        time.sleep(self.delay)
        self.delay = min(self.delay * 2.0, self.cap)


def wait_until(test: Callable[[], bool], backoff: Backoff | None = None,
               watchdog: Callable[[float], object] | None = None, *, watched: bool = True,
               what: str | None = None) -> float:
    """Poll ``test()`` until it returns true; return the seconds spent waiting.

    ``watchdog(seconds_waited)``, if given, is called between polls: it may
    log a stall or raise to end the wait. Without one, while a run lasts, the
    run's watch (:func:`watch_every_wait`), saying it waits ``for what`` (by
    default: in the calling function, at its place in the source); none where
    ``watched`` is False (a wait whose end is another's to decide: a spare's,
    idle until a worker dies; a fast worker's at the run's end, for the slowest).
    """
    if test():
        return 0.0
    if watchdog is None and watched and _every:
        frame = sys._getframe(1)
        watchdog = _every[-1](f"for {what}" if what else
                              f"in {frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})")
    backoff = backoff or Backoff()
    backoff.reset()
    start = time.perf_counter()
    while True:
        backoff.pause()
        if test():
            return time.perf_counter() - start
        if watchdog is not None:
            watchdog(time.perf_counter() - start)


def polite_barrier(comm, backoff: Backoff | None = None,
                   watchdog: Callable[[float], object] | None = None, *, watched: bool = True,
                   what: str | None = None) -> float:
    """A barrier on ``comm`` that polls ``Ibarrier`` instead of spinning; returns seconds waited.
    ``watchdog`` as for :func:`wait_until` (a :class:`StallWatch`, so a barrier that never completes
    ends the job instead of holding it forever)."""
    return wait_until(comm.Ibarrier().Test, backoff, watchdog, watched=watched,
                      what=what or "every rank at a barrier")


class StallWatch:
    """Warn every ``warn`` seconds of one wait, raise ``error(message)`` past ``abort`` (None: never).

    ``describe()`` says what is being waited for; it is called only when
    there is something to report.
    """

    def __init__(self, *, warn: float, abort: float | None, describe: Callable[[], str], log, error) -> None:
        self.warn, self.abort, self.describe, self.log, self.error = warn, abort, describe, log, error
        self.warned = 0

    def __call__(self, waited: float) -> None:
        if self.abort is not None and waited >= self.abort:
            raise self.error(f"stall: {self.describe()} for {waited:.0f} s (--stall-abort {self.abort:g})")
        if _signalled:
            name, at = _signalled[0]
            since = time.monotonic() - at
            if since >= SIGNAL_GRACE and waited >= SIGNAL_GRACE:
                raise self.error(f"{name} received {since:.0f} s ago, and {self.describe()} for {waited:.0f} s: "
                                 f"the step under way will not end; ending the job (HPCPS_SIGNAL_GRACE "
                                 f"{SIGNAL_GRACE:g} s)")
        if waited >= self.warn * (self.warned + 1):
            self.warned += 1
            self.log.warning("stall: %s for %.0f s", self.describe(), waited)

    def reset(self) -> None:
        self.warned = 0
