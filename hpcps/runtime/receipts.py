"""What a worker learns from its notices (:mod:`hpcps.transport.notices`): each shard's grants, the newest
version it knows each shard is past, and each push's receipts, which complete the push's row.

An iteration's row goes to the metrics once every shard's receipt is in: its staleness is the largest any
shard applied it at (-1 where a shard dropped it), its rate the one shard 0 applied it at (NaN where it was
never applied). A gradient applied at version ``v`` means the shard is past ``v``: receipts raise what the
worker knows, as pulls do.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import numpy as np

from hpcps.transport import wire
from hpcps.transport.notices import Notice


class Receipts:
    """One worker's book of ``n_shards`` shards' notices, from gradient ``start_step`` on (a resumed run's:
    those before were pushed and granted)."""

    def __init__(self, n_shards: int, start_step: int = 0) -> None:
        self.grants = np.full(n_shards, start_step, np.int64)  # each shard's grants so far
        self.known = np.zeros(n_shards, np.int64)  # newest version seen, per shard
        self.receipts: dict[int, list[tuple[int, bool, int, float]]] = {}  # by clock: (staleness, dropped, shard, lr)
        self.rows: dict[int, dict] = {}  # pushes' rows waiting for their receipts, by clock

    def seen(self, versions: np.ndarray) -> None:
        """Shard versions observed somewhere (a pull, a peek): raise what the worker knows."""
        np.maximum(self.known, versions, out=self.known)

    def lag(self, versions: np.ndarray) -> int:
        """How far ``versions`` are behind the newest the worker knows of (largest over shards)."""
        return int((self.known - versions).max())

    def granted(self, clock: int) -> bool:
        """Whether every shard has granted gradient ``clock``."""
        return self.grants.min() >= clock

    def take(self, notes: Iterable[Notice], transfer: Callable[[int], object]) -> list[dict]:
        """Take notices in: grants and receipts counted, ``transfer(shard)`` for each shard that gives this
        worker its turn to stream (hsp); the rows every shard's receipt has now completed."""
        for note in notes:
            if note.flags & wire.TRANSFER:
                transfer(note.shard)
            if note.flags & wire.GRANT:
                self.grants[note.shard] += 1
            if note.flags & wire.RECEIPT:
                self.receipts.setdefault(note.clock, []).append((note.staleness, bool(note.flags & wire.DROPPED),
                                                                 note.shard, note.lr))
                if not note.flags & wire.DROPPED:
                    self.known[note.shard] = max(self.known[note.shard], note.version + 1)
        done = []
        for clock in [c for c, got in self.receipts.items() if len(got) == len(self.grants) and c in self.rows]:
            got = self.receipts.pop(clock)
            row = self.rows.pop(clock)
            dropped = any(d for _, d, _, _ in got)
            row["staleness"] = -1 if dropped else max(s for s, _, _, _ in got)
            # the rate shard 0 applied it at, as its receipt says (NaN for a gradient never applied)
            row["lr"] = math.nan if dropped else min(got, key=lambda r: r[2])[3]
            done.append(row)
        return done
