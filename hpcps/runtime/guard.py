"""Outside ``with ps:``, a rank that dies ends the job too: the convention of ``python -m mpi4py``.

A script's error between :func:`hpcps.init` and its ``with ps:`` (a missing
data file, a typo in the loop's set-up), or after the block, is not seen by
the session: Python prints the traceback and the rank exits, while the
other ranks wait for it for ever (the servers serve, the workers wait for
its share of a round). ``python -m mpi4py script.py`` answers this by
calling ``MPI_Abort`` on an unhandled exception; :func:`guard` does the same
for a run that :func:`hpcps.init` started, whatever the launcher:

- an uncaught exception (``sys.excepthook``) ends the job with one line naming
  the rank and the error, the traceback in the log (:func:`hpcps.runtime.agree.end_job`);
- a worker whose script ends with its session open: where the run is over
  for it (``ps.running`` False: the loop ran out without ``ps.close()``) the
  session closes at exit, as every other worker's does; mid-run (a
  ``sys.exit`` in the loop) the job ends with one line that says so, where the
  servers would otherwise wait for its leave for ever.

An error before ``hpcps.init`` is the script's own: launch it with
``python -m mpi4py`` for the same guarantee there.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any

#: the guarded sessions still alive (weakly: a session the script dropped is not kept for the exit check)
_sessions: "weakref.WeakSet[Any]" = weakref.WeakSet()
_installed = False


def guard(session: Any, comm: Any) -> None:
    """Watch ``session`` (a :class:`~hpcps.runtime.session.Session` of this rank, over ``comm``) until the
    process exits: an uncaught exception or an exit with the session open ends the job on every rank."""
    global _installed
    session._guard_comm = comm
    _sessions.add(session)
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def excepthook(kind, exc, tb) -> None:
        from mpi4py import MPI

        sessions = list(_sessions)
        if not sessions or MPI.Is_finalized():  # nothing of hpcps's is left to end: as Python would
            previous(kind, exc, tb)
            return
        from hpcps.runtime.agree import end_job

        end_job(sessions[0]._guard_comm, exc if exc is not None else kind())

    sys.excepthook = excepthook
    atexit.register(_at_exit)  # (registered after mpi4py's finalize: it runs before)


def left_open() -> list[Any]:
    """The guarded worker sessions that are still open (the ranks that the others would wait for)."""
    return [s for s in list(_sessions) if s.is_worker and not s.closed]


def _at_exit() -> None:
    """A worker leaves the script with its session open: close it where its run is over, else end the job
    rather than leave the servers waiting for a leave that will not come."""
    sessions = left_open()
    if not sessions:
        return
    from mpi4py import MPI

    if MPI.Is_finalized():
        return
    session = sessions[0]
    if not session.running:
        try:
            session.close()  # collective: every worker whose loop ran out comes here alike
            return
        except Exception as exc:
            from hpcps.runtime.agree import end_job

            end_job(session._guard_comm, exc)
            return
    from hpcps.errors import print_error

    print_error(f"rank {session.rank}: the script ended with its hpcps session open (worker {session.worker_index}, "
                f"step {session.iteration}): close it with ps.close() or `with ps:`; ending the job on every rank")
    sys.stdout.flush()
    sys.stderr.flush()
    from hpcps.transport.failures import ulfm_enabled

    if ulfm_enabled():  # as end_job: under ULFM an abort ends no one, a killed rank is seen as dead
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    session._guard_comm.Abort(1)
