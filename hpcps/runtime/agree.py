"""Fail together: run a fallible start-up step on every rank and agree on the outcome.

A bad option, an unreadable file or too few ranks must end *every* rank
with the same clear message, never leave some ranks waiting in a collective
for one that has already quit.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Callable, TypeVar

from mpi4py import MPI

from hpcps.errors import RunAborted, UserError, hint, print_error
from hpcps.transport.poll import SIGNAL_GRACE as POLL_SIGNAL_GRACE

T = TypeVar("T")
log = logging.getLogger("hpcps")


#: a start-up wait for the other ranks: a warning every this many seconds
START_WARN = 60.0
#: and its end, as --stall-abort's default (the options may not be read yet)
START_ABORT = 600.0
#: after SIGTERM or SIGINT, how long a start-up wait goes on before this rank gives up (a run's waits: the
#: same grace, hpcps.transport.poll)
SIGNAL_GRACE = POLL_SIGNAL_GRACE


def meet(comm: MPI.Comm, what: str, *, warn: float = START_WARN, abort: float | None = START_ABORT) -> None:
    """Collective: return once every rank of ``comm`` has come here, polling a nonblocking barrier (the
    cores stay free) under a watch: a warning every ``warn`` seconds naming ``what``, and
    :class:`RunAborted`, which ends the job, past ``abort`` seconds, or :data:`SIGNAL_GRACE` seconds after
    a SIGTERM or SIGINT caught at start-up, instead of waiting for ever on a rank that will not come."""
    from hpcps.runtime.signals import early_signal
    from hpcps.transport.poll import Backoff, StallWatch, wait_until

    request = comm.Ibarrier()
    watch = StallWatch(warn=warn, abort=abort, log=log, error=RunAborted,
                       describe=lambda: f"rank {comm.rank} waiting at start-up for every rank to {what}")
    signalled: list[float] = []

    def watchdog(waited: float) -> None:
        watch(waited)
        if not signalled and early_signal() in ("SIGTERM", "SIGINT"):
            signalled.append(waited)
        if signalled and waited - signalled[0] >= SIGNAL_GRACE:
            raise RunAborted(f"{early_signal()} received while rank {comm.rank} waited at start-up for every "
                             f"rank to {what} ({waited:.0f} s): ending the job")

    wait_until(request.Test, Backoff(), watchdog)


def agree(comm: MPI.Comm, step: Callable[[], T]) -> T:
    """Collective: ``step()`` on every rank; if it failed anywhere, raise UserError everywhere. Ranks that
    wait for the others' ``step`` wait as :func:`meet` does (a stall watch, a signal ends the wait)."""
    try:
        value, error = step(), None
    except UserError as exc:
        value, error = None, str(exc)
    except Exception as exc:  # an internal failure: keep the traceback on the rank that saw it
        log.exception("start-up failed on rank %d", comm.rank)
        value, error = None, f"internal error: {type(exc).__name__}: {exc}"
    meet(comm, "finish the same start-up step")
    errors = comm.allgather(error)
    if not any(errors):
        return value
    raise UserError(combine(errors))


def combine(errors: list[str | None]) -> str:
    """One message from the ranks' errors (None: no error): each distinct message once, with its ranks.

    ``rank 1: A``, ``ranks 1-4: A``, ``ranks 1, 3: A; rank 2: B``; just ``A``
    when every rank said A. At most four distinct messages are shown.
    """
    by_message: dict[str, list[int]] = {}
    for rank, msg in enumerate(errors):
        if msg:
            by_message.setdefault(msg, []).append(rank)
    if len(by_message) == 1 and all(errors):
        return next(iter(by_message))
    return "; ".join(f"{_ranks(ranks)}: {msg}" for msg, ranks in list(by_message.items())[:4])


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def run_or_end(comm: MPI.Comm, step: Callable[[], T], *, quiet: tuple[type[BaseException], ...] = ()) -> tuple[T | None, int]:
    """Collective: ``(step(), 0)``, or end as an HPC user expects, never a hang or N tracebacks.

    Bad input (:class:`UserError`, raised on every rank alike by the
    start-up steps, see :func:`agree`): rank 0 prints one ``hpcps: error:``
    line, and every rank gets ``(None, exit status 2)``. Any other failure
    is one rank's: it prints one line naming itself (with the traceback in
    the log, unless the error is a :class:`RunAborted` or one of ``quiet``,
    whose message says it all) and calls ``MPI_Abort``, which ends every rank.
    """
    try:
        return step(), 0
    except UserError as exc:
        if comm.rank == 0:
            print_error(str(exc))
        return None, exc.exit_code
    except Exception as exc:
        end_job(comm, exc, quiet=quiet)
        return None, 1  # MPI_Abort may return on a rank the launcher is already tearing down


#: what a failing rank does before ``MPI_Abort`` (a run registers its recorder's flush: the rows it has
#: not yet sent to rank 0 would be lost with it); best effort, each at most once
last_words: list[Callable[[], object]] = []


#: seconds a rank that ends the job waits after its one line, before ``MPI_Abort``: the launcher forwards a
#: rank's output through its proxies, and an abort that tears them down first loses the line
FORWARD_S = 0.5


def end_job(comm: MPI.Comm, exc: BaseException, *, quiet: tuple[type[BaseException], ...] = ()) -> None:
    """One line naming this rank and ``exc`` (the traceback in the log, unless the error's message says
    it all), its :data:`last_words`, then ``MPI_Abort``: every rank ends, none is left waiting for this one."""
    print_error(f"rank {comm.rank} failed: {type(exc).__name__}: {exc}{hint(exc)}; ending the job on every rank")
    if not isinstance(exc, (RunAborted, *quiet)):
        log.error("rank %d failed", comm.rank, exc_info=exc)
    while last_words:
        try:
            last_words.pop()()
        except Exception:  # a dying rank's rows are a courtesy: the abort must happen
            log.debug("last words failed on rank %d", comm.rank, exc_info=True)
    time.sleep(FORWARD_S)  # let the launcher forward that line (and rank 0 write the rows) before MPI_Abort
    from hpcps.transport.failures import ulfm_enabled
    if ulfm_enabled():
        # under Open MPI's ULFM (5.0.11 measured), MPI_Abort blocks its caller and ends no one, and so does
        # a nonzero exit, which is not even reported as a failure: this rank is killed instead, which the
        # others see as a dead rank (a worker's death is run through where the paradigm allows; any other
        # rank's ends theirs in turn, when they next talk to it)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    comm.Abort(1)
