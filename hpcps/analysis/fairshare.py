"""Links shared by transfers, max-min fair, each transfer capped by its own rate and crossing a path of
links (:class:`FairNetwork`).

Pure (no MPI, no time of its own): the simulators drive it with event times. In the one-server model
(:mod:`hpcps.analysis.simulate`) a server's link carries every worker's push (or pull) at once, and each
transfer's cap is its worker's own link; in the model of a shard per node
(:mod:`hpcps.analysis.simulate_shards`) a transfer between nodes crosses the sender's link up and the
receiver's link down. Max-min fairness (water-filling) is what TCP flows sharing a bottleneck
approach: the link's capacity is split equally, and what a capped transfer cannot use goes to the
others. An infinite capacity leaves every transfer at its own cap.
"""

from __future__ import annotations

import math


class FairNetwork:
    """Transfers in flight over several links, each crossing some of them (a path): max-min fair over all.

    ``capacities``: link key -> bytes/s (``math.inf``: unshared). A transfer between two nodes crosses
    the sender's link up and the receiver's link down, and gets the rate progressive filling gives it
    (the network-wide max-min fair share, each transfer also capped by its own rate). A transfer whose path
    is empty (within a node) runs at its cap. Its cap may change while it runs (:meth:`set_cap`).
    """

    __slots__ = ("capacity", "flows", "t", "generation")

    def __init__(self, capacities: dict) -> None:
        if not all(c > 0 for c in capacities.values()):
            raise ValueError("a link's capacity must be above 0")
        self.capacity = dict(capacities)
        self.flows: dict = {}  # key -> [bytes remaining, cap in bytes/s, path: link keys]
        self.t = 0.0
        self.generation = 0

    def rates(self) -> dict:
        """Each transfer's rate now: raise every unsettled rate together until a link fills or a cap is
        reached, settle the transfers held there, and go on with the others."""
        left = dict(self.capacity)
        active, rates = set(self.flows), {}
        while active:
            crossing: dict = {}
            for key in active:
                for link in self.flows[key][2]:
                    crossing.setdefault(link, []).append(key)
            share = min([left[link] / len(keys) for link, keys in crossing.items()]
                        + [self.flows[key][1] for key in active])
            settled = {key for key in active if self.flows[key][1] <= share * (1 + 1e-12)}
            for link, keys in crossing.items():
                if left[link] / len(keys) <= share * (1 + 1e-12):
                    settled.update(keys)
            for key in settled:
                rates[key] = min(share, self.flows[key][1])
                for link in self.flows[key][2]:
                    left[link] = max(0.0, left[link] - rates[key])
            active -= settled
        return rates

    def _drain(self, t: float) -> None:
        if t < self.t:
            raise ValueError("time went backwards on a network")
        if t > self.t:
            for key, rate in self.rates().items():
                self.flows[key][0] = max(0.0, self.flows[key][0] - rate * (t - self.t))
        self.t = t

    def add(self, t: float, key, nbytes: float, path: tuple = (), cap: float = math.inf) -> None:
        """Start transferring ``nbytes`` at ``t`` over the links of ``path``, at most ``cap`` bytes/s."""
        if key in self.flows:
            raise ValueError(f"transfer {key!r} is already on the network")
        if not cap > 0:
            raise ValueError("a transfer's cap must be above 0")
        self._drain(t)
        self.flows[key] = [float(nbytes), float(cap), tuple(path)]
        self.generation += 1

    def set_cap(self, t: float, key, cap: float) -> None:
        """From ``t`` on, transfer ``key`` runs at most at ``cap`` bytes/s (a sender that feeds it as it goes)."""
        self._drain(t)
        self.flows[key][1] = float(cap)
        self.generation += 1

    def next_done(self) -> tuple[float, object] | None:
        """(time, key) of the transfer that completes first if nothing changes, or None when idle."""
        rates = self.rates()
        return min(((self.t + (f[0] / rates[k] if f[0] > 0 else 0.0), k) for k, f in self.flows.items()),
                   default=None, key=lambda x: x[0])

    def finish(self, t: float, key) -> None:
        """Take transfer ``key`` (completed at ``t``) off the network."""
        self._drain(t)
        del self.flows[key]
        self.generation += 1
