"""Dead ranks, as Open MPI's ULFM reports them: the mechanism under run-through.

Under ``mpirun --with-ft ulfm`` (Open MPI 5) a rank that dies does not end
the job. An operation that involves it fails with ``MPI_ERR_PROC_FAILED``,
and a receive or probe from ``MPI_ANY_SOURCE`` on a communicator that holds
it fails with ``MPI_ERR_PROC_FAILED_PENDING`` until the failure is
acknowledged (``MPIX_Comm_ack_failed``). :class:`DeadRanks` turns such an
exception into the ranks that died, acknowledging them on every
communicator it watches (duplicates of one communicator: the same ranks),
so the wildcard receives go on matching the living.

What ULFM leaves out, and hpcps therefore avoids after a failure: RMA
windows are not fault tolerant (their free, a collective, is skipped; pulls
between the living go on working on one node and over TCP, as measured, but
MPI does not promise it), and neither are collectives over a communicator
that holds a dead rank (the run's end shrinks it first). Direct launch with
``srun`` is not supported by ULFM; mpi4py's fallbacks under MPICH are
``Dup`` and ``Allreduce``, so run-through is Open MPI's only.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Iterable, Sequence, TypeVar

from mpi4py import MPI

T = TypeVar("T")

#: the error classes that mean "a rank died" (a revoked communicator: someone else saw one die)
FAILED_CLASSES = frozenset(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                           "ERR_REVOKED") if hasattr(MPI, name))


def ulfm_enabled(library: str | None = None, environ: dict | None = None) -> bool:
    """Whether this MPI reports dead ranks instead of ending the job: Open MPI launched with
    ``--with-ft ulfm`` (which exports ``OMPI_MCA_mpi_ft_enable=1`` to every rank)."""
    library = MPI.Get_library_version() if library is None else library
    environ = os.environ if environ is None else environ
    flag = environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower()
    return "Open MPI" in library and flag in ("1", "true", "yes", "on", "enabled")


def is_failure(exc: BaseException, statuses: Sequence[MPI.Status] = ()) -> bool:
    """Whether ``exc`` is MPI saying a rank died. A call on several requests (``Testall``, ``Testsome``)
    raises ``MPI_ERR_IN_STATUS`` instead, the death in the failed request's status: pass ``statuses`` (those
    the call filled) to see it there."""
    if not isinstance(exc, MPI.Exception):
        return False
    if exc.Get_error_class() == MPI.ERR_IN_STATUS:
        return any(MPI.Get_error_class(s.Get_error()) in FAILED_CLASSES for s in statuses)
    return exc.Get_error_class() in FAILED_CLASSES


#: the error classes Open MPI's nonblocking collectives may raise for a death instead (5.0.x: libnbc aborts
#: the schedule on a dead or revoked peer, "Error in NBC_Start_round()", and the request reports only that)
UNCLASSED = frozenset(getattr(MPI, name) for name in ("ERR_OTHER", "ERR_INTERN") if hasattr(MPI, name))


def failed_on(exc: BaseException, comm: MPI.Comm) -> bool:
    """Whether ``exc``, raised by a collective on ``comm``, is MPI saying a rank died: its class says so
    (:func:`is_failure`), or it is of no class (:data:`UNCLASSED`) while ``comm`` is revoked or holds a rank
    this process knows is dead. Open MPI 5.0.x's ``Iallreduce`` under ULFM raised ``MPI_ERR_OTHER`` for a
    peer's death about once in 35 runs on a busy machine; taken as another error, it ended a living worker."""
    if is_failure(exc):
        return True
    if not isinstance(exc, MPI.Exception) or exc.Get_error_class() not in UNCLASSED:
        return False
    try:
        if comm.Is_revoked():
            return True
        failed = comm.Get_failed()
        try:
            return failed.Get_size() > 0
        finally:
            failed.Free()
    except (NotImplementedError, MPI.Exception):  # an MPI without ULFM's calls: no death it could report
        return False


_seen: set[int] = set()  # every rank any DeadRanks of this process found dead
_deaths = 0  # deaths found so far in this process, every run's (a rank number can come back in a later run)


def deaths_seen() -> bool:
    """Whether this process saw a rank of its job die. Open MPI 5.0.11's ``MPI_Finalize`` then waits for
    the dead for good when the job spans several nodes (seen in the box): the caller should end the
    process without it (``os._exit``) once its work is written."""
    return bool(_seen)


def deaths_mark() -> int:
    """A mark of the deaths this process has seen so far, for :func:`deaths_since`."""
    return _deaths


def deaths_since(mark: int) -> bool:
    """Whether this process saw a rank die after :func:`deaths_mark` gave ``mark``: a run's own deaths, not
    those of an earlier run in the same process (which :func:`deaths_seen` keeps for good)."""
    return _deaths > mark


def end_without_the_dead(status: int) -> None:
    """After a run that went on without a dead rank, end this process at once with ``status``, its files
    written (:func:`deaths_seen`); else return (the caller exits as it would)."""
    if deaths_seen():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def part_ways(comm: MPI.Comm, watchdog: Callable[[float], object] | None = None) -> None:
    """Collective over the living, after the last collective whose result they need and before they end
    without ``MPI_Finalize`` (:func:`end_without_the_dead`): return once every rank of ``comm`` has come here,
    so has every rank's part of what came before. ULFM reports a process that ends without it as dead, and a
    rank still inside the collective before fails with ``MPI_ERR_PROC_FAILED``: a broadcast's root that sent
    and ended can take the message with it. Here a rank that leaves first costs the others nothing: a death
    reported inside this barrier is let pass (a rank that got here and ended, or one that died after the
    collective before, with nothing left to give). ``watchdog``: as for
    :func:`~hpcps.transport.poll.wait_until` (a rank that never comes is a hang to end, not to wait out)."""
    from hpcps.transport.poll import Backoff, polite_barrier

    try:
        polite_barrier(comm, Backoff(cap=0.01), watchdog)
    except MPI.Exception as exc:
        if not failed_on(exc, comm):
            raise


class DeadRanks:
    """The ranks of ``comms`` (duplicates of one communicator) known to have died; see the module docstring."""

    def __init__(self, comms: Iterable[MPI.Comm]) -> None:
        self.comms = list(comms)
        self.dead: set[int] = set()

    def found(self, exc: BaseException, statuses: Sequence[MPI.Status] = ()) -> set[int]:
        """The ranks newly known dead after ``exc`` (``statuses``: see :func:`is_failure`), acknowledged on
        every watched communicator; ``exc`` itself is raised again where it is not a rank's death."""
        if not is_failure(exc, statuses):
            raise exc
        return self.check()

    def check(self) -> set[int]:
        """Acknowledge what this rank's MPI knows of dead ranks; return those not known before."""
        found: set[int] = set()
        for comm in self.comms:
            comm.Ack_failed()
            failed, group = comm.Get_failed(), comm.Get_group()
            try:
                found.update(MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), group))
            finally:
                failed.Free()
                group.Free()
        new = found - self.dead
        self.add(new)
        return new

    def add(self, ranks: set[int]) -> None:
        """``ranks`` are dead (learned otherwise: a shrink)."""
        global _deaths
        _deaths += len(set(ranks) - self.dead)
        self.dead |= ranks
        _seen.update(ranks)


def left_out(before: MPI.Comm, after: MPI.Comm, into: MPI.Comm | None = None) -> set[int]:
    """The ranks of ``before`` that its shrink to ``after`` left out (the dead), as ranks of ``into``
    (default: of ``before``)."""
    groups = [before.Get_group(), after.Get_group()] + ([into.Get_group()] if into is not None else [])
    try:
        old, new = groups[0], groups[1]
        living = set(MPI.Group.Translate_ranks(new, list(range(new.Get_size())), old))
        gone = [r for r in range(old.Get_size()) if r not in living]
        return set(MPI.Group.Translate_ranks(old, gone, groups[2])) if into is not None else set(gone)
    finally:
        for group in groups:
            group.Free()


def found_dead(dead: DeadRanks | None, exc: MPI.Exception, statuses: Sequence[MPI.Status] = ()) -> set[int]:
    """The ranks newly dead that ``exc`` reports (``statuses``: see :func:`is_failure`), acknowledged, where
    ``dead`` watches (run-through); ``exc`` raised again where nothing watches or it is not a rank's death."""
    if dead is None:
        raise exc
    return dead.found(exc, statuses)


def completed(dead: DeadRanks | None, req: MPI.Request) -> bool:
    """Whether the send ``req`` completed; one to a rank that died counts as complete, gone with it (the
    death acknowledged where ``dead`` watches; the error raised again where nothing watches)."""
    try:
        return req.Test()
    except MPI.Exception as exc:
        found_dead(dead, exc)
        return True


def retried(dead: DeadRanks | None, call: Callable[[], T]) -> T:
    """``call()``; where it fails because a rank died (and ``dead`` watches: run-through), the death is
    acknowledged and ``call()`` made once more (a wildcard probe or receive, which then matches the living)."""
    try:
        return call()
    except MPI.Exception as exc:
        found_dead(dead, exc)
        return call()
