"""The classic paradigms: BSP, ASP and SSP (Ho et al. 2013).

All three track a *clock* per worker (gradients pushed). They differ in
when a gradient is applied and when a worker may go on:

* ``bsp``: gradients of a round are held until every active worker has
  pushed, then applied as one averaged update; everyone is released together,
  so every gradient is computed on the version it is applied to.
* ``asp``: every gradient is applied on arrival and its worker released at
  once; no worker ever waits for another.
* ``ssp``: as asp, but a worker is released only while its clock is at most
  ``s`` ahead of the slowest active worker.
"""

from __future__ import annotations

from hpcps.policies.base import Decision, Policy
from hpcps.policies.registry import register


@register
class BSP(Policy):
    name = "bsp"
    summary = "bulk synchronous: average all N gradients of a round, release everyone"

    def __init__(self, n_workers: int, **options) -> None:
        super().__init__(n_workers)
        self.round: list[int] = []

    @classmethod
    def updates_per_step(cls, n_clients: int) -> int:
        return 1  # one averaged update per round

    def threshold(self, worker: int) -> int:
        return 0

    def on_push(self, worker: int, clock: int, version: int, now: float) -> Decision:
        self.round.append(worker)
        return self._close_round()

    def on_leave(self, worker: int, now: float) -> Decision:
        super().on_leave(worker, now)
        return self._close_round()

    def _close_round(self) -> Decision:
        if not self.round or not self.active.issubset(self.round):
            return Decision()
        # in worker order, not arrival order: the float sum is then the same in every run,
        # which makes BSP runs (and resumed runs) bit-for-bit reproducible
        done, self.round = tuple(sorted(self.round)), []
        return Decision(updates=(done,), grants=done)


@register
class SSP(Policy):
    name = "ssp"
    summary = "stale synchronous: apply on arrival, bound the clock gap by --staleness s"

    def __init__(self, n_workers: int, *, staleness: int = 0, staleness_max: int | None = None) -> None:
        if staleness < 0:
            raise ValueError("staleness must be >= 0")
        super().__init__(n_workers, staleness=staleness, staleness_max=staleness_max)
        self.clocks = [0] * n_workers
        self.waiting: set[int] = set()

    def threshold(self, worker: int) -> int:
        return self.staleness

    def slowest_clock(self) -> int | None:
        """Clock of the slowest active worker (None when all have left)."""
        return min((self.clocks[w] for w in self.active), default=None)

    def on_push(self, worker: int, clock: int, version: int, now: float) -> Decision:
        self.clocks[worker] = clock
        self.waiting.add(worker)
        return Decision(updates=((worker,),), grants=self._release())

    def on_leave(self, worker: int, now: float) -> Decision:
        super().on_leave(worker, now)
        self.waiting.discard(worker)
        return Decision(grants=self._release())

    def may_go_on(self, worker: int, floor: int) -> bool:
        """Whether ``worker`` may start its next iteration, the slowest being at clock ``floor``."""
        return self.clocks[worker] - floor <= self.staleness

    def _release(self) -> tuple[int, ...]:
        floor = self.slowest_clock()
        ready = tuple(sorted(w for w in self.waiting if floor is None or self.may_go_on(w, floor)))
        self.waiting.difference_update(ready)
        return ready


@register
class ASP(Policy):
    name = "asp"
    summary = "asynchronous: apply every gradient on arrival, never wait for others"
    worker_blocks = False

    def on_push(self, worker: int, clock: int, version: int, now: float) -> Decision:
        return Decision(updates=((worker,),), grants=(worker,))
