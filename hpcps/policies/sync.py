"""The classic paradigms: BSP, ASP and SSP (Ho et al. 2013).

All three track a *clock* per worker (gradients pushed). They differ in
when a gradient is applied and when a worker may go on:

* ``bsp``: gradients of a round are held until every active worker has
  pushed, then applied as one averaged update; everyone is released together,
  so every gradient is computed on the version it is applied to.
* ``asp``: every gradient is applied on arrival and its worker released at
  once; no worker ever waits for another. A worker pulls once its own
  gradient is in (its grant comes with the update), so it always computes
  on parameters that hold its last gradient: SSP's read-my-writes (Ho et
  al. 2013), ASP as SSP's limit of an unbounded lead.
* ``ssp``: as asp, but a worker is released only while its clock is at most
  ``s`` ahead of the slowest active worker.


Every event costs O(log N) at most, whatever the worker count: BSP counts
the active workers of the open round instead of comparing sets, and SSP
keeps the workers' clocks and its waiting workers in heaps (stale entries
are skipped when they surface), instead of scanning all N per push
(``tools/bench_policies.py`` measures it).
"""

from __future__ import annotations

import heapq

from hpcps.policies.base import Decision, Policy
from hpcps.policies.registry import register


@register
class BSP(Policy):
    name = "bsp"
    summary = "bulk synchronous: average all N gradients of a round, release everyone"
    holds_rounds = True
    #: under --pull send a shard may step and send a round a piece at a time from its last verdict on
    #: (hpcps.runtime.release): every round applies every active worker's gradient at weight 1; a plug-in
    #: built on bsp that decides otherwise sets it False
    releases_pieces = True

    def __init__(self, n_workers: int, **options) -> None:
        super().__init__(n_workers)
        self.round: list[int] = []
        self._in_round: set[int] = set()
        self._active_in_round = 0  # the round closes when this reaches len(self.active)

    @classmethod
    def updates_per_step(cls, n_clients: int) -> int:
        return 1  # one averaged update per round

    @classmethod
    def releases_rounds(cls) -> bool:
        """bsp and its presets do (hsp, a subclass, also pulls between a round's extra gradients and
        transfers serially; a subclass with group servers pulls from those: those do not). Its workers must
        wait for their grant and pull after it (``worker_blocks``, no ``eager_pull``): only such a worker
        posts the receives of a sent round, and a shard's sends to one that never does would wait for ever."""
        return cls.worker_blocks and not (cls.eager_pull or cls.extra_gradients or cls.serial_transfers
                                          or cls.uses_groups)

    def threshold(self, worker: int) -> int:
        return 0

    def on_push(self, worker: int, clock: int, version: int, now: float) -> Decision:
        self.round.append(worker)
        self._in_round.add(worker)
        self._active_in_round += worker in self.active
        return self._close_round()

    def on_leave(self, worker: int, now: float) -> Decision:
        if worker in self.active and worker in self._in_round:
            self._active_in_round -= 1
        super().on_leave(worker, now)
        return self._close_round()

    def _close_round(self) -> Decision:
        if not self.round or self._active_in_round < len(self.active):
            return Decision()
        # in worker order, not arrival order: the float sum is then the same in every run,
        # which makes BSP runs (and resumed runs) bit-for-bit reproducible
        done, self.round, self._in_round, self._active_in_round = tuple(sorted(self.round)), [], set(), 0
        return Decision(updates=(done,), grants=done)


@register
class SSP(Policy):
    name = "ssp"
    summary = "stale synchronous: apply on arrival, bound the clock gap by --staleness s"
    applies_on_arrival = True
    takes_spares = True
    reads = frozenset({"staleness"})

    def __init__(self, n_workers: int, *, staleness: int = 0, staleness_max: int | None = None) -> None:
        if staleness < 0:
            raise ValueError("staleness must be >= 0")
        super().__init__(n_workers, staleness=staleness, staleness_max=staleness_max)
        self.clocks = [0] * n_workers
        self.waiting: set[int] = set()
        self._by_clock = [(0, 0.0, w) for w in range(n_workers)]  # (clock, tie-break, worker), lazily cleaned
        self._by_key: list[tuple[int, int]] = []  # waiting workers by clock - threshold, lazily cleaned
        self._heaped = [0] * n_workers  # the clock of each worker's newest entry in _by_clock

    def threshold(self, worker: int) -> int:
        return self.staleness

    def state_dict(self) -> dict:
        """The workers' clocks: a resumed run's bound counts from where they are, not from zero (with
        zeros, every worker waited for every other's first push, and the floor was wrong until then)."""
        return {"clocks": list(self.clocks)}

    def load_state_dict(self, state: dict) -> None:
        for worker, clock in enumerate(state.get("clocks", ())[:self.n_workers]):
            self._set_clock(worker, int(clock))

    def _tie_break(self, worker: int) -> float:
        """Among workers at the slowest clock, the smallest of these is the slowest (DSSP: push time)."""
        return 0.0

    def slowest(self) -> int | None:
        """The slowest active worker (None when all have left): O(log N) amortized."""
        heap = self._by_clock
        while heap:
            clock, _, w = heap[0]
            if w in self.active and self.clocks[w] == clock:
                return w
            heapq.heappop(heap)  # an older clock of its worker, or a worker that left
        return None

    def slowest_clock(self) -> int | None:
        """Clock of the slowest active worker (None when all have left)."""
        w = self.slowest()
        return None if w is None else self.clocks[w]

    def _set_clock(self, worker: int, clock: int) -> None:
        """``worker`` pushed gradient ``clock``: its clock, and its entry in the clock heap (once)."""
        if self.clocks[worker] != clock or self._heaped[worker] != clock:
            self.clocks[worker] = self._heaped[worker] = clock
            heapq.heappush(self._by_clock, (clock, self._tie_break(worker), worker))

    def on_push(self, worker: int, clock: int, version: int, now: float) -> Decision:
        self._set_clock(worker, clock)
        self.waiting.add(worker)
        heapq.heappush(self._by_key, (clock - self.threshold(worker), worker))
        return Decision(updates=((worker,),), grants=self._release())

    def on_leave(self, worker: int, now: float) -> Decision:
        super().on_leave(worker, now)
        self.waiting.discard(worker)
        return Decision(grants=self._release())

    def on_join(self, worker: int, now: float) -> Decision:
        """The newcomer counts in the bound at the dead worker's clock: it may be the slowest again, and the
        others wait for it as they waited for the dead one (its heap entry was dropped when it left)."""
        super().on_join(worker, now)
        heapq.heappush(self._by_clock, (self.clocks[worker], self._tie_break(worker), worker))
        self._heaped[worker] = self.clocks[worker]
        return Decision()

    def may_go_on(self, worker: int, floor: int) -> bool:
        """Whether ``worker`` may start its next iteration, the slowest being at clock ``floor``
        (``clock - threshold <= floor``: the key the waiting heap is ordered by)."""
        return self.clocks[worker] - self.threshold(worker) <= floor

    def _release(self) -> tuple[int, ...]:
        """The waiting workers within their bound of the slowest, in worker order."""
        floor = self.slowest_clock()
        ready, heap = [], self._by_key
        while heap and (floor is None or heap[0][0] <= floor):
            _, w = heapq.heappop(heap)
            if w in self.waiting:  # else granted already, or left
                self.waiting.discard(w)
                ready.append(w)
        return tuple(sorted(ready))


@register
class ASP(Policy):
    name = "asp"
    summary = "asynchronous: apply every gradient on arrival, never wait for others"
    # A worker waits for its own gradient's update before it pulls (read-my-writes), not for any other
    # worker. Pulling as it pushed, it computed on parameters without its last gradient: the staleness of
    # its gradients rose from ~2 to ~6 updates with 4 workers, and at bsp's settings on MNIST-1D's 1-D CNN
    # asp ended at 0.45-0.80 where bsp reached 0.89-0.92 (0.90-0.92 reading its writes; docs/results.md).
    worker_blocks = True
    applies_on_arrival = True
    takes_spares = True

    def on_push(self, worker: int, clock: int, version: int, now: float) -> Decision:
        return Decision(updates=((worker,),), grants=(worker,))
