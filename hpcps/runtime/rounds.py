"""A BSP round summed as its gradients arrive, in worker order, so a shard holds one sum, not N gradients.

Under BSP a round's update is the weighted mean of every active worker's gradient. Holding
them all until the round closes costs a shard N receive buffers. Instead :class:`RoundSum`
adds each gradient into one accumulator as soon as every lower-numbered worker's gradient of
the round is in, so the float sum runs in worker order whatever the arrival order, and runs
(and resumed runs) stay reproducible bit for bit. A gradient that arrives out of order waits
in its receive buffer; the shard's inbox (``PushInbox(pool=K, reserve=RoundSum.expected)``) keeps
the last of its K buffers for the worker whose turn it is, so the round always moves, and the
other workers' payloads wait at their senders. Memory: the sum and K buffers, for any N.

What is summed: trainable parameters weighted by each push's learning-rate factor ``f``
(``sum f_i g_i``; the shard scales the sum by ``1/(n F)``, F the mean factor, as
:func:`hpcps.training.optim.update_terms` would per gradient), buffers (BatchNorm statistics) plainly
(their mean change is the sum over n). Non-finite gradients are not added, and counted out.
Pure bookkeeping on torch tensors: no MPI.

``ordered=False`` adds each gradient the moment it arrives (hsp): hsp's shard takes its round's
gradients one at a time, in the order the workers became ready, so that its link never waits
for a straggler while others are ready; a worker-order sum would have it wait with its buffers
full, and hsp runs are not bit-for-bit reproducible anyway (its extra gradients land by timing).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class RoundSum:
    """The open round's sum; ``active`` is the policy's live set of active workers (read, not owned).

    ``ordered``: add in worker order (bsp, reproducible) or in arrival order (hsp); ``device``: where the
    sum lives, the shard's slice's (:mod:`hpcps.runtime.residence`).
    """

    def __init__(self, size: int, n_params: int, n_workers: int, active: set[int], *, ordered: bool = True,
                 device: torch.device | str = "cpu") -> None:
        self.acc = torch.zeros(size, dtype=torch.float32, device=device)
        self.n_params, self.n_workers, self.active, self.ordered = n_params, n_workers, active, ordered
        self.arrived: dict[int, None] = {}  # the round's gradients in hand, in arrival order
        self.finite: dict[int, bool] = {}  # summed this round: whether the gradient was added
        self.done: list[tuple[int, int]] = []  # ranges summed over the whole round already (complete())
        self._next = 0
        self.closed = 0  # rounds applied in this run

    def arrive(self, worker: int) -> None:
        """``worker``'s gradient of this round is in hand."""
        self.arrived[worker] = None

    def expected(self) -> int | None:
        """``ordered``: the worker whose gradient is to be added next (None: the round has nobody
        left to add)."""
        while self._next < self.n_workers and (self._next in self.finite or (
                self._next not in self.active and self._next not in self.arrived)):
            self._next += 1
        return self._next if self._next < self.n_workers else None

    def add_ready(self, take: Callable[[int], tuple[torch.Tensor | None, float]]) -> list[int]:
        """Add every arrived gradient whose turn has come; return those workers (their buffers are free).

        ``take(worker)`` gives its gradient (None if non-finite: not added) and learning-rate factor.
        """
        if self.ordered:
            done = []
            while (w := self.expected()) is not None and w in self.arrived:
                self._add(w, take)
                done.append(w)
            return done
        done = [w for w in self.arrived if w not in self.finite]
        for w in done:
            self._add(w, take)
        return done

    def complete(self, lo: int, hi: int, adds: Sequence[tuple[int, torch.Tensor, float]]) -> None:
        """Sum ``[lo, hi)`` over the round's workers now (``adds``: each one's ``(worker, gradient, factor)``,
        in worker order, every one finite), ahead of their whole gradients (:mod:`hpcps.runtime.release`):
        those not added whole yet are added there in worker order, and their whole adds later leave it
        alone, so each value's sum runs in worker order as the whole round's does."""
        for w, grad, factor in adds:
            if w not in self.finite:
                self._add_range(grad, factor, lo, hi)
        self.done.append((lo, hi))

    def _add(self, w: int, take: Callable[[int], tuple[torch.Tensor | None, float]]) -> None:
        grad, factor = take(w)
        if grad is not None:
            for lo, hi in self._open():
                self._add_range(grad, factor, lo, hi)
        self.finite[w] = grad is not None

    def _add_range(self, grad: torch.Tensor, factor: float, lo: int, hi: int) -> None:
        """``acc[lo:hi] += grad[lo:hi]``, its trainable values times ``factor``."""
        p = self.n_params
        if lo < p:
            self.acc[lo:min(hi, p)].add_(grad[lo:min(hi, p)], alpha=factor)
        if hi > p:
            self.acc[max(lo, p):hi].add_(grad[max(lo, p):hi])

    def _open(self) -> list[tuple[int, int]]:
        """The ranges of the sum no :meth:`complete` has closed this round."""
        out, at = [], 0
        for lo, hi in sorted(self.done):
            if lo > at:
                out.append((at, lo))
            at = max(at, hi)
        size = len(self.acc)
        return out + [(at, size)] if at < size else out

    def close(self) -> None:
        """The round was applied: start the next from zero."""
        self.closed += 1
        self.acc.zero_()
        self.arrived.clear()
        self.finite.clear()
        self.done.clear()
        self._next = 0
