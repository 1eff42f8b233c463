"""Pushes during backward: each piece of the gradient leaves as soon as backward has produced it.

With ``--partition-mb`` a shard's slice is a few pieces (:mod:`hpcps.cluster.slices`), and a push sends
each as a message of its own, the last layers' first (:meth:`~hpcps.cluster.slices.Slices.send_order`).
Backward produces the last layers' gradients first, so in hpcps's own loop the worker need not wait
for the whole pass: it sends the push's headers before backward begins, and a hook after each parameter's
gradient is accumulated sends every piece that is then complete, in its shard's order. The link carries
the gradient while backward computes the rest, as P3 and ByteScheduler do; what is left (the pieces of
parameters backward did not reach, the BatchNorm statistics' change, known only after the pass) goes
when the pass ends.

Each piece is checked for non-finite values as it is copied to the wire (:attr:`BackwardPushes.finite`), so
the push's verdict is ready when the pass ends: a scan of the whole gradient after backward (about 1 ms for
4.8 MB on a shared core) sat between the pass's end and the verdict every shard waits for to close its round.

Only where nothing changes a gradient after backward and the push's header is known before it: hpcps's
own loop (a user's loop may accumulate several backward passes or scale and clip them), paradigms that
wait for their grant (the pull follows the push; asp's would queue behind it over TCP), pushes not
encoded (``--compress``) nor clipped (``--clip-norm`` needs the whole gradient), a step with no
``--fault``, CPU workers (the gradient is the flat buffer, read in place).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from hpcps.transport.compress import all_finite


class BackwardPushes:
    """A worker's pushes during backward. ``order[s]``: shard ``s``'s ranges in send order, ``(local, lo,
    hi)`` (:meth:`~hpcps.cluster.slices.Slices.send_order`); ``bases[s]``: where shard ``s``'s part of a
    push buffer begins; ``n_params``: trainable values (a range beyond is buffers, sent at the end);
    ``send(slot, shard, k)``: start piece ``k`` of ``shard`` from ``slot``'s buffer (the pusher's);
    ``overflow``: where a finite value becomes infinite on the wire (the worker's verdict's bound)."""

    def __init__(self, model: torch.nn.Module, spans, order: list[list[tuple[int, int, int]]], bases: list[int],
                 n_params: int, grads: np.ndarray, buffers: list[np.ndarray],
                 send: Callable[[int, int, int], None], overflow: float = math.inf) -> None:
        self.model, self.order, self.bases, self.grads, self.buffers, self.send = \
            model, order, bases, grads, buffers, send
        self.overflow = overflow
        #: whether every value sent by the push under way was finite (and below ``overflow``) so far
        self.finite = True
        params = [(p, off, off + n) for p, _, _, off, n in spans if p is not None]
        self.needs: dict[tuple[int, int], int] = {}  # piece -> parameters it waits for
        self.pieces_of: dict[int, list[tuple[int, int]]] = {}  # a parameter's id -> the pieces it is in
        for s, ranges in enumerate(order):
            for k, (_, lo, hi) in enumerate(ranges):
                if hi > n_params:
                    continue
                inside = [p for p, a, b in params if a < hi and lo < b]
                self.needs[(s, k)] = len(inside)
                for p in inside:
                    self.pieces_of.setdefault(id(p), []).append((s, k))
        self.handles: list = []
        self.slot: int | None = None  # the push under way, between arm() and finish()
        self.left: dict[tuple[int, int], int] = {}
        self.next = [0] * len(order)  # per shard, its next piece to send

    @property
    def armed(self) -> bool:
        return self.slot is not None

    def arm(self, slot: int) -> None:
        """Before backward: the push from ``slot`` has sent its headers; send its pieces as they are ready.
        The hooks go on at the first push, after any the run put on the model before (the emulated
        backward's compute: a gradient is ready once its layer's time has passed)."""
        if not self.handles:
            seen = set()
            for p in self.model.parameters():
                if id(p) in self.pieces_of and id(p) not in seen:
                    seen.add(id(p))
                    self.handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
        self.slot, self.left, self.next = slot, dict(self.needs), [0] * len(self.order)
        self.finite = True
        for s in range(len(self.order)):  # pieces that wait for no parameter
            self._advance(s)

    def _accumulated(self, param: torch.Tensor) -> None:
        if self.slot is None:
            return
        shards = set()
        for piece in self.pieces_of.get(id(param), ()):
            self.left[piece] -= 1
            shards.add(piece[0])
        for s in sorted(shards):
            self._advance(s)

    def _advance(self, s: int) -> None:
        """Send shard ``s``'s pieces that are complete, in its order, up to the first that is not."""
        ranges = self.order[s]
        while self.next[s] < len(ranges) and self.left.get((s, self.next[s]), 1) == 0:
            self._send(s, self.next[s])

    def _send(self, s: int, k: int) -> None:
        at, lo, hi = self.order[s][k]
        w = self.bases[s] + at
        piece = self.buffers[self.slot][w:w + hi - lo]
        np.copyto(piece, self.grads[lo:hi])
        if self.finite:  # (one non-finite piece decides the verdict: the others need no look)
            self.finite = all_finite(torch.from_numpy(piece), self.overflow)
        self.send(self.slot, s, k)
        self.next[s] += 1

    def finish(self) -> bool:
        """After the pass: send what is left (pieces backward did not complete, the buffers' change); return
        whether every value the push sent was finite (the push's verdict)."""
        for s, ranges in enumerate(self.order):
            while self.next[s] < len(ranges):
                self._send(s, self.next[s])
        self.slot = None
        return self.finite

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.slot = None
