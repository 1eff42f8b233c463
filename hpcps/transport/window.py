"""Published parameters in an RMA window; one-sided pulls that never tear.

Each server shard owns a block of the window (layout in :mod:`wire`). The
shard *publishes* by copying its master parameters in under an exclusive
lock on itself; a worker *pulls* by ``Rget`` of header and data from every
shard under shared locks, polling the requests with a backoff. The locks
exclude each other, so a pull returns each shard's parameters together
with the one version they belong to.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from mpi4py import MPI

from hpcps.transport import wire
from hpcps.transport.poll import Backoff, wait_until


class ParamWindow:
    """The run's parameter window (collective over ``comm`` to create and free).

    ``shard_ranks[s]`` is the rank (in ``comm``) of shard ``s``, whose
    parameters are the block ``bounds[s]`` of the flat vector. The calling
    rank exposes ``local_len`` float32 values (0 unless it is a shard).
    """

    def __init__(self, comm: MPI.Comm, *, shard_ranks: Sequence[int],
                 bounds: Sequence[tuple[int, int]], local_len: int = 0) -> None:
        size = wire.WINDOW_HEADER_BYTES + 4 * local_len if local_len else 0
        self.win: MPI.Win | None = MPI.Win.Allocate(size, 1, comm=comm)
        self.rank = comm.rank
        self.shard_ranks = list(shard_ranks)
        self.bounds = list(bounds)
        self._heads = np.zeros((len(self.shard_ranks), 8), np.int64)
        self.header = self.data = None
        if local_len:
            mem = np.frombuffer(self.win.tomemory(), np.uint8)
            self.header = mem[: wire.WINDOW_HEADER_BYTES].view(np.int64)
            self.data = mem[wire.WINDOW_HEADER_BYTES:].view(np.float32)
            self.header[:] = 0

    # -- lifetime -------------------------------------------------------
    def _live(self) -> MPI.Win:
        if self.win is None:
            raise RuntimeError("parameter window used after free()")
        return self.win

    def free(self) -> None:
        """Collective: release the window (idempotent)."""
        if self.win is not None:
            self.header = self.data = None
            self.win.Free()
            self.win = None

    def __enter__(self) -> "ParamWindow":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    # -- server side ----------------------------------------------------
    def publish(self, params: np.ndarray, version: int) -> None:
        """Expose ``params`` as ``version`` of this rank's shard, atomically for readers."""
        win = self._live()
        win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        np.copyto(self.data, params)
        self.header[wire.WIN_VERSION] = version
        win.Unlock(self.rank)

    def set_stop(self) -> None:
        """Raise this shard's stop flag; workers see it at their next pull."""
        win = self._live()
        win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        self.header[wire.WIN_STOP] = 1
        win.Unlock(self.rank)

    # -- reader side ----------------------------------------------------
    def pull(self, out: np.ndarray, backoff: Backoff | None = None) -> tuple[np.ndarray, bool]:
        """Read every shard into its block of ``out``.

        Returns the shard versions (int64 array, one per shard) and whether
        any shard raised its stop flag. Waits politely.
        """
        return self._read(out, backoff)

    def peek(self, backoff: Backoff | None = None) -> np.ndarray:
        """The current version of every shard (headers only: 64 bytes per shard)."""
        return self._read(None, backoff)[0]

    def _read(self, out: np.ndarray | None, backoff: Backoff | None) -> tuple[np.ndarray, bool]:
        win = self._live()
        requests = []
        for s, (rank, (lo, hi)) in enumerate(zip(self.shard_ranks, self.bounds)):
            win.Lock(rank, MPI.LOCK_SHARED)
            requests.append(win.Rget(self._heads[s], rank, (0, wire.WINDOW_HEADER_BYTES, MPI.BYTE)))
            if out is not None:
                requests.append(win.Rget(out[lo:hi], rank, (wire.WINDOW_HEADER_BYTES, 4 * (hi - lo), MPI.BYTE)))
        wait_until(lambda: MPI.Request.Testall(requests), backoff)
        for rank in self.shard_ranks:
            win.Unlock(rank)
        versions = self._heads[:, wire.WIN_VERSION].copy()
        return versions, bool(self._heads[:, wire.WIN_STOP].any())
