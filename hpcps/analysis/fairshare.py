"""One direction of a network link shared by transfers: max-min fair, each transfer capped by its own rate.

Pure (no MPI, no time of its own): :mod:`hpcps.analysis.simulate` drives it with event times. A server's
link carries every worker's push (or pull) at once; each transfer also passes through its worker's
own link, which caps it. Max-min fairness (water-filling) is what TCP flows sharing a bottleneck
approach: the link's capacity is split equally, and what a capped transfer cannot use goes to the
others. An infinite capacity leaves every transfer at its own cap.
"""

from __future__ import annotations

import math


class FairLink:
    """Transfers in flight on one link direction of ``capacity`` bytes/s (``math.inf``: unshared)."""

    __slots__ = ("capacity", "flows", "t", "generation")

    def __init__(self, capacity: float = math.inf) -> None:
        if not capacity > 0:
            raise ValueError("a link's capacity must be above 0")
        self.capacity = capacity
        self.flows: dict = {}  # key -> [bytes remaining, cap in bytes/s]
        self.t = 0.0
        self.generation = 0  # changes whenever the set of transfers does: completion times computed before are stale

    def rates(self) -> dict:
        """Each transfer's rate now: water-filling of the capacity over the caps, smallest cap first."""
        left, rates = self.capacity, {}
        order = sorted(self.flows, key=lambda k: self.flows[k][1])
        for i, key in enumerate(order):
            share = left / (len(order) - i)
            rates[key] = min(self.flows[key][1], share)
            left -= rates[key]
        return rates

    def _drain(self, t: float) -> None:
        if t < self.t:
            raise ValueError("time went backwards on a link")
        for key, rate in self.rates().items():
            self.flows[key][0] = max(0.0, self.flows[key][0] - rate * (t - self.t))
        self.t = t

    def add(self, t: float, key, nbytes: float, cap: float) -> None:
        """Start transferring ``nbytes`` at ``t``, at most ``cap`` bytes/s."""
        if key in self.flows:
            raise ValueError(f"transfer {key!r} is already on this link")
        self._drain(t)
        self.flows[key] = [float(nbytes), float(cap)]
        self.generation += 1

    def next_done(self) -> tuple[float, object] | None:
        """(time, key) of the transfer that completes first if nothing changes, or None when idle."""
        rates = self.rates()
        return min(((self.t + f[0] / rates[k], k) for k, f in self.flows.items()), default=None,
                   key=lambda x: x[0])

    def finish(self, t: float, key) -> None:
        """Take transfer ``key`` (completed at ``t``) off the link."""
        self._drain(t)
        del self.flows[key]
        self.generation += 1
