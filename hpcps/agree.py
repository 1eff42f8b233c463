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
