"""When a run has diverged, read from the workers' training losses as their rows arrive (pure: no MPI).

The rule (``--divergence stop``, the default), checked on rank 0 as the workers' iteration rows
reach the metrics file:

* **non-finite**: a worker that has reported a finite loss reports :data:`NONFINITE_ROWS`
  non-finite ones in a row (one bad batch is dropped by ``--nonfinite skip`` and is not a
  divergence; a NaN loss from the first row on is a loss the loop does not report, and ignored);
* **far above its start**: once two windows of finite losses have come (all workers together), the
  mean of the last window, at any loss as it comes (not only at the last of a batch of rows), is more
  than :data:`FACTOR` times the start: the mean of
  each worker's first finite loss. A worker's first step computes on the run's first
  parameters, before any update of the run, so the start is the untrained loss even where an
  asynchronous run blows up within its first few updates. A run that goes on from a checkpoint
  (``--resume``, ``--paradigm auto``'s trials) compares with the start of the run that wrote it,
  which its checkpoints carry: its own first losses are of a trained model, and three times a
  trained loss is noise (ResNet-18 going on from a trial at 0.06 was stopped at 0.3-1.0 while it
  trained on). The window is :data:`WINDOW` losses, or two a worker where that is fewer
  (:func:`window_for`, at least :data:`MIN_WINDOW`): 20 losses of 4 workers are 5 steps each, so the
  rule judged at the tenth step at the earliest, the end of a 10-step trial of ``--paradigm auto``.
  ResNet-18 under asp at bsp's settings (4 workers, the box) rose from 2.3 to a mean of 7.7 over its
  last 8 losses by the fifth step, and to 12-35 by the sixth: with two a worker it is stopped there.

A loss that stays at its start is not a divergence by this rule; :class:`FlatLoss` watches for it
apart: a run whose loss stays at its start over a long stretch (an asynchronous run whose first
updates killed the model sits at chance, ln 10 for ten classes, for all its steps, or falls back
there for good, and nothing said so) is said and stopped as one that diverged.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

#: finite losses averaged at the start and at the end
WINDOW = 20
#: how many times its start the recent mean loss may reach
FACTOR = 3.0
#: non-finite losses in a row, from one worker, that mean the run diverged
NONFINITE_ROWS = 3
#: the fewest losses a window averages, however few the workers (one loss of a batch is noise)
MIN_WINDOW = 8


def window_for(workers: int) -> int:
    """The losses :class:`DivergenceWatch`'s window averages for a run of ``workers`` workers: two a worker, at
    least :data:`MIN_WINDOW`, at most :data:`WINDOW`, so the rule judges once every worker has had its
    fourth step or so (a window of 20 losses of 4 workers waited for their tenth)."""
    return min(WINDOW, max(MIN_WINDOW, 2 * workers))


class DivergenceWatch:
    """Feed it the ``workers/iterations`` rows as they arrive; :attr:`reason` says why, once diverged.
    ``start``: the untrained loss of the run a resumed one goes on from (None: this run's own start)."""

    def __init__(self, window: int = WINDOW, factor: float = FACTOR, nonfinite_rows: int = NONFINITE_ROWS,
                 start: float | None = None) -> None:
        self.window, self.factor, self.nonfinite_rows = window, factor, nonfinite_rows
        self.given_start = start
        self.first: dict[int, float] = {}  # each worker's first finite loss
        self._first_sum = 0.0
        self.recent: deque[float] = deque(maxlen=window)
        self.seen = 0
        self.reported: set[int] = set()  # workers that have reported a finite loss
        self.bad_in_a_row: dict[int, int] = {}
        self.reason: str | None = None

    def observe(self, rows: np.ndarray) -> str | None:
        """Take rows of ``workers/iterations`` (any order of workers); return the reason the first time
        the run is found diverged, else None."""
        if self.reason is not None:
            return None
        for rank, step, loss in zip(rows["rank"].tolist(), rows["step"].tolist(), rows["loss"].tolist()):
            if math.isfinite(loss):
                self.reported.add(rank)
                self.bad_in_a_row[rank] = 0
                self.seen += 1
                if rank not in self.first:
                    self.first[rank] = loss
                    self._first_sum += loss
                self.recent.append(loss)
                if self.seen >= 2 * self.window and self._risen():
                    return self.reason
            elif rank in self.reported:
                self.bad_in_a_row[rank] = self.bad_in_a_row.get(rank, 0) + 1
                if self.bad_in_a_row[rank] >= self.nonfinite_rows:
                    self.reason = (f"worker rank {rank}'s training loss was {loss} in {self.nonfinite_rows} steps "
                                   f"in a row (up to its step {step})")
                    return self.reason
        return None

    def _risen(self) -> bool:
        """Whether the window's mean is now above :attr:`factor` times the start (:attr:`reason` then says so).
        Judged at every loss, not once a batch of rows: rows reach rank 0 as its loop drains them, a short
        run's in a batch or two, and a blow-up that had settled by a batch's end (asp at lr 50 on the digits'
        MLP: losses of 1e4-1e6 at the workers' third to fifth steps, 5-15 after) went unseen in some runs and
        not in others."""
        start, now = self.start, sum(self.recent) / len(self.recent)
        if start is None or not start > 0 or not now > self.factor * start:
            return False
        self.reason = (f"the training loss rose to {now:.4g} (mean of the last {self.window}) from "
                       f"{start:.4g} at the start (each worker's first), more than {self.factor:g} times")
        return True

    @property
    def start(self) -> float | None:
        """The loss the rule compares with: the given one, else the mean of each worker's first finite loss
        (None before any)."""
        if self.given_start is not None:
            return self.given_start
        return self._first_sum / len(self.first) if self.first else None


#: the stretch a loss must stay at its start to be said flat: a share of the planned steps, and at least as many.
#: A deep plain network sits on its untrained loss before it learns: the nine-layer deep_mlp of tools/ (SGD,
#: momentum 0.9, lr 0.05, 4 or 7 workers under bsp) left it at step 244-251 of every run measured, and went on
#: to 50-60%; a quarter of the run (at least 100) stopped its 600-step runs at step 156 as not learning.
FLAT_SHARE, FLAT_MIN_STEPS = 0.5, 300
#: how near its start (relative) the recent mean loss is, to count as not having moved
FLAT_TOLERANCE = 0.03


class FlatLoss:
    """Feed it the ``workers/iterations`` rows as they arrive; :attr:`reason` says so once the mean of the last
    :data:`WINDOW` losses has stayed within :data:`FLAT_TOLERANCE` of the start (the mean of each worker's first
    finite loss, as :class:`DivergenceWatch` takes it) for ``stretch`` steps of every worker in a row
    (:data:`FLAT_SHARE` of ``steps``, at least :data:`FLAT_MIN_STEPS`): a run that never left its untrained
    loss, or one that learned a little and fell back to it for good. A run of no more steps than the stretch
    is never said to be flat."""

    def __init__(self, steps: int, *, window: int = WINDOW, tolerance: float = FLAT_TOLERANCE,
                 share: float = FLAT_SHARE, least: int = FLAT_MIN_STEPS) -> None:
        self.stretch = max(least, math.ceil(share * steps))
        self.checkable = steps > self.stretch  # (a run that ends first: nothing to save by stopping it)
        self.window, self.tolerance = window, tolerance
        self.first: dict[int, float] = {}
        self.recent: deque[float] = deque(maxlen=window)
        self.flat_rows = 0  # rows in a row whose recent mean was at the start
        self.reason: str | None = None

    def observe(self, rows: np.ndarray) -> str | None:
        """Take rows of ``workers/iterations``; return the reason the one time the run is found flat."""
        if self.reason is not None or not self.checkable:
            return None
        for rank, loss in zip(rows["rank"].tolist(), rows["loss"].tolist()):
            if not math.isfinite(loss):
                continue
            self.first.setdefault(rank, loss)
            self.recent.append(loss)
            start = sum(self.first.values()) / len(self.first)
            now = sum(self.recent) / self.window
            at_start = len(self.recent) == self.window and abs(now - start) <= self.tolerance * abs(start)
            self.flat_rows = self.flat_rows + 1 if at_start else 0
            # (judged at every loss, as DivergenceWatch: a stretch that ended within a batch of rows counts)
            if self.flat_rows >= self.stretch * len(self.first):
                self.reason = (f"the training loss has stayed at its start for the last {self.stretch} steps of "
                               f"every worker: {now:.4g} (mean of the last {self.window}) against {start:.4g} at "
                               f"the start")
                return self.reason
        return None


#: gradients of a run's start, all non-finite, that mean its data or model make NaN from the first step
NONFINITE_START = 20


class NonFiniteStart:
    """Feed it the ``servers/updates`` rows as they arrive: :attr:`reason` says so once the first
    :data:`NONFINITE_START` gradients (shard 0's rows) were all dropped as non-finite and none was
    applied. A run whose every batch makes NaN (NaN in the data, a model that divides by zero) would
    otherwise "train" to its end applying nothing; the loss rule above cannot see it, as such a run never
    reports a finite loss (nor does a loop that reports none)."""

    def __init__(self, limit: int = NONFINITE_START) -> None:
        self.limit, self.dropped, self.done = limit, 0, False
        self.reason: str | None = None

    def observe(self, rows: np.ndarray) -> str | None:
        if self.done:
            return None
        for applied, reason in zip(rows["applied"][rows["shard"] == 0].tolist(),
                                   rows["reason"][rows["shard"] == 0].tolist()):
            if applied or reason != 1:
                self.done = True  # a gradient was applied (or skipped by its loop): the data can make one
                return None
            self.dropped += 1
            if self.dropped >= self.limit:
                self.done = True
                self.reason = (f"the first {self.limit} gradients were all non-finite (NaN or Inf) and none was "
                               f"applied: the data or the model makes NaN from the first step (is there NaN "
                               f"or Inf in the data?)")
                return self.reason
        return None
