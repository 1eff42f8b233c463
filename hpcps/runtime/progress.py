"""Rank 0's progress report: a tqdm bar on a terminal, a periodic status line everywhere else.

Under ``mpiexec`` or ``srun`` stderr is a pipe or a file, where a bar would
be noise (or, as tqdm does, nothing at all). There the report is one log
line every ``every`` seconds: gradients applied of the run's total, the rate
over the last interval, the time left at that rate, and the last held-out
accuracy.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Callable, TextIO

from tqdm import tqdm

log = logging.getLogger("hpcps")


class Progress:
    """Count applied gradients (:meth:`update`) toward ``total``; report as the module docstring says."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, every: float = 30.0,
                 accuracy: Callable[[], float] = lambda: math.nan, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        stream = stream or sys.stderr
        self.total, self.desc, self.every, self.accuracy, self.clock = total, desc, every, accuracy, clock
        tty = stream.isatty()
        self.bar = tqdm(total=total, unit="grad", desc=desc, file=stream, dynamic_ncols=True) \
            if enabled and tty else None
        self.lines = enabled and not tty
        self.done = 0
        self.last_t, self.last_done = clock(), 0

    def update(self, n: int) -> None:
        if self.done == 0:  # rates count from the first applied gradient: not the first step's compile
            self.last_t, self.last_done = self.clock(), n
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.lines and self.clock() - self.last_t >= self.every:
            log.info("%s", self.status())

    def status(self) -> str:
        """``progress: 1200/2000 gradients (60%), 412/s, 1.9 s left, accuracy 0.9120``; starts a new interval."""
        now = self.clock()
        rate = (self.done - self.last_done) / max(now - self.last_t, 1e-9)
        self.last_t, self.last_done = now, self.done
        left = (self.total - self.done) / rate if rate > 0 else math.inf
        accuracy = self.accuracy()
        return (f"progress: {self.done}/{self.total} gradients ({self.done / max(self.total, 1):.0%}), "
                f"{rate:.0f}/s, {left:.1f} s left" + ("" if math.isnan(accuracy) else f", accuracy {accuracy:.4f}"))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
