"""Compression on the wire (``--compress``): what a push and a pull carry, and how each end converts.

The shards always keep fp32 master weights and optimizer state; compression changes only
the bytes that move:

``none``
    fp32 both ways, no conversion: pushes leave from the gradient buffer itself, pulls land
    in the model's parameters.
``bf16``, ``fp16``
    pushes and pulls carry 16-bit values: half the bytes, exactly. The worker rounds its
    gradient (to nearest even) into a 16-bit send buffer; the shard reads the received
    payload through a 16-bit view, with no copy, and sums and steps in fp32. A shard
    publishes a 16-bit copy of its fp32 master for pulls, and the worker widens what it
    pulled into its fp32 parameters. ``fp16`` overflows above 65504: such a gradient
    arrives with Inf and is dropped as non-finite (``--nonfinite``), as an unscaled fp16
    gradient would be anywhere; ``bf16`` has fp32's range and 8 bits of mantissa.
``topk:RATIO``
    pushes carry the ``ceil(RATIO x n)`` largest-magnitude values of each shard's slice of
    ``n`` (an int32 index and an fp32 value each: ``8 x k`` bytes for ``4 x n``), with
    *error feedback*: the worker adds what it did not send to its next gradient, keeping
    the rest in a residual of its own. For every push, elementwise and exactly,
    ``sent + residual = residual before + gradient``, so no gradient mass is lost or
    sent twice, whatever the paradigm and whenever the push is applied. A gradient that
    is not finite (or a step the loop skipped) leaves the residual as it was: its push
    carries the non-finite values, and the shard drops it as it drops any other.
    Pulls stay fp32.

Pure torch and numpy (no MPI): :mod:`hpcps.transport.push` and
:mod:`hpcps.transport.window` move the buffers, whose element type this module says.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np
import torch

from hpcps.errors import UserError

CHOICES = "none, bf16, fp16 or topk:RATIO (0 < RATIO < 1)"


def all_finite(values: torch.Tensor, overflow: float = math.inf) -> bool:
    """Whether every value is finite, and below ``overflow`` in magnitude (a worker's gradient on a wire
    whose codec turns larger ones infinite: :attr:`Codec.overflow`), in one read of them:
    ``torch.aminmax`` (NaN propagates to both, an infinity is the minimum or the maximum).
    ``torch.isfinite(values).all()`` writes a bool per value first: 16 MiB of gradient took it 20-34x
    the time of copying those bytes (``tools/bench_shard_apply.py`` compares both with the copy)."""
    if values.numel() == 0:
        return True
    lo, hi = (float(x) for x in torch.aminmax(values))
    return math.isfinite(lo) and math.isfinite(hi) and max(-lo, hi) < overflow


class Codec:
    """No compression: fp32 values both ways (the base every codec refines)."""

    name = "none"
    #: the numpy element type of push payloads and of pulled slots
    push_dtype: np.dtype = np.dtype(np.float32)
    pull_dtype: np.dtype = np.dtype(np.float32)
    identity_push = True  # pushes leave from the gradient buffer itself
    identity_pull = True  # pulls land in the parameters themselves
    #: the smallest magnitude a finite fp32 gradient value becomes infinite at on the wire (a worker's
    #: verdict on its gradient holds for what the shards receive)
    overflow = math.inf

    def describe(self) -> dict:
        """What the run file records of it."""
        return {"name": self.name, "push_bytes_per_value": self.push_dtype.itemsize * self.push_len(1 << 20) / (1 << 20),
                "pull_bytes_per_value": self.pull_dtype.itemsize}

    # -- pushes ----------------------------------------------------------------------------
    def push_len(self, n: int) -> int:
        """Payload elements (of ``push_dtype``) for a shard slice of ``n`` values."""
        return n

    def push_bounds(self, bounds: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Each shard's block of a whole push buffer, in payload elements."""
        out, at = [], 0
        for lo, hi in bounds:
            out.append((at, at + self.push_len(hi - lo)))
            at += self.push_len(hi - lo)
        return out

    def new_push_buffer(self, bounds: Sequence[tuple[int, int]]) -> np.ndarray:
        return np.zeros(self.push_bounds(bounds)[-1][1], self.push_dtype)

    def encode(self, grads: torch.Tensor, out: np.ndarray, bounds: Sequence[tuple[int, int]], *,
               keep: bool = True) -> None:
        """The worker: the gradient vector ``grads`` (fp32, any device) into the push buffer ``out``,
        shard slice by shard slice (``bounds``); ``keep``: the gradient is to be applied (False for a
        skipped step: a codec with memory leaves it unchanged)."""
        torch.from_numpy(out).copy_(grads)

    def gradient(self, payload: np.ndarray, n: int) -> torch.Tensor:
        """The shard: a received payload as the dense gradient of its slice of ``n`` values (a view
        where the codec allows; values of a 16-bit type are summed and stepped in fp32)."""
        return torch.from_numpy(payload)

    def values(self, payload: np.ndarray) -> torch.Tensor:
        """The gradient values a payload carries (what the finiteness check reads)."""
        return torch.from_numpy(payload)

    # -- pulls -----------------------------------------------------------------------------
    def encode_params(self, params: np.ndarray, out: np.ndarray) -> None:
        """The shard: fp32 ``params`` into a pull slot."""
        np.copyto(out, params)

    def decode_params(self, slot: np.ndarray, out: np.ndarray) -> None:
        """The reader: a pulled slot into fp32 ``out``."""
        np.copyto(out, slot)


class Half(Codec):
    """``bf16`` and ``fp16``: 16-bit values both ways (stored as uint16 for MPI, viewed as torch's type)."""

    push_dtype = pull_dtype = np.dtype(np.uint16)
    identity_push = identity_pull = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.torch_dtype = torch.bfloat16 if name == "bf16" else torch.float16
        info = torch.finfo(self.torch_dtype)  # rounding to nearest: half an ulp past the largest finite value
        self.overflow = info.max + info.eps * 2.0 ** math.floor(math.log2(info.max)) / 2

    def _view(self, buf: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(buf).view(self.torch_dtype)

    def encode(self, grads: torch.Tensor, out: np.ndarray, bounds: Sequence[tuple[int, int]], *,
               keep: bool = True) -> None:
        self._view(out).copy_(grads)  # rounds to nearest even; from a GPU, one copy that converts

    def gradient(self, payload: np.ndarray, n: int) -> torch.Tensor:
        return self._view(payload)

    def values(self, payload: np.ndarray) -> torch.Tensor:
        return self._view(payload)

    def encode_params(self, params: np.ndarray, out: np.ndarray) -> None:
        self._view(out).copy_(torch.from_numpy(params))

    def decode_params(self, slot: np.ndarray, out: np.ndarray) -> None:
        torch.from_numpy(out).copy_(self._view(slot))


class TopK(Codec):
    """``topk:RATIO``: the largest-magnitude ``ceil(RATIO x n)`` values of each shard slice, with error
    feedback (module docstring). Payload per slice: ``k`` int32 indices (as float32 bits), then
    ``k`` fp32 values."""

    identity_push = False

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.name = f"topk:{ratio:g}"
        self.residual: torch.Tensor | None = None  # the worker's, over the whole vector

    def describe(self) -> dict:
        return {**super().describe(), "ratio": self.ratio}

    def k(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.ratio * n)))

    def push_len(self, n: int) -> int:
        return 2 * self.k(n)

    def encode(self, grads: torch.Tensor, out: np.ndarray, bounds: Sequence[tuple[int, int]], *,
               keep: bool = True) -> None:
        grads = grads.detach().to("cpu", torch.float32)
        if self.residual is None:
            self.residual = torch.zeros(grads.numel(), dtype=torch.float32)
        finite = keep and all_finite(grads)
        for (lo, hi), (a, b) in zip(bounds, self.push_bounds(bounds)):
            k = self.k(hi - lo)
            acc = self.residual[lo:hi] + grads[lo:hi] if finite else grads[lo:hi]
            # NaN sorts as the largest magnitude: a non-finite gradient's push carries it to the shard
            index = torch.topk(acc.abs(), k, sorted=False).indices
            payload = torch.from_numpy(out[a:b])
            payload[:k].view(torch.int32).copy_(index)
            payload[k:] = acc[index]
            if finite:
                acc[index] = 0.0
                self.residual[lo:hi] = acc

    def _split(self, payload: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        k = len(payload) // 2
        t = torch.from_numpy(payload)
        return t[:k].view(torch.int32).long(), t[k:]

    def gradient(self, payload: np.ndarray, n: int) -> torch.Tensor:
        index, vals = self._split(payload)
        dense = torch.zeros(n, dtype=torch.float32)
        dense[index] = vals
        return dense

    def values(self, payload: np.ndarray) -> torch.Tensor:
        return self._split(payload)[1]


def make_codec(spec: str | None) -> Codec:
    """The codec ``--compress`` names; :class:`UserError` for anything else."""
    spec = (spec or "none").strip()
    if spec == "none":
        return Codec()
    if spec in ("bf16", "fp16"):
        return Half(spec)
    m = re.fullmatch(r"topk:([0-9.eE+-]+)", spec)
    if m:
        try:
            ratio = float(m.group(1))
        except ValueError:
            ratio = -1.0
        if 0.0 < ratio < 1.0:
            return TopK(ratio)
    raise UserError(f"--compress {spec!r}: expected {CHOICES}")
