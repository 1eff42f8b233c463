"""Signals that end a run cleanly: SIGUSR1 and SIGTERM (a batch system's warning), SIGINT (Ctrl-C).

A batch system sends SIGUSR1 (Slurm's ``--signal``, LSF's ``-wa``) or
SIGTERM (PBS and Slurm at the time limit, ``scancel``) before it kills a
job; a user at a terminal presses Ctrl-C. Either way the run should not
die mid-write: hpcps stops training, applies what was pushed, writes
``/summary`` and a checkpoint, and every rank exits normally.

Here is only the per-process part, no MPI: :class:`StopSignals` installs
handlers that *record* the first signal (a handler must not do MPI), and
the training loops ask :meth:`StopSignals.take` at their next poll. Whoever
takes it raises the shards' stop flag in the parameter window, which every
worker reads at its next pull, so one signalled rank stops the whole job
(Slurm signals every task; ``mpiexec`` forwards Ctrl-C to every rank; a
``kill`` may reach only one). A second signal of the same kind ends the
process at once, for a user who will not wait. ``hpcps train`` installs
the handlers before anything slow (:func:`catch_early`), so a signal during
start-up is handled the same way; one that comes after the last step (during
the final evaluation) stops nothing, and the run is a finished one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from hpcps.transport.poll import note_signal

#: the signals that stop a run cleanly, and how ``/summary`` names each
STOP_SIGNALS = {signal.SIGUSR1: "SIGUSR1", signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}


class StopSignals:
    """Handlers for :data:`STOP_SIGNALS` while a run lasts (a context manager; main thread only).

    ``received`` is the name of the first signal that arrived (None until
    one does). :meth:`take` returns it once, to the loop that acts on it.
    Outside the main thread (where Python cannot install handlers)
    nothing is installed and nothing is ever received.
    """

    def __init__(self, on_first=None) -> None:
        self.received: str | None = None
        self.acted: str | None = None  # the signal a loop took and stopped the run for (None: none did)
        self._taken = False
        self._previous: dict[int, object] = {}
        self._on_first = on_first  # called in the handler: print-only, no MPI

    def __enter__(self) -> "StopSignals":
        global _early
        if threading.current_thread() is threading.main_thread():
            if _early is not None:  # handlers installed at start-up: take over what they caught
                self._previous, _early._previous = _early._previous, {}
                self.received, _early = _early.received, None
                if self.received is not None and self._on_first is not None:
                    self._on_first(self.received)
            for signum in STOP_SIGNALS:
                previous = signal.signal(signum, self._handle)
                self._previous.setdefault(signum, previous)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = STOP_SIGNALS[signum]
        if signum != signal.SIGUSR1:  # a watched wait now ends the job after the grace (hpcps.transport.poll)
            note_signal(name)
        if self.received is None:
            self.received = name
            if self._on_first is not None:
                self._on_first(name)
        elif self.received == name:  # asked twice: the user will not wait
            os._exit(128 + signum)

    def take(self) -> str | None:
        """The signal, the first time it is asked for after it arrived; None otherwise."""
        if self.received is None or self._taken:
            return None
        self._taken = True
        self.acted = self.received
        return self.received


#: the handlers :func:`catch_early` installed, until a run's :class:`StopSignals` takes them over
_early: StopSignals | None = None


def catch_early() -> None:
    """Install the stop handlers now, before the slow part of start-up (importing torch, loading data, a
    speed warm-up): a signal that comes meanwhile is recorded instead of killing the ranks (SIGUSR1,
    SIGTERM) or printing a traceback from every rank (SIGINT), and the run, once it starts, stops at
    its first step and writes its checkpoint. The run's :class:`StopSignals` takes them over."""
    global _early
    if _early is None and threading.current_thread() is threading.main_thread():
        _early = StopSignals().__enter__()


def early_signal() -> str | None:
    """The stop signal :func:`catch_early`'s handlers caught while the run was starting (None: none, or
    no handlers installed)."""
    return _early.received if _early is not None else None


def announce(rank: int):
    """The ``on_first`` of rank 0: one line saying what happens now (other ranks stay quiet)."""
    def on_first(name: str) -> None:
        if rank == 0:
            print(f"hpcps: {name} received: stopping after the current step, then writing the metrics and a "
                  f"checkpoint ({name} again ends at once)", file=sys.stderr, flush=True)
    return on_first
