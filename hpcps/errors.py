"""Errors that end a run with one clear message instead of a traceback."""


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
