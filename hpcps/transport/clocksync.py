"""One clock for every rank's timestamps: rank 0's monotonic clock.

Times in the metrics are seconds since the run's start *on rank 0's clock*.
Taking each rank's own start after a barrier is not enough: on a busy node
ranks leave a barrier milliseconds apart, and a gradient could then be
recorded as applied before its push began.

* Ranks on rank 0's node share its clock (``time.perf_counter`` is the
  system-wide ``CLOCK_MONOTONIC`` on Linux): offset 0, exactly.
* Every other rank estimates its offset by ``PINGS`` ping-pongs with rank 0
  (on a run communicator, tags in :mod:`wire`), keeping the exchange with the
  smallest round trip: ``offset = t0_reply - (t_send + t_receive) / 2``,
  uncertain by at most half that round trip.

A rank's time is then ``perf_counter() + offset - t0``, ``t0`` being rank
0's start, broadcast once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from hpcps.transport import wire

PINGS = 16


@dataclass(frozen=True)
class RunClock:
    """Seconds since the run's start on rank 0's clock, and how sure this rank is of its offset to it."""

    t0: float  # rank 0's perf_counter() at the start
    offset: float  # rank 0's perf_counter() minus this rank's, at the same moment
    uncertainty: float  # |error of offset| is at most this (0 on rank 0's node)

    def __call__(self) -> float:
        return time.perf_counter() + self.offset - self.t0


def sync_clock(comm: MPI.Comm, shares_rank0_clock: bool, *, pings: int = PINGS) -> RunClock:
    """Collective over ``comm``: the run's clock, started now (see the module docstring)."""
    remote = [r for r, shared in enumerate(comm.allgather(shares_rank0_clock)) if not shared]
    offset, uncertainty = 0.0, 0.0
    buf = np.zeros(1, np.float64)
    if comm.rank == 0:
        for r in remote:
            for _ in range(pings):
                comm.Recv(buf, source=r, tag=wire.TAG_CLOCK_PING)
                buf[0] = time.perf_counter()
                comm.Send(buf, dest=r, tag=wire.TAG_CLOCK_PONG)
    elif comm.rank in remote:
        best = float("inf")
        for _ in range(pings):
            sent = time.perf_counter()
            comm.Send(buf, dest=0, tag=wire.TAG_CLOCK_PING)
            comm.Recv(buf, source=0, tag=wire.TAG_CLOCK_PONG)
            back = time.perf_counter()
            if back - sent < best:
                best, offset = back - sent, float(buf[0]) - (sent + back) / 2
        uncertainty = best / 2
    comm.Barrier()
    t0 = comm.bcast(time.perf_counter() if comm.rank == 0 else None, root=0)
    return RunClock(t0, offset, uncertainty)


def shares_clock_with_rank0(comm: MPI.Comm, node: MPI.Comm) -> bool:
    """Collective over ``comm``: whether this rank is on rank 0's node (``node``: this rank's shared-memory
    communicator, a split of ``comm``)."""
    members = node.allgather(comm.rank)
    return comm.rank in comm.bcast(members if comm.rank == 0 else None, root=0)
