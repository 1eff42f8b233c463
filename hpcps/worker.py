"""The worker loop: pull, compute, push, (wait for the grant), pull again.

One iteration of worker ``w`` at ``step`` k::

    compute   forward/backward on batch_indices(..., worker=w, step=k) into the
              flat gradient buffer, then sleep as the emulation says (hpcps.emulation)
    push      start the persistent sends of header + gradient to every shard
    wait      if the paradigm blocks: until every shard granted clock k+1
    pull      RMA Get of every shard's parameters (overlaps the push in flight)
    settle    the push must have left before backward writes the buffer again

Receipts (apply version and staleness of each push) arrive as notices; an
iteration's row goes to the metrics once every shard's receipt is in. On
leaving, the worker sends ``DONE`` and reads notices until every shard has
said ``BYE``, so no message is left unreceived.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hpcps.data import Dataset, batch_indices
from hpcps.emulation import ComputeTime
from hpcps.flat import FlatParameters
from hpcps.transport import wire
from hpcps.transport.notices import NoticeBox
from hpcps.transport.poll import Backoff, wait_until
from hpcps.transport.push import Pusher
from hpcps.transport.window import ParamWindow


class Worker:
    """Run ``steps`` iterations (or until a shard raises the stop flag)."""

    def __init__(self, *, rank: int, index: int, n_workers: int, model: torch.nn.Module,
                 flat: FlatParameters, data: Dataset, window: ParamWindow, pusher: Pusher,
                 notices: NoticeBox, blocks: bool, recorder, clock: Callable[[], float],
                 steps: int, lr: float, batch_size: int, seed: int,
                 compute_time: ComputeTime | None = None, backoff: Backoff | None = None) -> None:
        self.rank, self.index, self.n_workers = rank, index, n_workers
        self.model, self.flat, self.data = model, flat, data
        self.window, self.pusher, self.notices = window, pusher, notices
        self.blocks = blocks
        self.recorder = recorder
        self.clock = clock
        self.steps, self.lr, self.batch_size, self.seed = steps, lr, batch_size, seed
        self.compute_time = compute_time or ComputeTime()
        self.rng = np.random.default_rng([seed, rank, 7])
        self.backoff = backoff or Backoff()
        self.x = torch.from_numpy(data.x_train)
        self.y = torch.from_numpy(data.y_train)
        n_shards = len(window.shard_ranks)
        self.grants = np.zeros(n_shards, np.int64)
        self.receipts: dict[int, list[tuple[int, int]]] = {}
        self.rows: dict[int, tuple] = {}
        self.clock_count = 0

    # -- the loop ---------------------------------------------------------
    def run(self) -> int:
        """Train; return the number of gradients pushed."""
        versions, stop = self.window.pull(self.flat.params, self.backoff)
        for step in range(self.steps):
            if stop:
                break
            t_start = self.clock()
            loss, compute_s = self._compute(step)
            t = time.perf_counter()
            self.clock_count = step + 1
            self.pusher.start(self.clock_count, versions, self.lr)
            push_s = time.perf_counter() - t
            wait_s = self._wait(lambda: self.grants.min() >= self.clock_count) if self.blocks else 0.0
            t = time.perf_counter()
            new_versions, stop = self.window.pull(self.flat.params, self.backoff)
            pull_s = time.perf_counter() - t
            push_s += self._wait(self.pusher.test)
            self.rows[self.clock_count] = (
                self.rank, step, t_start, self.clock(), compute_s, push_s, pull_s, wait_s,
                int(versions.min()), -1, self.lr, loss)
            self._read_notices()
            versions = new_versions
        self._leave()
        return self.clock_count

    def _compute(self, step: int) -> tuple[float, float]:
        idx = torch.from_numpy(batch_indices(len(self.y), batch_size=self.batch_size, n_workers=self.n_workers,
                                             worker=self.index, step=step, seed=self.seed))
        t = time.perf_counter()
        self.flat.zero_grad()
        loss = F.cross_entropy(self.model(self.x[idx]), self.y[idx])
        loss.backward()
        pause = self.compute_time.sleep_after(time.perf_counter() - t, self.rng)
        if pause > 0.0:
            time.sleep(pause)
        return float(loss.detach()), time.perf_counter() - t

    def _leave(self) -> None:
        self.pusher.start_done(self.clock_count)
        self._wait(lambda: self.notices.open == 0 and self.pusher.test_done())
        if self.rows:
            raise RuntimeError(f"worker rank {self.rank}: no receipt for pushes {sorted(self.rows)}")

    # -- notices ----------------------------------------------------------
    def _wait(self, condition: Callable[[], bool]) -> float:
        def ready() -> bool:
            self._read_notices()
            return condition()
        return wait_until(ready, self.backoff)

    def _read_notices(self) -> None:
        n_shards = len(self.grants)
        for note in self.notices.poll():
            if note.flags & wire.GRANT:
                self.grants[note.shard] += 1
            if note.flags & wire.RECEIPT:
                got = self.receipts.setdefault(note.clock, [])
                got.append((note.staleness, bool(note.flags & wire.DROPPED)))
        for clock in [c for c, got in self.receipts.items() if len(got) == n_shards and c in self.rows]:
            got = self.receipts.pop(clock)
            row = self.rows.pop(clock)
            staleness = -1 if any(dropped for _, dropped in got) else max(s for s, _ in got)
            self.recorder.add("workers/iterations", row[:9] + (staleness,) + row[10:])
