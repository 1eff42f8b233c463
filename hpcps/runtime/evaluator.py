"""Server-side evaluation of the global parameters on the held-out set.

Rank 0 evaluates; its server loop calls :meth:`Evaluator.tick`. Every
``interval`` seconds (or, with ``every``, at every multiple of it, once every shard has published
that version) an evaluation pulls the published parameters and
buffers of every shard (one-sided, as a worker pulls, but of one version of every shard where
their slots allow it: :meth:`hpcps.transport.window.ParamWindow.pull_one_version`; a pull that read
a shard a round ahead of another evaluated a model that never was), evaluates
them with the workload's evaluation function in ``model.eval()`` under
``torch.no_grad()``, batch by batch, and records a ``/eval`` row (``loss``
and ``accuracy``; NaN where the evaluation gives none, and any other named
metric in ``/eval_metrics``) at the version read (the lowest, where the shards could not be read at
one). The first time the ``target``
(:class:`hpcps.options.targets.Target`: any metric the evaluation returns) is met it
calls ``on_target`` (the run's stop), and no periodic evaluation follows:
versions go on while the stop reaches the workers, and evaluating them would
only keep shard 0 from serving the last pushes; the final evaluation remains. Console lines, every
``log_every`` seconds, name the metrics the evaluation has (never a NaN one).

With ``background=True`` (the run uses it where the window protocol is the
pinned and MPI gives ``THREAD_MULTIPLE``) the pull and the forward passes
run in a helper thread, so shard 0 goes on serving pushes while a large
model is evaluated: torch releases the GIL inside its kernels, and the
pinned pull needs no lock the server could contend for. The loop's
``tick`` only starts an evaluation and, once one has finished, records it
and acts on the target, so rows, logging and the stop flag stay on the
loop's thread. Otherwise an evaluation runs inside ``tick``, and pushes to
shard 0 wait for it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from hpcps.runtime.parts import Records
from hpcps.training.flat import FlatParameters
from hpcps.options.targets import Target

log = logging.getLogger("hpcps")

#: how often (s) rank 0's loop asks every shard's newest version (a read of each one's header) while shard 0 has
#: published the version ``--eval-every`` evaluates next and another shard may not have
SETTLE_POLL_S = 0.005
#: the helper thread's nice value: where cores are short, the server's thread runs first
NICE = 19
#: rank 0 says so (once) where the evaluations' pulls took more than this share of the run's time, after
#: :data:`PULLS_BEFORE_SAYING` of them: each pulls the whole model over rank 0's link, beside the transfers of
#: the workers on its node, and a bsp round waits for the slowest worker (ResNet-18 at 100 Mbit/s in the box:
#: 8 steps took 1.23-1.31x as long with an evaluation every 5 s as with none, docs/results.md)
PULL_SHARE = 0.1
PULLS_BEFORE_SAYING = 3
#: ...and where a pull took this many seconds on average: a model crossing a slow link, not the ms a pull of a
#: small model waits for a descheduled shard on a busy node (frequent evaluations there are cheap, and wanted)
PULL_SLOW_S = 0.1


@dataclass(frozen=True)
class EvalPlan:
    """When rank 0 evaluates, and what follows: every ``interval`` seconds, or (``every``) at the versions
    ``every``, 2 ``every``, ...; ``target``: the metric that stops the run when met, calling
    ``on_target``; console lines every ``log_every`` seconds."""

    interval: float
    every: int | None = None
    target: Target | None = None
    on_target: Callable[[], object] | None = None
    log_every: float = 5.0


class Evaluator:
    def __init__(self, *, model: torch.nn.Module, flat: FlatParameters, batches: Iterable[Any] | None,
                 evaluate: Callable[[torch.nn.Module, Iterable[Any]], Mapping[str, float]],
                 pull: Callable[..., tuple[np.ndarray, bool]], records: Records, plan: EvalPlan,
                 background: bool = False, version: Callable[[], int] = lambda: 0,
                 settled: Callable[[], int] | None = None) -> None:
        """Evaluate ``model`` (its flat vector ``flat``) on ``batches`` with ``evaluate``, the parameters
        ``pull(out)`` brings (``pull(out, at=V)`` for ``plan.every``'s version V), as and when ``plan`` says;
        rows to ``records``. ``version()``: shard 0's own;
        ``settled()``: the lowest version every shard has published, which ``plan.every`` waits for (None:
        shard 0's stands for every shard's)."""
        self.model, self.flat, self.batches, self.evaluate_fn = model, flat, batches, evaluate
        self.pull, self.recorder, self.clock = pull, records.recorder, records.clock
        self.interval, self.target, self.on_target = plan.interval, plan.target, plan.on_target
        self.log_every, every = plan.log_every, plan.every
        self.last = self.last_log = 0.0
        self.every, self.version, self.settled = every, version, settled
        self.last_version = 0  # the version of the last evaluation started, then the version it read
        self._asked = -math.inf  # when settled() was last asked
        self.at: int | None = None  # the version the evaluation under way is to read (every), None: any
        self.reached = False
        self.accuracy = float("nan")
        self.metrics: dict[str, float] = {}
        self.background = background and batches is not None
        self._thread: threading.Thread | None = None
        self._result: tuple | BaseException | None = None  # the helper's last evaluation, or its error
        self.pulls, self.pulled_s, self.said_pulls = 0, 0.0, False  # the evaluations' pulls, and their seconds

    def tick(self) -> bool:
        """Record a finished background evaluation; start one (or, in the foreground, run one) if
        ``interval`` has passed since the last. True if an evaluation was recorded or started."""
        if self.batches is None:
            return False
        recorded = self._collect()
        if self._thread is not None or not self._due():
            return recorded
        self.last_version = self.at if self.at is not None else self.version()
        if not self.background:
            self.evaluate()
            return True
        self.last = self.clock()
        self._thread = threading.Thread(target=self._in_background, name="hpcps-evaluator", daemon=True)
        self._thread.start()
        return True

    def _due(self) -> bool:
        if self.reached:  # the run is stopping; the final evaluation (evaluate) is the one left to take
            return False
        if self.every is None:
            return self.clock() - self.last >= self.interval
        # every: at the versions every, 2 every, ... once every shard has published the next, and the read is
        # of that version (``at``: under rounds, out of the slots of the shards gone past it), so that runs of
        # one trajectory evaluate the same versions; the next at least every versions after the version read
        # (a read that lagged the rounds does not start the next at once), on the grid whatever version a run
        # starts at. (Started as shard 0 published it, an evaluation read that version or the one before,
        # whichever the shards read first held: ResNet-18 at 100 Mbit/s, version 69 scored 0.956 and 70
        # 0.941, and of three runs of one trajectory two met 95% at 69, one at 80.)
        grid = -(-(self.last_version + self.every) // self.every) * self.every
        if self.version() < grid:
            return False
        if self.settled is not None:
            now = self.clock()
            if now - self._asked < SETTLE_POLL_S:
                return False
            self._asked = now
            if self.settled() < grid:
                return False
        # (a whole ``every`` past it, as at a resumed run's start: evaluate what is there)
        self.at = grid if self.version() < grid + self.every else None
        return True

    def evaluate(self) -> float:
        """Pull, evaluate and record now, in this thread (after any background evaluation has ended);
        return the accuracy (NaN without held-out data or an accuracy metric)."""
        self.close()
        self._record(*self._measure())
        return self.accuracy

    def close(self) -> None:
        """Wait for a background evaluation to end and record it."""
        if self._thread is not None:
            self._thread.join()
            self._collect()

    def _in_background(self) -> None:
        try:
            if hasattr(os, "setpriority") and sys.platform.startswith("linux"):  # a Linux thread's own nice
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            self._result = self._measure()
        except BaseException as exc:  # raised again in the loop's thread, by _collect
            self._result = exc

    def _collect(self) -> bool:
        if self._thread is None or self._thread.is_alive():
            return False
        self._thread, result, self._result = None, self._result, None
        if isinstance(result, BaseException):
            raise RuntimeError(f"evaluation failed: {type(result).__name__}: {result}") from result
        self._record(*result)
        return True

    def _measure(self) -> tuple[float, int, dict[str, float], float]:
        t = self.clock()
        at, self.at = self.at, None
        versions, _ = self.pull(self.flat.params) if at is None else self.pull(self.flat.params, at=at)
        pulled = self.clock() - t
        self.flat.upload()
        if self.batches is None:
            return t, int(versions.min()), {}, pulled
        self.model.eval()
        with torch.no_grad():
            metrics = {k: float(v) for k, v in self.evaluate_fn(self.model, self.batches).items()}
        return t, int(versions.min()), metrics, pulled

    def _weigh_pull(self, pulled: float) -> None:
        """Count an evaluation's pull (``pulled`` seconds); say once where the pulls took more than
        :data:`PULL_SHARE` of the run's time so far and :data:`PULL_SLOW_S` each (the user chose how often to
        evaluate: the line says what it costs the workers, where a link is slow for the model's size)."""
        self.pulls, self.pulled_s = self.pulls + 1, self.pulled_s + pulled
        elapsed = self.clock()
        if (self.said_pulls or self.pulls < PULLS_BEFORE_SAYING or self.pulled_s < PULL_SLOW_S * self.pulls
                or not self.pulled_s > PULL_SHARE * elapsed > 0):
            return
        self.said_pulls = True
        how = (f"every {self.every} versions (--eval-every)" if self.every is not None else
               f"{self.interval:g} s after the last one ended (--eval-interval)")
        log.warning("the held-out evaluations' pulls took %.0f%% of the run's %.0f s so far (%.2f s each, an "
                    "evaluation %s): each brings the whole model (%.1f MB) to rank 0 over its node's link, beside "
                    "the transfers of the workers there, whose steps then wait; evaluate less often to give "
                    "the workers the link", 100 * self.pulled_s / elapsed, elapsed, self.pulled_s / self.pulls,
                    how, self.flat.params.nbytes / 1e6)

    def _record(self, t: float, version: int, metrics: dict[str, float], pulled: float = 0.0) -> None:
        if self.batches is None:
            return
        self._weigh_pull(pulled)
        loss, accuracy = metrics.get("loss", math.nan), metrics.get("accuracy", math.nan)
        self.recorder.add("eval", (t, version, loss, accuracy))
        for name, value in metrics.items():
            if name not in ("loss", "accuracy"):
                self.recorder.add("eval_metrics", (t, version, name.encode()[:32], value))
        self.last, self.accuracy, self.metrics = self.clock(), accuracy, metrics
        # ``every`` counts from the version evaluated: a background evaluation reads its version after it
        # starts, and counting from the start let the next one read as little as 1 version later
        self.last_version = max(self.last_version, version)
        if self.last - self.last_log >= self.log_every:
            self.last_log = self.last
            log.info("t=%.1fs version=%d %s", t, version,
                     " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if not math.isnan(v)))
        value = metrics.get(self.target.name, math.nan) if self.target is not None else math.nan
        if self.target is not None and self.target.reached(value) and not self.reached:
            self.reached = True
            log.info("target %s reached at t=%.2fs (%s %.4f): stopping", self.target, t, self.target.name, value)
            if self.on_target is not None:
                self.on_target()
