"""Errors that end a run with one clear message instead of a traceback."""


class UserError(Exception):
    """Bad input from the user (options, config, data, rank count).

    The message is printed as one line, without a traceback, and the
    process exits with status 2 on every rank.
    """

    exit_code = 2
