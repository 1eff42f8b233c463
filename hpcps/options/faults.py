"""``--fault KIND@RANK:STEP``: fault injection for tests, as an option (pure parsing, no MPI; the faults act
in :mod:`hpcps.runtime.faults`).

At iteration STEP, worker RANK, after its forward/backward pass:

* ``nan``: poisons its gradient with NaN (the server then drops it, or aborts
  the job under ``--nonfinite abort``);
* ``raise``: raises an exception (the job must end on every rank, naming the rank);
* ``exit``: leaves the process at once with status 1, as a crashed rank would;
* ``kill``: sends itself SIGKILL, as the kernel's out-of-memory killer or a dying node would;
* ``killhead``: sends its push's headers, then SIGKILL before any payload: the shards hold a header of a
  worker that is dead (run-through: a lost push; a late header after a spare took its place);
* ``killverdict``: with pushes during backward (``--partition-mb``), sends its whole payload, then SIGKILL
  before the verdict that follows it: the shards hold a gradient whose verdict never comes (run-through: it
  is dropped); at a step without such a push, ``kill``;
* ``hang``: stops making progress forever (sleeping), as a stuck rank would; the
  stall detector (``--stall-warn``, ``--stall-abort``) must notice and end the job;
* ``usr1``: sends itself SIGUSR1, as a batch system does before the time limit
  (the whole job stops cleanly and writes a checkpoint: hpcps.runtime.signals).

Under ``hpcps supervise`` faults fire in the first launch only (:func:`armed`): a restart resumes before
STEP and would meet the same fault again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("nan", "raise", "exit", "kill", "killhead", "killverdict", "hang", "usr1")
#: the kinds acted out in the push, not after the pass: the step's push goes on as usual up to them
IN_PUSH = ("killverdict",)
_SPEC = re.compile(r"^([a-z][a-z0-9]*)@(\d+):(\d+)$")


@dataclass(frozen=True)
class Fault:
    """One ``--fault``: ``kind`` (one of :data:`KINDS`) acted out by worker rank ``rank`` at its step ``step``."""

    kind: str
    rank: int
    step: int


def parse_fault(spec: str) -> Fault:
    """``KIND@RANK:STEP`` as a :class:`Fault`; ValueError saying the form otherwise."""
    m = _SPEC.match(str(spec))
    if not m:
        raise ValueError(f"{spec!r}: expected KIND@RANK:STEP, e.g. nan@2:10")
    kind, rank, step = m.group(1), int(m.group(2)), int(m.group(3))
    if kind not in KINDS:
        raise ValueError(f"{spec!r}: KIND must be one of {', '.join(KINDS)}")
    return Fault(kind, rank, step)
