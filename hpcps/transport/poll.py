"""Polite waiting: poll a completion test with a sleeping backoff.

Blocking MPI waits spin. On an oversubscribed node (a laptop, CI: 2 cores
and 5+ ranks) a spinning rank steals the CPU of the rank it waits for, and
the measurements lie. Every wait in hpcps therefore polls a ``Test``-style
call (which also drives MPI progress) and sleeps between tries, starting
short and doubling up to a cap, and starting short again after progress.
"""

from __future__ import annotations

import time
from typing import Callable


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
               watchdog: Callable[[float], object] | None = None) -> float:
    """Poll ``test()`` until it returns true; return the seconds spent waiting.

    ``watchdog(seconds_waited)``, if given, is called between polls: it may
    log a stall or raise to end the wait.
    """
    if test():
        return 0.0
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
                   watchdog: Callable[[float], object] | None = None) -> float:
    """A barrier on ``comm`` that polls ``Ibarrier`` instead of spinning; returns seconds waited.
    ``watchdog`` as for :func:`wait_until` (a :class:`StallWatch`, so a barrier that never completes
    ends the job instead of holding it forever)."""
    return wait_until(comm.Ibarrier().Test, backoff, watchdog)


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
        if waited >= self.warn * (self.warned + 1):
            self.warned += 1
            self.log.warning("stall: %s for %.0f s", self.describe(), waited)

    def reset(self) -> None:
        self.warned = 0
