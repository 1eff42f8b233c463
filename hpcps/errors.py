"""Errors that end a run with one clear message instead of a traceback."""

import sys


def print_error(message: str) -> None:
    """The one line a failing hpcps command or run prints: ``hpcps: error: MESSAGE``."""
    print(f"hpcps: error: {message}", file=sys.stderr, flush=True)


#: exit status of a run stopped because its training diverged (``--divergence stop``): ``hpcps train``'s, and
#: a server rank's under :func:`hpcps.init`
DIVERGED_STATUS = 3


class UserError(Exception):
    """Bad input from the user (options, config, data, rank count).

    The message is printed as one line, without a traceback, and the
    process exits with status 2 on every rank.
    """

    exit_code = 2


class RunAborted(RuntimeError):
    """A run that must end on every rank (e.g. a non-finite gradient under ``--nonfinite abort``).

    The rank that raises it prints one line and calls ``MPI_Abort``; the
    metrics recorded so far stay in the run file.
    """
