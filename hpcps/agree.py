"""Fail together: run a fallible start-up step on every rank and agree on the outcome.

A bad option, an unreadable file or too few ranks must end *every* rank
with the same clear message, never leave some ranks waiting in a collective
for one that has already quit.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from mpi4py import MPI

from hpcps.errors import UserError

T = TypeVar("T")
log = logging.getLogger("hpcps")


def agree(comm: MPI.Comm, step: Callable[[], T]) -> T:
    """Collective: ``step()`` on every rank; if it failed anywhere, raise UserError everywhere."""
    try:
        value, error = step(), None
    except UserError as exc:
        value, error = None, str(exc)
    except Exception as exc:  # an internal failure: keep the traceback on the rank that saw it
        log.exception("start-up failed on rank %d", comm.rank)
        value, error = None, f"internal error: {type(exc).__name__}: {exc}"
    errors = comm.allgather(error)
    failed = [(rank, msg) for rank, msg in enumerate(errors) if msg]
    if not failed:
        return value
    if len(failed) == comm.size and len({msg for _, msg in failed}) == 1:
        raise UserError(failed[0][1])
    raise UserError("; ".join(f"rank {rank}: {msg}" for rank, msg in failed[:4]))
