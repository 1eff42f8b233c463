"""A bsp round released a piece at a time, from the last worker's verdict on (``--pull send``).

A shard that sends its rounds (:mod:`hpcps.transport.sent`) used to step its whole slice, publish and send
once the round's last piece was in: layer 2's gradient, the last a backward pass makes, from the last
worker. But by the time every worker has said its gradient is finite (its verdict, sent as its backward pass
ends), most pieces of every worker's gradient are in hand. From that moment each piece whose gradients are
all in is summed, stepped and sent on its own, and the rest as they land: the header first (the version
the round makes, and the stop flag its publish will raise), then each piece's values, in the slice's order,
so the next forward pass finds its first layers where it looks for them first. The worker waits for the
header, not the grant, which queues behind the values (:meth:`hpcps.transport.sent.SentPull.announced`).

Not before the verdicts: a piece stepped before its worker's verdict could apply part of a gradient later
found non-finite, and values sent during backward share the links with the pushes still under way, which
the round waits for (a throwaway build measured 8-10% slower steps, docs/results.md). A round with a
non-finite or skipped gradient, new hyperparameters or a worker without a verdict goes whole, as before.

Bit for bit the round at once: each piece is summed over the workers in worker order
(:meth:`hpcps.runtime.rounds.RoundSum.complete`) and stepped by the optimizer chunk by chunk, its chunks
cut at the pieces on the :data:`~hpcps.cluster.slices.ALIGN` grid
(:meth:`hpcps.training.optim.ShardOptimizer.step_range`).

:class:`Verdicts` receives the verdicts as the pushes are taken up; :class:`PieceRelease` is what one shard
keeps of its round; :class:`_Release` is the shard's side (a mixin of
:class:`~hpcps.runtime.server.ShardServer`, whose attributes it reads and changes).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from mpi4py import MPI

from hpcps.transport import wire

#: push flags under which a round goes whole (an hsp extra, a skipped or non-finite gradient, new hyperparameters)
WHOLE_FLAGS = wire.EXTRA | wire.SKIP | wire.NONFINITE | wire.HYPER


class Verdicts:
    """The workers' verdicts on their gradients, received as soon as their pushes are taken up (not after
    their payloads, as :func:`hpcps.runtime.server.received_verdict` would): a receive per push under way."""

    def __init__(self, inbox) -> None:
        self.inbox = inbox
        self.posted: dict[int, tuple[MPI.Request, np.ndarray]] = {}
        self.heard: dict[int, bool] = {}

    def watch(self, unsummed: Callable[[int], bool]) -> None:
        """Post the verdict receive of every push whose header is in hand and which is not summed yet
        (``unsummed(worker)``; a summed one's verdict was received when it was summed)."""
        inbox = self.inbox
        for w in range(len(inbox.worker_ranks)):
            header = inbox.headers[w]
            if (w not in self.posted and w not in inbox.listening and header[0] == wire.KIND_PUSH
                    and header[5] & wire.VERDICT and unsummed(w)):
                verdict = np.empty(1, np.int64)
                self.posted[w] = (inbox.comm.Irecv(verdict, source=inbox.worker_ranks[w], tag=wire.TAG_VERDICT),
                                  verdict)

    def finite(self, worker: int) -> bool | None:
        """``worker``'s verdict if it came (None: not yet, or not posted here)."""
        if worker not in self.heard and worker in self.posted and self.posted[worker][0].Test():
            self.heard[worker] = bool(self.posted[worker][1][0])
        return self.heard.get(worker)

    def take(self, worker: int) -> tuple[MPI.Request, np.ndarray] | None:
        """The posted receive of ``worker``'s verdict, handed over (the server waits on it), or None."""
        self.heard.pop(worker, None)
        return self.posted.pop(worker, None)


class PieceRelease:
    """What one shard keeps of the round it releases a piece at a time: its pieces (``ranges``: ``(lo, hi)``
    of the slice, in its order; ``order[k]``: range ``k``'s place among the inbox's pieces, the order the
    workers send them), which are out, the round's workers and their learning-rate factors."""

    def __init__(self, inbox, ranges: Sequence[tuple[int, int]]) -> None:
        self.ranges = [tuple(r) for r in ranges]
        pieces = [tuple(p) for p in inbox.pieces]
        if sorted(pieces) != sorted(self.ranges):
            raise ValueError(f"the inbox's pieces {pieces} are not the slice's ranges {self.ranges}")
        self.order = [pieces.index(r) for r in self.ranges]
        self.verdicts = Verdicts(inbox)
        self.out = [False] * len(self.ranges)
        self.workers: list[int] = []  # the round's, in worker order, once begun
        self.factors: list[float] = []
        self.mean = 1.0  # the factors' mean: the optimizer's step is scaled by it
        self.began = False
        self.whole = False  # this round goes whole (a flag, a non-finite verdict)

    def reset(self) -> None:
        """The round closed."""
        self.out = [False] * len(self.ranges)
        self.workers, self.factors, self.mean, self.began, self.whole = [], [], 1.0, False, False


class _Release:
    """A shard's side of a round released a piece at a time (a mixin of
    :class:`~hpcps.runtime.server.ShardServer`): :meth:`_release_pieces` from its loop, :meth:`_released`
    at the round's close."""

    def _release_pieces(self, closing: bool = False) -> bool:
        """Begin the round's release at the last verdict, and release each piece whose gradients are all
        in (``closing``: every one left, the round's gradients all whole). Returns whether the round is
        released (begun)."""
        r = self.release
        if r is None:
            return False
        r.verdicts.watch(lambda w: w not in self.round_sum.finite)
        if not r.began and (closing or not self._begin_release(r)):
            return False
        for k, (lo, hi) in enumerate(r.ranges):
            if not r.out[k] and (closing or self._piece_in(r, k)):
                self._release_piece(r, lo, hi)
                r.out[k] = True
        return True

    def _begin_release(self, r: PieceRelease) -> bool:
        """Whether every active worker's push of the round is taken up with a finite verdict: then the
        optimizer's update begins and the header goes out."""
        if r.whole:
            return False
        inbox, workers = self.inbox, sorted(self.policy.active)
        for w in workers:
            header = inbox.headers[w]
            if w in inbox.listening or header[0] != wire.KIND_PUSH:
                return False  # not pushed yet (or leaving)
            if header[5] & WHOLE_FLAGS or not header[5] & wire.VERDICT:
                r.whole = True
                return False
            finite = self.round_sum.finite[w] if w in self.round_sum.finite else r.verdicts.finite(w)
            if finite is None:
                return False
            if not finite:
                r.whole = True
                return False
        r.workers = workers
        r.factors = [wire.decode_lr(inbox.headers[w]) / self.unit_lr for w in workers]
        r.mean = sum(r.factors) / len(r.factors)
        r.began = True
        self.hypers.use(workers, self.optimizer, self._hyper_rows)
        self.optimizer.begin(version=self.position(), factor=r.mean)
        self.sender.announce(workers, self.version + 1, self.window.stop_once_published(), self.backoff)
        return True

    def _piece_in(self, r: PieceRelease, k: int) -> bool:
        """Whether piece ``k`` of every round worker's gradient is in hand."""
        j = r.order[k]
        for w in r.workers:
            if w in self.pending:
                continue  # whole
            receives = self.inbox.receiving.get(w)
            if receives is None or not receives[j].Test():
                return False
        return True

    def _release_piece(self, r: PieceRelease, lo: int, hi: int) -> None:
        """Sum, step and send ``[lo, hi)`` of the slice."""
        self.tl.enter("step")
        rounds, p = self.round_sum, self.n_params
        rounds.complete(lo, hi, [(w, self._gradient(w), f)  # (the others: summed whole)
                                 for w, f in zip(r.workers, r.factors) if w not in rounds.finite])
        n = len(r.workers)
        if lo < p:
            self.optimizer.step_range(rounds.acc, 1.0 / (n * r.mean), lo, min(hi, p), progress=self.progress)
        if hi > p:  # buffers: their mean change
            a = max(lo, p)
            self.master_t[a:hi].add_(rounds.acc[a:hi], alpha=1.0 / n)
        self.tl.enter("notify")  # (the values' sends, as a round's at once)
        self.sender.send_range(lo, hi, self.master)
        self.tl.enter("other")

    def _released(self, workers: Sequence[int]) -> bool:
        """At the round's close: whether it was released a piece at a time (then the pieces left go now, and
        the optimizer's update ends); it must have been released to exactly ``workers``."""
        r = self.release
        if r is None or not r.began:
            if r is not None:
                r.reset()  # (the next round tries again)
            return False
        if sorted(workers) != r.workers:
            raise RuntimeError(f"shard {self.shard}: the round released to workers {r.workers} closed on "
                               f"{sorted(workers)}; a paradigm that decides otherwise than bsp sets "
                               "releases_pieces = False")
        self._release_pieces(closing=True)
        self.optimizer.end()
        r.reset()
        return True
