"""Heterogeneous-cluster emulation: how long a worker's compute takes.

Two modes, both per worker:

* real compute (the default): the forward/backward pass runs for real, and
  ``--slowdown RANK=FACTOR`` then sleeps ``FACTOR - 1`` times as long, so
  that worker is FACTOR times slower;
* the compute-time model (``--compute-time MEAN``): the pass still runs for
  real (the gradients pushed are real), then the worker sleeps until a
  sampled time has passed: ``MEAN x FACTOR x jitter``, with ``jitter`` drawn
  with mean 1 and coefficient of variation ``--jitter-cv`` from the
  ``--jitter`` distribution. Sleeping ranks leave the CPU to the others, so
  dozens of emulated workers behave like a real cluster on a small machine.
  If the real pass takes longer than the sample, no sleep is added.

``--compute-forward SHARE`` spends SHARE of the mean compute time (times the
worker's factor) inside the forward pass instead, layer by layer: before each
module with parameters runs, a sleep of its share by parameter count. The
sleep after the pass makes up the rest of the iteration's sampled time. It
matters where something overlaps the forward pass: partitioned pulls
(``--partition-mb``) start a layer once its own parameters have come, so the
layers' compute hides the pull of the later layers' parameters.

Stragglers that come and go (``--straggler-episodes FACTOR:SECONDS``): one
worker at a time is FACTOR times slower (on top of its ``--slowdown``), and
the role moves to the next worker, round-robin, every SECONDS of the run's
clock, which every rank shares. Over a run every worker is as slow as the
others; at any moment one of them holds the rest up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from hpcps.metrics.timeline import NullTimeline

if TYPE_CHECKING:
    from hpcps.cluster.layout import Layout
    from hpcps.options.config import TrainConfig
    from hpcps.training.flat import FlatParameters

JITTERS = ("none", "uniform", "exponential", "lognormal")
POKE_EVERY = 1e-3  # seconds between pokes of an emulated computation (see emulated_sleep)


def emulated_sleep(seconds: float, poke: Callable[[], object] | None = None) -> None:
    """Sleep ``seconds`` as an accelerator computes, calling ``poke()`` every :data:`POKE_EVERY` seconds.

    A GPU worker's CPU thread is free while the device computes, and frameworks use it to move
    their messages. Over TCP an MPI send moves only while its rank calls into MPI: a push begun
    before the computation would otherwise wait for its end (16 MiB over 1 Gbit/s behind a
    300 ms sleep: 420 ms instead of 134). ``poke`` is the worker's: test its sends, read its notices.
    """
    if poke is None:
        if seconds > 0:
            time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        time.sleep(min(left, POKE_EVERY))
        poke()


def forward_compute(model, seconds: Callable[[], float], sleep: Callable[[float], object],
                    timeline=NullTimeline()) -> list:
    """Install ``--compute-forward``'s hooks (module docstring) on ``model``: before each module with
    parameters, ``sleep(seconds() x its share of the parameters)`` (``seconds()``: the forward pass's whole
    emulated time now; ``timeline``: the sleep is its phase ``emulated``). Returns the hook handles."""
    modules = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    counts = [sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad) for m in modules]
    total = sum(counts)

    def hook_of(fraction: float):
        def before_forward(_module, _args) -> None:
            with timeline.within("emulated"):
                sleep(seconds() * fraction)
        return before_forward

    return [m.register_forward_pre_hook(hook_of(n / total)) for m, n in zip(modules, counts)]


class BackwardCompute:
    """``--compute-backward``'s hooks: a parameter's gradient is ready (the hooks after it run) once its
    share of the backward pass's emulated time (``seconds()``), by parameter count, has passed since
    backward began, counting the parameters in the order backward reaches them. Each hook sleeps until
    that deadline (``sleep(seconds)``), so the sleeps' overshoots do not add up. :meth:`begin` before
    each pass.

    ``lead(backward_s)``, if given, is asked at the first gradient of a pass (``backward_s``: the pass's
    emulated backward time) for seconds to spend before any gradient is ready: the emulated compute that would otherwise come after the pass, when pushes leave
    during backward (:mod:`hpcps.runtime.backward`) and must not overlap compute that comes before
    their gradients in a real pass."""

    def __init__(self, model, seconds: Callable[[], float], sleep: Callable[[float], object],
                 timeline=NullTimeline(), clock: Callable[[], float] = time.perf_counter,
                 lead: Callable[[float], float] | None = None) -> None:
        self.lead = lead
        params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
        self.total = sum(p.numel() for p in params)
        self.seconds, self.sleep, self.timeline, self.clock = seconds, sleep, timeline, clock
        self.started: float | None = None
        self.done = 0  # parameters' values whose gradient backward has produced in this pass
        self.budget = 0.0
        self.handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in params]

    def begin(self) -> None:
        self.started, self.done = None, 0

    def _accumulated(self, param) -> None:
        if self.started is None:  # the pass's first gradient: backward began (its own time is real)
            self.started, self.budget = self.clock(), self.seconds()
            if self.lead is not None:
                self.started += self.lead(self.budget)
        self.done += param.numel()
        left = self.started + self.budget * self.done / self.total - self.clock()
        if left > 0:
            with self.timeline.within("emulated"):
                self.sleep(left)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@dataclass(frozen=True)
class ComputeTime:
    """Target compute time per iteration for one worker."""

    mean: float | None = None
    factor: float = 1.0
    jitter: str = "none"
    cv: float = 0.1
    episodes: tuple[float, float] | None = None  # (FACTOR, SECONDS) of --straggler-episodes
    worker: int = 0  # this worker's index among ...
    n_workers: int = 1  # ... the workers the straggler role rotates over

    def factor_at(self, now: float | None) -> float:
        """How many times slower this worker is at ``now`` (seconds on the run's clock; None: outside the
        run, e.g. the speed warm-up, where episodes do not apply)."""
        if self.episodes is None or now is None:
            return self.factor
        extra, seconds = self.episodes
        straggler = int(now // seconds) % self.n_workers
        return self.factor * (extra if straggler == self.worker else 1.0)

    def jitter_sample(self, rng: np.random.Generator) -> float:
        """A multiplier with mean 1 (and the requested coefficient of variation)."""
        if self.jitter == "none":
            return 1.0
        if self.jitter == "uniform":
            half = self.cv * math.sqrt(3.0)
            return float(rng.uniform(1.0 - half, 1.0 + half))
        if self.jitter == "exponential":
            return float(rng.exponential(1.0))
        sigma = math.sqrt(math.log1p(self.cv ** 2))
        return float(rng.lognormal(-sigma ** 2 / 2.0, sigma))

    def forward_seconds(self, share: float, now: float | None = None) -> float:
        """The emulated time of a forward pass: ``share`` of the mean compute time x the factor at ``now``."""
        return 0.0 if self.mean is None else share * self.mean * self.factor_at(now)

    def target(self, rng: np.random.Generator, now: float | None = None) -> float | None:
        """The compute time of an iteration that begins at ``now``, drawn (None for real compute)."""
        if self.mean is None:
            return None
        return self.mean * self.factor_at(now) * self.jitter_sample(rng)

    def sleep_after(self, real_s: float, rng: np.random.Generator, now: float | None = None,
                    target: float | None = None) -> float:
        """Seconds to sleep after a real pass of ``real_s`` seconds that began at ``now`` (run clock);
        ``target``: the pass's compute time where the caller drew it already (:meth:`target`)."""
        if self.mean is None:
            return (self.factor_at(now) - 1.0) * real_s
        return max(0.0, (self.target(rng, now) if target is None else target) - real_s)


def emulated_compute_time(cfg: "TrainConfig", rank: int, layout: "Layout", index: int | None = None) -> ComputeTime:
    """The emulated compute time of worker ``rank`` (``--compute-time``, its ``--slowdown``, ``--jitter``,
    ``--straggler-episodes``); ``index``: its worker index (a spare's is the dead worker's it replaces)."""
    return ComputeTime(cfg.compute_time, cfg.slowdown.get(rank, 1.0), cfg.jitter, cfg.jitter_cv,
                       episodes=cfg.straggler_episodes, worker=layout.worker_index(rank) if index is None else index,
                       n_workers=layout.n_workers)


@dataclass
class Overruns:
    """How often a worker's real pass outran its emulated compute time (``--compute-time``), leaving no
    sleep to add. Where that is most steps, the emulated time does not hold, nor a factor on it: a
    ``--slowdown`` straggler whose real pass is longer than its target is no slower than the others (seen
    on 2 shared cores, where the real passes of 8 ranks took longer than 50 ms). Pure bookkeeping."""

    steps: int = 0
    over: int = 0
    excess_s: float = 0.0  # summed over the steps that overran: how far

    def add(self, real_s: float, target_s: float) -> None:
        self.steps += 1
        if real_s > target_s:
            self.over += 1
            self.excess_s += real_s - target_s

    def warning(self, rank: int) -> str | None:
        """A line for the log where more than half of at least 10 steps overran, else None."""
        if self.steps < 10 or 2 * self.over <= self.steps:
            return None
        return (f"worker rank {rank}: the real pass outran --compute-time in {self.over} of {self.steps} steps "
                f"(by {1e3 * self.excess_s / self.over:.0f} ms on average): there the emulated compute time, and "
                f"any --slowdown or straggler factor on it, did not hold (raise --compute-time above the real "
                f"pass, or give the ranks more cores)")


def end_pass(flat: "FlatParameters", started: float, compute_time: ComputeTime, rng: np.random.Generator, *,
             clip_norm: float | None = None, now: float | None = None,
             poke: Callable[[], object] | None = None, timeline=None, target: float | None = None,
             overruns: Overruns | None = None) -> float:
    """After backward: the buffers' change into the gradient vector and clipping
    (:meth:`FlatParameters.end_pass`), the device's queued work done, then the emulated compute
    time on top of what the pass took since ``started`` (``now``: the run's clock, for stragglers
    that come and go; ``poke``: called through the emulated part, so messages in flight keep
    moving; ``timeline``: where the emulated part is entered as a phase of its own; ``overruns``:
    counts a pass longer than its emulated time); return the seconds since ``started``."""
    flat.end_pass(clip_norm)
    flat.synchronize()  # a GPU's queued work belongs to this pass's time
    if timeline is not None:
        timeline.enter("emulated")
    real = time.perf_counter() - started
    if compute_time.mean is not None and target is None:  # emulated compute: this pass's time, drawn once
        target = compute_time.target(rng, now)
    if overruns is not None and target is not None:
        overruns.add(real, target)
    emulated_sleep(compute_time.sleep_after(real, rng, now, target=target), poke)
    return time.perf_counter() - started


class EmulatedCompute:
    """One worker's emulated compute over its model (the step API's; :mod:`hpcps.runtime.session`): the hooks
    that spend ``--compute-forward``'s share in the forward pass and ``--compute-backward``'s in backward, and
    the end of each pass padded to the step's compute time (:func:`end_pass`), its jitter drawn from a stream
    of its own (seeded by the run's seed and the rank).

    ``clock()``: the run's clock (stragglers come and go on it); ``poke()``: what a sleep keeps moving (the
    worker's transfers); ``timeline``: where the sleeps' phases go; ``pushes_in_backward``: the worker's push
    may begin before backward (then the emulated time not spent in the passes comes before the first gradient,
    not after the pass, where the push would overlap it); ``spent()``: seconds the pass under way has taken,
    its pull's waits left out; ``armed()``: whether this step's push has begun before backward."""

    def __init__(self, model, cfg: "TrainConfig", compute_time: ComputeTime, rank: int, *, clock: Callable[[], float],
                 poke: Callable[[], object], timeline, pushes_in_backward: bool,
                 spent: Callable[[], float], armed: Callable[[], bool]) -> None:
        self.time, self.clock, self.poke, self.tl = compute_time, clock, poke, timeline
        self.rng = np.random.default_rng([cfg.seed, rank, 7])  # the emulated compute time's jitter
        self.spent, self.armed = spent, armed
        self.target: float | None = None  # the step's emulated compute time, when drawn before the pass ends
        self.overruns = Overruns()  # steps whose real pass outran --compute-time (a warning at the end)
        self.hooks = []
        if cfg.compute_forward:  # after the worker's own hooks: a layer's parameters come before its compute
            self.hooks = forward_compute(model, lambda: compute_time.forward_seconds(cfg.compute_forward, clock()),
                                         lambda seconds: emulated_sleep(seconds, poke), timeline)
        self.backward = None
        # before the backward pushes' hooks (put on at the first push): compute, then send. With pushes during
        # backward, the emulated compute not spent in the forward and backward passes comes before the first
        # gradient, not after the pass, where the push would overlap it
        if cfg.compute_backward or (cfg.compute_time is not None and pushes_in_backward):
            self.backward = BackwardCompute(
                model, lambda: compute_time.forward_seconds(cfg.compute_backward, clock()),
                lambda seconds: emulated_sleep(seconds, poke), timeline, lead=self._lead)

    def begin_pass(self) -> None:
        """A pass begins: nothing drawn yet."""
        if self.backward is not None:
            self.backward.begin()
        self.target = None

    def end_pass(self, flat: "FlatParameters", started: float, clip_norm: float | None) -> float:
        """After backward: :func:`end_pass` with this worker's compute time (the one drawn at the first gradient,
        if it was)."""
        return end_pass(flat, started, self.time, self.rng, clip_norm=clip_norm, now=self.clock(), poke=self.poke,
                        timeline=self.tl, target=self.target, overruns=self.overruns)

    def push_may_begin(self) -> bool:
        """Whether this step's push may leave during backward: not where the emulation would add time after the
        real pass that a push begun in backward would overlap (``--slowdown`` on real compute; emulated compute
        spends it before the first gradient instead, :meth:`_lead`)."""
        return self.time.mean is not None or self.time.factor_at(self.clock()) == 1.0

    def _lead(self, backward_s: float) -> float:
        """At the first gradient of a pass whose push has begun: draw the step's emulated compute time, and
        return what is left of it beyond the time spent so far and the backward pass's ``backward_s``.
        (A BackwardCompute exists only with ``--compute-time``.)"""
        if not self.armed():
            return 0.0
        self.target = self.time.target(self.rng, self.clock())
        return max(0.0, self.target - self.spent() - backward_s)

    def remove(self) -> None:
        """The model leaves the run as it came: without the emulation's hooks."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        if self.backward is not None:
            self.backward.remove()
