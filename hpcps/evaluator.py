"""Server-side evaluation of the global parameters on the held-out set.

Runs on rank 0 as a side task of its server loop: every ``interval``
seconds it pulls the published parameters of every shard (the same
one-sided pull a worker uses), evaluates them, records a ``/eval`` row, and
calls ``on_target`` the first time accuracy reaches the target.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hpcps.data import Dataset
from hpcps.flat import FlatParameters

log = logging.getLogger("hpcps")


class Evaluator:
    def __init__(self, *, model: torch.nn.Module, flat: FlatParameters, data: Dataset,
                 pull: Callable[[np.ndarray], tuple[np.ndarray, bool]], recorder,
                 clock: Callable[[], float], interval: float, target: float | None = None,
                 on_target: Callable[[], object] | None = None, log_every: float = 5.0) -> None:
        self.model, self.flat = model, flat
        self.x = torch.from_numpy(data.x_test)
        self.y = torch.from_numpy(data.y_test)
        self.pull, self.recorder, self.clock = pull, recorder, clock
        self.interval, self.target, self.on_target = interval, target, on_target
        self.log_every = log_every
        self.last = self.last_log = 0.0
        self.reached = False
        self.accuracy = float("nan")

    def tick(self) -> bool:
        """Evaluate if ``interval`` has passed since the last evaluation."""
        if self.clock() - self.last < self.interval:
            return False
        self.evaluate()
        return True

    def evaluate(self) -> float:
        """Pull, evaluate, record; return the accuracy."""
        t = self.clock()
        versions, _ = self.pull(self.flat.params)
        with torch.no_grad():
            logits = self.model(self.x)
            loss = float(F.cross_entropy(logits, self.y))
            accuracy = float((logits.argmax(1) == self.y).double().mean())
        self.recorder.add("eval", (t, int(versions.min()), loss, accuracy))
        self.last, self.accuracy = self.clock(), accuracy
        if self.last - self.last_log >= self.log_every:
            self.last_log = self.last
            log.info("t=%.1fs version=%d test accuracy %.4f loss %.4f", t, int(versions.min()), accuracy, loss)
        if self.target is not None and accuracy >= self.target and not self.reached:
            self.reached = True
            log.info("target accuracy %.3f reached at t=%.2fs (%.4f): stopping", self.target, t, accuracy)
            if self.on_target is not None:
                self.on_target()
        return accuracy
