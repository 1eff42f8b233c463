"""A rank that dies ends the job, wherever in the script: the convention of ``python -m mpi4py``.

A script's error outside ``with ps:`` (a missing data file, a typo in the
loop's set-up, between :func:`hpcps.init` and the ``with``, or before
``init``) is not seen by any session: Python prints the traceback, the rank
then waits in ``MPI_Finalize`` at exit, and the other ranks wait for it for
ever (the servers serve, the workers wait for its share of a round).
``python -m mpi4py script.py`` answers this by calling ``MPI_Abort`` on an
unhandled exception; hpcps does the same for any script that imports it,
whatever the launcher:

- :func:`install` (at ``import hpcps``): an uncaught exception in a job of more
  than one rank ends the job with one line naming the rank and the error, the
  traceback in the log (:func:`hpcps.runtime.agree.end_job`); before MPI has
  started, the failing rank starts it first (the others would wait for it in
  ``MPI_Init``); nothing changes for a single process;
- :func:`guard` (at :func:`hpcps.init`): a worker whose script ends with its
  session open closes it where the run is over for it (``ps.running`` False:
  the loop ran out without ``ps.close()``), as every other worker's does; mid-run
  (a ``sys.exit`` in the loop) the job ends with one line that says so, where
  the servers would otherwise wait for its leave for ever.

``hpcps.init(exit_on_error=False)`` (tests, interactive use) sets up no exit check
for its session (the hook of :func:`install`, from the import, still ends the job on
an uncaught exception), and an exception of a run's own is the session's to handle
(``with ps:``).
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any

#: the guarded sessions still alive (weakly: a session the script dropped is not kept for the exit check)
_sessions: "weakref.WeakSet[Any]" = weakref.WeakSet()
_hooked = False
_at_exit_registered = False


def install() -> None:
    """From now on an uncaught exception in an MPI job of more than one rank ends the job (idempotent)."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    previous = sys.excepthook

    def excepthook(kind, exc, tb) -> None:
        comm = _job_comm()
        if comm is None:  # one process, or MPI not (or no longer) up: as Python would
            previous(kind, exc, tb)
            return
        from hpcps.runtime.agree import end_job

        end_job(comm, exc if exc is not None else kind())
        import os

        os._exit(1)  # MPI_Abort may return on a rank the launcher is tearing down: no exit handler runs after it

    sys.excepthook = excepthook


def launched_size() -> int:
    """The job's process count as an MPI launcher says it (1 where none does, and under torchrun, which
    starts no MPI job)."""
    from hpcps.cluster.launcher import launched_tasks

    launched = launched_tasks()
    return launched[1] if launched is not None and launched[0] != "torchrun" else 1


def _job_comm() -> Any:
    """The communicator to end: a guarded session's, else ``COMM_WORLD`` of a job of several ranks; None
    where there is nothing to end. A rank that fails before MPI started starts it first: under MPICH's
    launcher the other ranks would wait for it in ``MPI_Init`` for ever (it meets them there, then aborts)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        if launched_size() < 2:
            return None
        from mpi4py import MPI as mpi
    if not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    for session in list(_sessions):
        return session._guard_comm
    return mpi.COMM_WORLD if mpi.COMM_WORLD.Get_size() > 1 else None


def guard(session: Any, comm: Any) -> None:
    """Watch ``session`` (a :class:`~hpcps.runtime.session.Session` of this rank, over ``comm``) until the
    process exits: an uncaught exception, or an exit with the session open mid-run, ends the job on every rank."""
    global _at_exit_registered
    install()
    session._guard_comm = comm
    _sessions.add(session)
    if not _at_exit_registered:
        _at_exit_registered = True
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
    import time

    from hpcps.runtime.agree import FORWARD_S
    from hpcps.transport.failures import ulfm_enabled

    time.sleep(FORWARD_S)  # as end_job: an abort at once lost the line in 1 job of about 20 (CI)

    if ulfm_enabled():  # as end_job: under ULFM an abort ends no one, a killed rank is seen as dead
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    session._guard_comm.Abort(1)
