"""The life of a process spawned in a dead worker's place (``--respawn``, :mod:`hpcps.runtime.respawn`):
``python -m hpcps.runtime.newcomer``, started by the survivors' ``MPI_Comm_spawn``. It takes a dead rank's
number in the grown job, resumes the run with the others, and ends as they do."""

from __future__ import annotations

import logging
import os
import sys
import time

from hpcps.runtime.respawn import joined, meet, respawning

log = logging.getLogger("hpcps")


def join() -> int:
    """A spawned process's life: take a dead rank's place, resume the run with the others, end (without
    ``MPI_Finalize``, which would wait for the dead)."""
    from hpcps.runtime.signals import catch_early

    catch_early()
    began = _process_start()
    from hpcps.log import setup_logging

    comm, rank = joined()
    setup_logging(comm.rank)
    cfg, part, first_out = comm.bcast(None, root=0)
    log.warning("rank %d: spawned in the place of the dead rank %d; in the job %.2f s after Python began",
                rank, rank, time.time() - began)
    from hpcps.runtime.agree import run_or_end
    from hpcps.runtime.run import run_training  # (torch: before the others stop waiting for us)

    meet(comm, cfg, "the spawned process(es) starting")
    resume = respawning(run_training)
    _, status = run_or_end(comm, lambda: resume(cfg, comm, part=part, first_out=first_out))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # as the living end (they saw a death): see hpcps.runtime.respawn


def _process_start() -> float:
    """This process's start (wall time), from Linux's /proc; now where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return time.time() - up + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


if __name__ == "__main__":
    sys.exit(join())
