"""Server-side evaluation of the global parameters on the held-out set.

Runs on rank 0 as a side task of its server loop: every ``interval``
seconds it pulls the published parameters and buffers of every shard (the
same one-sided pull a worker uses), evaluates them with the workload's
evaluation function in ``model.eval()`` under ``torch.no_grad()``, batch by
batch, records a ``/eval`` row (``loss`` and ``accuracy``; NaN where the
evaluation gives none, and any other named metric in ``/eval_metrics``),
and calls ``on_target`` the first time accuracy reaches the target.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from hpcps.flat import FlatParameters

log = logging.getLogger("hpcps")


class Evaluator:
    def __init__(self, *, model: torch.nn.Module, flat: FlatParameters, batches: Iterable[Any] | None,
                 evaluate: Callable[[torch.nn.Module, Iterable[Any]], Mapping[str, float]],
                 pull: Callable[[np.ndarray], tuple[np.ndarray, bool]], recorder,
                 clock: Callable[[], float], interval: float, target: float | None = None,
                 on_target: Callable[[], object] | None = None, log_every: float = 5.0) -> None:
        self.model, self.flat, self.batches, self.evaluate_fn = model, flat, batches, evaluate
        self.pull, self.recorder, self.clock = pull, recorder, clock
        self.interval, self.target, self.on_target = interval, target, on_target
        self.log_every = log_every
        self.last = self.last_log = 0.0
        self.reached = False
        self.accuracy = float("nan")
        self.metrics: dict[str, float] = {}

    def tick(self) -> bool:
        """Evaluate if ``interval`` has passed since the last evaluation."""
        if self.batches is None or self.clock() - self.last < self.interval:
            return False
        self.evaluate()
        return True

    def evaluate(self) -> float:
        """Pull, evaluate, record; return the accuracy (NaN without held-out data or an accuracy metric)."""
        t = self.clock()
        versions, _ = self.pull(self.flat.params)
        self.flat.upload()
        if self.batches is None:
            return self.accuracy
        self.model.eval()
        with torch.no_grad():
            metrics = {k: float(v) for k, v in self.evaluate_fn(self.model, self.batches).items()}
        loss, accuracy = metrics.get("loss", math.nan), metrics.get("accuracy", math.nan)
        version = int(versions.min())
        self.recorder.add("eval", (t, version, loss, accuracy))
        for name, value in metrics.items():
            if name not in ("loss", "accuracy"):
                self.recorder.add("eval_metrics", (t, version, name.encode()[:32], value))
        self.last, self.accuracy, self.metrics = self.clock(), accuracy, metrics
        if self.last - self.last_log >= self.log_every:
            self.last_log = self.last
            log.info("t=%.1fs version=%d %s", t, version, " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if self.target is not None and accuracy >= self.target and not self.reached:
            self.reached = True
            log.info("target accuracy %.3f reached at t=%.2fs (%.4f): stopping", self.target, t, accuracy)
            if self.on_target is not None:
                self.on_target()
        return accuracy
