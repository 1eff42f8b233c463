"""Which values of the flat vector each shard holds, and in which order (pure arithmetic, no MPI).

By default shard ``s`` holds one contiguous block of the flat vector (:func:`~hpcps.cluster.layout.shard_bounds`).
With partitioned pulls over several shards that is the wrong cut: a pull asks for the first layers first,
they all live on shard 0, and every worker reads shard 0 at once while the other shards idle. So with
``--partition-mb`` the trainable values are *striped*: cut into ``S * m`` near-equal chunks of at most a
partition (at most :data:`MAX_CHUNKS` per shard), dealt round-robin (shard ``s`` holds chunks ``s, s + S,
s + 2S, ...``), as BytePS deals its partitions to its servers. A pull in forward order then reads from
every shard at once. Each chunk is a message of every push, so that a push may send the last layers'
chunks while backward computes the rest (:mod:`hpcps.runtime.backward`); one shard holds its chunks
in the flat order.

A shard keeps its chunks one after the other in its own memory (its *local* vector, whose ``[0, n)``
are trainable and the rest buffers, as every shard expects), and a push to it is its local vector's
values: the worker's push buffer holds every shard's local vector in shard order (the *wire* order),
``wire_bounds[s]`` being shard ``s``'s part. :meth:`Slices.gather` copies a flat-order vector into wire
order; the pulls copy each piece from its shard straight into place (:meth:`Slices.split`).

The float buffers (BatchNorm's statistics, ``[n_params, size)``) are never striped: they are cut into
``S`` contiguous blocks, one at the end of each shard's local vector.

Every cut through the trainable values falls on a multiple of :data:`ALIGN` values from the start of
the param group it cuts (:func:`aligned`), so that torch's fused optimizers step each value on the same
path however the shards are sliced: bsp ends with the same model to the last bit on one shard or four,
whole or in partitions.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import torch

from hpcps.cluster.layout import shard_bounds


#: at most this many chunks per shard, whatever the stripe: each is a message of every push (a few KB per
#: partition on a large model would make thousands, and their cost per message would outweigh the gain)
MAX_CHUNKS = 64

#: cuts through the trainable values fall on multiples of this many values from the start of the param
#: group they cut: 16 float32 values, a cache line, the unit torch's fused CPU optimizers deal to their
#: threads and the widest vector (AVX-512's). Those kernels step a tensor's last values short of a whole
#: vector on a scalar path that rounds otherwise than the vector body (1 ulp, a few values in ten
#: thousand a step), so a cut elsewhere moved values between the paths and the same bsp run on another
#: slicing ended a few ulp apart, then as far as chaos takes a model apart. On this grid a value is on
#: the scalar path only at the end of its group, on every slicing. A cut moves by 15 values at most.
ALIGN = 16


def stripe_elements(partition_mb: float | None) -> int | None:
    """The stripe (float32 values) that ``--partition-mb`` asks for: None for contiguous slices."""
    return max(1, int(partition_mb * 2**18)) if partition_mb else None


@dataclass(frozen=True)
class Slices:
    """``pieces[s]``: the ``(lo, hi)`` ranges of the flat vector shard ``s`` holds, in its local order."""

    pieces: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def contiguous(cls, bounds: Sequence[tuple[int, int]]) -> "Slices":
        return cls(tuple(((int(lo), int(hi)),) for lo, hi in bounds))

    @classmethod
    def plan(cls, size: int, n_params: int, n_shards: int, stripe: int | None = None, *,
             breaks: Sequence[int] = (), align: int = ALIGN) -> "Slices":
        """The slices of a ``size``-value vector whose first ``n_params`` are trainable over ``n_shards``
        shards: contiguous blocks, or (``stripe`` values) the trainable values striped. One shard holds its
        chunks in the flat order: its slice is the whole vector, as without a stripe, in pieces (each
        pushed as it is ready, see :meth:`send_order`). The cuts through the trainable values are
        :func:`aligned` to ``align`` from the param groups' ``breaks`` (``align=1``: where they fall, as
        before :data:`ALIGN`, for a checkpoint's slices that were cut so)."""
        if not stripe:
            return cls.contiguous(aligned(shard_bounds(size, n_shards), n_params, breaks, align))
        rounds = min(-(-n_params // (n_shards * stripe)), MAX_CHUNKS)
        chunks = aligned(shard_bounds(n_params, n_shards * max(1, rounds)), n_params, breaks, align)
        tails = shard_bounds(size - n_params, n_shards)
        return cls(tuple(tuple((lo, hi) for lo, hi in chunks[s::n_shards] if hi > lo)
                         + (((n_params + tails[s][0], n_params + tails[s][1]),) if tails[s][1] > tails[s][0] else ())
                         for s in range(n_shards)))

    # -- sizes -----------------------------------------------------------------------------------------

    @property
    def n_shards(self) -> int:
        return len(self.pieces)

    @property
    def striped(self) -> bool:
        """Whether some shard holds more than one range (pushes then leave from a wire-order copy, in
        pieces)."""
        return any(len(p) > 1 for p in self.pieces)

    def send_order(self, s: int, n_params: int) -> list[tuple[int, int, int]]:
        """``(local, lo, hi)`` of shard ``s``'s ranges in the order a push sends them, one message each:
        the trainable ones last first (backward produces the last layers' gradients first), then the
        buffers' (their change is known only after the pass). Every client and the shard's inbox agree
        on it: MPI matches one sender's messages in the order they were sent."""
        ranges = self.local_ranges(s)
        trainable = [r for r in ranges if r[2] <= n_params]
        return trainable[::-1] + [r for r in ranges if r[2] > n_params]

    def length(self, s: int) -> int:
        """Values shard ``s`` holds."""
        return sum(hi - lo for lo, hi in self.pieces[s])

    def trainable(self, s: int, n_params: int) -> int:
        """Trainable values at the start of shard ``s``'s local vector (the rest are buffers)."""
        return sum(max(0, min(hi, n_params) - lo) for lo, hi in self.pieces[s])

    @cached_property
    def wire_bounds(self) -> list[tuple[int, int]]:
        """Each shard's part of a wire-order vector (every shard's local vector, in shard order)."""
        out, at = [], 0
        for s in range(self.n_shards):
            out.append((at, at + self.length(s)))
            at += self.length(s)
        return out

    # -- where values are -------------------------------------------------------------------------------

    @cached_property
    def _index(self) -> tuple[list[int], list[tuple[int, int, int, int]]]:
        """Every range as ``(lo, hi, shard, local)``, sorted by ``lo``, and their starts (for :meth:`split`)."""
        rows = sorted((lo, hi, s, at) for s in range(self.n_shards) for at, lo, hi in self.local_ranges(s))
        return [r[0] for r in rows], rows

    def split(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """``[lo, hi)`` of the flat vector cut where it changes shard or range: ``(shard, local, lo, hi)``
        each, ``local`` being where ``lo`` is in the shard's local vector."""
        starts, rows = self._index
        out = []
        k = max(0, bisect.bisect_right(starts, lo) - 1)
        while k < len(rows) and rows[k][0] < hi:
            a, b, s, at = rows[k]
            x, y = max(lo, a), min(hi, b)
            if x < y:
                out.append((s, at + x - a, x, y))
            k += 1
        return out

    def local_ranges(self, s: int) -> list[tuple[int, int, int]]:
        """``(local, lo, hi)`` of each range shard ``s`` holds: ``[lo, hi)`` of the flat vector is at
        ``local`` of its local vector."""
        out, at = [], 0
        for lo, hi in self.pieces[s]:
            out.append((at, lo, hi))
            at += hi - lo
        return out

    # -- copies ---------------------------------------------------------------------------------------

    def take(self, s: int, flat):
        """Shard ``s``'s local vector, copied out of the flat-order ``flat`` (a numpy array or a tensor)."""
        if not self.pieces[s]:
            return flat[:0].copy() if isinstance(flat, np.ndarray) else flat[:0].clone()
        cat = np.concatenate if isinstance(flat, np.ndarray) else torch.cat
        return cat([flat[lo:hi] for lo, hi in self.pieces[s]])

    def put(self, s: int, local, flat) -> None:
        """Write shard ``s``'s local vector ``local`` into its places in the flat-order ``flat``."""
        for at, lo, hi in self.local_ranges(s):
            flat[lo:hi] = local[at:at + hi - lo]

    def gather(self, flat, wire) -> None:
        """Copy the flat-order ``flat`` into ``wire`` in wire order (numpy arrays or torch tensors, any
        device: a push's gradient into its send buffer)."""
        src, dst = _tensor(flat), _tensor(wire)
        for s, (w, _) in enumerate(self.wire_bounds):
            for at, lo, hi in self.local_ranges(s):
                dst[w + at:w + at + hi - lo].copy_(src[lo:hi])


def aligned(bounds: Sequence[tuple[int, int]], n_params: int, breaks: Sequence[int] = (),
            align: int = ALIGN) -> list[tuple[int, int]]:
    """Consecutive ``bounds`` with each cut inside the trainable values ``[0, n_params)`` moved to the
    nearest multiple of ``align`` from the start of the run of one param group it falls in (``breaks``:
    where the flat vector passes from one group to the next, :func:`hpcps.training.paramgroups.group_breaks`),
    or to that run's end if nearer. Left as they are where a block is shorter than ``2 * align`` (a cut
    moves by less than ``align``, so no block empties and the order holds) or ``align`` is 1."""
    bounds = [(int(lo), int(hi)) for lo, hi in bounds]
    if align <= 1 or len(bounds) < 2 or min(hi - lo for lo, hi in bounds) < 2 * align:
        return bounds
    starts = sorted({0, *(int(b) for b in breaks if 0 < b < n_params)})

    def snap(cut: int) -> int:
        if cut <= 0 or cut >= n_params:
            return cut
        k = bisect.bisect_right(starts, cut) - 1
        start, end = starts[k], starts[k + 1] if k + 1 < len(starts) else n_params
        below = start + (cut - start) // align * align
        above = min(below + align, end)
        return below if cut - below <= above - cut else above

    cuts = [snap(hi) for _, hi in bounds[:-1]]
    edges = [bounds[0][0], *cuts, bounds[-1][1]]
    return list(zip(edges, edges[1:]))


def _tensor(x) -> torch.Tensor:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x
