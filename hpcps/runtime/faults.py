"""Fault injection at run time: the ``--fault`` a rank acts out (:func:`inject`; the option and its kinds are
:mod:`hpcps.options.faults`'), and the marks a supervised launch leaves (:func:`mark_launch`).

Under ``hpcps supervise`` faults fire in the first launch only (:func:`armed`): a restart resumes before
STEP and would meet the same fault again.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from hpcps.options.faults import Fault

log = logging.getLogger("hpcps")


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault raises."""


#: the launch a supervisor is at (1 for the first; hpcps.jobs.supervise sets it)
ATTEMPT_VAR = "HPCPS_ATTEMPT"
#: a file the supervisor names for each launch: rank 0 writes ``started`` into it once the run is set up and
#: ``finished`` once its run file is complete, so that a launcher that says 0 for a run that never finished
#: (Open MPI's under ``--with-ft ulfm`` says 0 whatever the ranks did) is not taken at its word
MARK_VAR = "HPCPS_LAUNCH_MARK"


def mark_launch(state: str, environ=None) -> None:
    """Write ``state`` (``started``, ``finished``) into the supervisor's mark for this launch, if it named one
    (:data:`MARK_VAR`); a mark that cannot be written is left out (the supervisor then trusts the status)."""
    path = (os.environ if environ is None else environ).get(MARK_VAR)
    if path:
        try:
            with open(path, "w") as f:
                f.write(state)
        except OSError:
            pass


def armed(faults: list[Fault], environ) -> list[Fault]:
    """The faults to inject in this launch: all in the first (or an unsupervised one), none after."""
    try:
        attempt = int(environ.get(ATTEMPT_VAR, "1"))
    except ValueError:
        attempt = 1
    return list(faults) if attempt <= 1 else []


def inject(fault: Fault, worker) -> None:
    """Act out ``fault`` on ``worker`` (a :class:`~hpcps.runtime.worker.Worker`, at the step the fault names,
    after its pass): poison its gradient (``nan``), raise (``raise``), signal itself (``usr1``), hang, die
    (``kill``), die between its push's headers and payload (``killhead``) or between its payload and verdict
    (``killverdict``), or exit with status 1."""
    if fault.kind == "nan":
        worker.flat.grads_t[:: max(1, worker.flat.size // 7)] = float("nan")
    elif fault.kind == "raise":
        raise InjectedFault(f"injected fault at step {fault.step}")
    elif fault.kind == "usr1":
        os.kill(os.getpid(), signal.SIGUSR1)  # handled at the next poll, as a batch system's would be
    elif fault.kind == "hang":
        while True:  # stuck for good: only the stall detector ends this job
            time.sleep(3600)
    elif fault.kind == "kill":
        die(fault, worker)
    elif fault.kind == "killverdict":  # (called in the push, its payload begun: hpcps.runtime.worker)
        slot = worker.step % len(worker.pusher.buffers)
        worker._wait(lambda: worker.pusher.test(slot), "its push's payload to leave")
        die(fault, worker)
    elif fault.kind == "killhead":  # its push's headers reach the shards, its payload never
        slot = worker.step % len(worker.pusher.buffers)
        worker._wait(lambda: worker.pusher.test(slot), "its push slot")
        worker.pusher.start_header(worker.clock_count + 1, worker.versions, worker.lr, slot)
        worker._wait(lambda: worker.pusher.headers_sent(slot), "its push's headers to leave")
        die(fault, worker)
    else:  # status 1, an ordinary crash's: 3 says a run diverged (hpcps.errors.DIVERGED_STATUS)
        worker.recorder.flush()
        os._exit(1)


def die(fault: Fault, worker) -> None:
    """SIGKILL this process, after one line that says when on the run's clock (the rows' ``t_start`` and
    ``t_end``): what the death then cost the others is read against it (``tools/bench_peers.py``)."""
    log.warning("worker rank %d: --fault %s@%d:%d: SIGKILL at t=%.4f s", fault.rank, fault.kind, fault.rank,
                fault.step, worker.clock())
    os.kill(os.getpid(), signal.SIGKILL)
