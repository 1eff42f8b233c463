"""The simulators' clock: a discrete-event simulation's events, taken in time order (pure).

Both models of a job (:mod:`hpcps.analysis.simulate`, :mod:`hpcps.analysis.simulate_shards`) run on it, so
they break ties the same way: at one instant, the kinds named ``first`` come before the others, and
otherwise events come in the order they were put in (deterministic: no comparison of their payloads).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterable


class Events:
    """A queue of ``(time, kind, *payload)`` events. ``first``: kinds that come before the others at the same
    instant: a grant, or a worker's leave, comes out of a decision that ended then, and what arrives at that
    instant must see its outcome."""

    def __init__(self, first: Iterable[str] = ()) -> None:
        self.first = frozenset(first)
        self._heap: list[tuple] = []
        self._tick = itertools.count()

    def at(self, t: float, kind: str, *payload) -> None:
        """``kind`` happens at ``t``, with ``payload``."""
        heapq.heappush(self._heap, (t, kind not in self.first, next(self._tick), kind, payload))

    def pop(self) -> tuple:
        """The next event, as ``(time, kind, *payload)``."""
        t, _, _, kind, payload = heapq.heappop(self._heap)
        return (t, kind, *payload)

    def __bool__(self) -> bool:
        return bool(self._heap)
