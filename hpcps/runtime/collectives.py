"""The workers' own collectives in the step API (``ps.mean``, ``ps.optimizer``'s state, ``--local-steps-by-speed``),
over a duplicate of the workers' communicator, so the loop's traffic never meets hpcps's; under run-through
(Open MPI's ULFM) they go on over the living after a worker's death."""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

from hpcps.transport.failures import failed_on, left_out

log = logging.getLogger("hpcps")


class WorkerCollectives:
    """Nonblocking collectives over ``comm`` (the workers alone; freed by :meth:`free`), each waited for with
    ``wait(test, what)`` (which keeps this worker's transfers moving and watches for stalls).

    ``dead``: the run's record of the dead ranks under run-through (None otherwise), told of the workers a
    shrink leaves out (``run_comm``: the run's communicator, whose ranks it records); ``rank``: this worker's
    rank in the run, for the log."""

    def __init__(self, comm: MPI.Comm, wait: Callable[[Callable[[], bool], str], None], *, dead=None,
                 run_comm: MPI.Comm | None = None, rank: int = 0) -> None:
        self.comm, self.wait, self.dead, self.run_comm, self.rank = comm, wait, dead, run_comm, rank

    @property
    def size(self) -> int:
        """The workers (the living, after a death under run-through)."""
        return self.comm.size

    def mean(self, value, what: str):
        """``value`` (a number, a tensor or an array, the same shape on every worker) averaged over the
        workers, of the same kind (a tensor on its device); ``what``: the wait's name in a stall's line."""
        is_tensor = torch.is_tensor(value)
        data = np.array(value.detach().cpu().double().numpy() if is_tensor else value, dtype=np.float64, order="C")
        total = np.empty_like(data)
        self.run(lambda comm: comm.Iallreduce(data, total, op=MPI.SUM), what)
        total /= self.comm.size
        if is_tensor:
            return torch.from_numpy(total).to(dtype=value.dtype, device=value.device)
        if isinstance(value, np.ndarray):
            return total.astype(value.dtype, copy=False)
        return float(total)

    def free(self) -> None:
        """Free the communicator."""
        self.comm.Free()

    def run(self, start: Callable[[MPI.Comm], MPI.Request], what: str) -> None:
        """``start(workers)`` a nonblocking collective over the workers and wait for it (``wait``).

        Under run-through (ULFM), a worker's death fails it on the living: each revokes the workers'
        communicator, so that a living worker not yet in the collective, or in another, fails too when it
        gets there rather than wait for the dead. Then the living agree (``MPIX_Comm_agree``, which runs
        through failures) whether it completed on every one of them: a collective can complete on some and
        fail on others, and those must not go on to their next one while these start this one again. Where
        it did not, they shrink the communicator to the living and start it again over them."""
        while True:
            try:
                self.wait(start(self.comm).Test, what)
                done = True
            except MPI.Exception as exc:
                if self.dead is None or not failed_on(exc, self.comm):
                    raise
                self.comm.Revoke()
                done = False
            if self.dead is None:
                return
            if self._agree(done, what):
                return
            shrunk = self.comm.Shrink()
            self._note_dead(shrunk)
            if shrunk.rank == 0:
                log.warning("worker rank %d: a worker died; the workers' collectives go on over the %d "
                            "living", self.rank, shrunk.size)
            # (the revoked communicator is not freed: its free would wait for the dead)
            self.comm = shrunk

    def _note_dead(self, shrunk: MPI.Comm) -> None:
        """The workers that the shrink to ``shrunk`` left out are dead: the run's record of the dead, so
        that ``deaths_seen()`` tells this worker's loop, though no transfer of its own met the death."""
        self.dead.add(left_out(self.comm, shrunk, into=self.run_comm))

    def _agree(self, done: bool, what: str) -> bool:
        """Run-through: whether every living worker completed the collective (``done`` here), waited for as
        ``wait`` does. The agreement fails alike on every living worker where a worker died
        unacknowledged: then it did not complete, everywhere."""
        flag = np.array([int(done)], dtype=np.intc)  # in: this worker's; out: the bitwise AND of the living's
        try:
            self.wait(self.comm.Iagree(flag).Test, f"the living workers' agreement on {what}")
            return bool(flag[0])
        except MPI.Exception as exc:
            if not failed_on(exc, self.comm):
                raise
            self.comm.Ack_failed()  # (what the agreement found: the shrink below leaves them out)
            return False
