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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

JITTERS = ("none", "uniform", "exponential", "lognormal")


@dataclass(frozen=True)
class ComputeTime:
    """Target compute time per iteration for one worker."""

    mean: float | None = None
    factor: float = 1.0
    jitter: str = "none"
    cv: float = 0.1

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

    def sleep_after(self, real_s: float, rng: np.random.Generator) -> float:
        """Seconds to sleep after a real pass of ``real_s`` seconds."""
        if self.mean is None:
            return (self.factor - 1.0) * real_s
        return max(0.0, self.mean * self.factor * self.jitter_sample(rng) - real_s)
