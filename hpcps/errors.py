"""Errors that end a run with one clear message instead of a traceback."""

import re
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


#: torch's words when a batch and the model sit on two devices (a tensor op, a module's check, a conv's types)
_TWO_DEVICES = re.compile(r"Expected all tensors to be on the same device|is not on the expected device"
                          r"|Input type \([^)]*cuda[^)]*\) and weight type|and weight type \([^)]*cuda[^)]*\)")


def hint(exc: BaseException) -> str:
    """What the user can do about ``exc``, where hpcps knows (else ""): appended to a failing rank's line.

    A loop written for the CPU, or one that put its batches on ``cuda:LOCAL_RANK`` as under DDP, meets a
    model hpcps placed on the worker's own device (``ps.device``, the log's "workers on" line) and fails
    in torch with a message about two devices that does not say where the model went or why.
    """
    if isinstance(exc, RuntimeError) and _TWO_DEVICES.search(str(exc)):
        return (" (hpcps put the model on ps.device, the worker's device: put each batch there, "
                "x.to(ps.device), or train on the CPU with device='cpu')")
    return ""
