"""Getting metric rows from every rank into rank 0's run file.

Every rank records rows through a recorder with one interface (``add``,
``flush``, ``close``). Rank 0's :class:`FileRecorder` holds its own rows
and, as a side task of its loop, drains the batches that every other
rank's :class:`ForwardingRecorder` sends it on the run's metrics
communicator (a dup of the run communicator); it appends what it holds to
the :class:`RunFile` every ``interval`` seconds, one write per table.
Batches go out every ``batch_rows`` rows or ``interval`` seconds, whichever
comes first.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
from mpi4py import MPI

from hpcps.metrics.runfile import RunFile
from hpcps.metrics.schema import TABLES
from hpcps.transport.failures import retried
from hpcps.transport.poll import Backoff, wait_until

TAG_ROWS = 21
TAG_CLOSE = 22
DRAIN_LIMIT = 8  # batches written per call of FileRecorder.drain: bounded work per server-loop iteration


class _Buffer:
    """Rows per table, flushed by size or age."""

    def __init__(self, batch_rows: int, interval: float) -> None:
        self.rows: dict[str, list[tuple]] = defaultdict(list)
        self.count = 0
        self.batch_rows = batch_rows
        self.interval = interval
        self.last = time.monotonic()

    def add(self, table: str, row: tuple) -> bool:
        """Buffer one row; true when a flush is due."""
        self.rows[table].append(row)
        self.count += 1
        return self.due()

    def due(self) -> bool:
        return self.count > 0 and (self.count >= self.batch_rows or time.monotonic() - self.last >= self.interval)

    def take(self) -> dict[str, np.ndarray]:
        batch = {t: np.array(rows, dtype=TABLES[t]) for t, rows in self.rows.items() if rows}
        self.rows.clear()
        self.count = 0
        self.last = time.monotonic()
        return batch


class _Recorder:
    """What every recorder does with a row: buffer it, and flush when the batch is due."""

    buffer: _Buffer

    def flush(self) -> None:
        raise NotImplementedError

    def add(self, table: str, row: tuple) -> None:
        if self.buffer.add(table, row):
            self.flush()

    def tick(self) -> None:
        """Flush rows that have waited ``interval`` (call while blocked, so a stalled job keeps them)."""
        if self.buffer.due():
            self.flush()


class ForwardingRecorder(_Recorder):
    """Any rank but 0: batch rows and send them to rank 0."""

    def __init__(self, comm: MPI.Comm, *, batch_rows: int = 256, interval: float = 0.25) -> None:
        self.comm = comm
        self.buffer = _Buffer(batch_rows, interval)
        self._sends: list[MPI.Request] = []

    def flush(self) -> None:
        batch = self.buffer.take()
        if batch:
            self._sends.append(self.comm.isend(batch, dest=0, tag=TAG_ROWS))
        self._sends = [r for r in self._sends if not r.Test()]

    def close(self, backoff: Backoff | None = None) -> None:
        """Send what is left and a close marker; wait (politely) until sent."""
        self.flush()
        self._sends.append(self.comm.isend(None, dest=0, tag=TAG_CLOSE))
        # (rank 0 may be evaluating the final model meanwhile, for as long as that takes: no stall of ours)
        wait_until(lambda: MPI.Request.Testall(self._sends), backoff, watched=False)
        self._sends = []


class FileRecorder(_Recorder):
    """Rank 0: own rows and other ranks' batches (via :meth:`drain`) into the file, every ``interval`` seconds.

    Rows are held in memory as they come (their watchers see them at once) and appended in one write per
    table every ``interval`` seconds. Rank 0 is a shard: a write per batch as it came (a few tables, 28
    batches a second from 7 ranks) cost its loop 6 ms a step in the box and, landing between a round's last
    push and its release, held the round up for the job.
    """

    def __init__(self, comm: MPI.Comm, runfile: RunFile, *, interval: float = 0.25, dead=None) -> None:
        """``dead``: a :class:`~hpcps.transport.failures.DeadRanks` over ``comm`` (run-through): a rank that
        died is closed (its rows not sent yet died with it), instead of an MPI error."""
        self.comm = comm
        self.dead = dead
        self.file = runfile
        self.buffer = _Buffer(batch_rows=1 << 30, interval=interval)
        self.open_ranks = set(range(1, comm.size))
        self.interval = interval
        self.watchers: dict[str, list] = {}  # table -> callables given every batch of its rows (any rank's)
        self.held: dict[str, list[np.ndarray]] = defaultdict(list)  # rows not written yet, by table
        self._written = time.monotonic()

    def flush(self) -> None:
        """Write every row held (rank 0's own too) and flush the file."""
        for table, rows in self.buffer.take().items():
            self._hold(table, rows)
        self._write()

    def _hold(self, table: str, rows: np.ndarray) -> None:
        self.held[table].append(rows)
        for watch in self.watchers.get(table, ()):  # rank 0's own rows (shard 0's), as the others'
            watch(rows)

    def _write(self) -> None:
        for table, parts in self.held.items():
            self.file.append(table, parts[0] if len(parts) == 1 else np.concatenate(parts))
        self.held.clear()
        self.file.flush()
        self._written = time.monotonic()

    def drain(self, limit: int | None = DRAIN_LIMIT) -> bool:
        """Take at most ``limit`` batches that have arrived (None: all); true if any did. The rows held are
        written once ``interval`` seconds have passed since the last write.

        Bounded, because the server loop calls it between pushes: a burst of
        batches is taken over several loop iterations, not in one stall.
        """
        status = MPI.Status()
        got = 0
        while (limit is None or got < limit) and self._probe(status):
            msg = self.comm.recv(source=status.Get_source(), tag=status.Get_tag())
            if status.Get_tag() == TAG_CLOSE:
                self.open_ranks.discard(status.Get_source())
            else:
                for table, rows in msg.items():
                    self._hold(table, rows)
            got += 1
        if self.held and time.monotonic() - self._written >= self.interval:
            self._write()
        return bool(got)

    def _probe(self, status: MPI.Status) -> bool:
        came = retried(self.dead, lambda: self.comm.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status))
        if self.dead is not None:
            self.open_ranks -= self.dead.dead
        return came

    def close(self, backoff: Backoff | None = None) -> None:
        """Wait until every other rank has closed, writing what they send; every row is in the file after."""
        self.flush()

        def all_closed() -> bool:
            self.drain(limit=None)
            return not self.open_ranks

        # (a rank closes once its part is over: a slow worker's may last the run; a hung one is its waits' to end)
        wait_until(all_closed, backoff, watched=False)
        self._write()
