"""The loss of a step the loop did not name: the scalars backward ran from since the last step.

A DDP loop steps its optimizer without ever handing it the loss (``optimizer.step()``,
``scaler.step(optimizer)``), yet the run file's loss column and the divergence watch
(:mod:`hpcps.training.divergence`) need it. What a step pushes is the gradient of the
scalars ``backward()`` ran from since the last step (several under accumulation, each
divided by their number as nanoGPT does), so their sum is the loss of the step: what
:class:`LossCapture` takes where the loop gave none.

Two process-wide wrappers, put on once and inert without an open capture: one around
``torch.autograd.backward`` (which ``Tensor.backward`` calls), which notes the scalar; one
around ``GradScaler.scale``, which marks its product with the loss it scaled, so that
``scaler.scale(loss).backward()`` counts ``loss`` and not ``loss * scale``. A backward
from a tensor of more than one value (a ``gradient=`` given) leaves the step's loss
unknown: the caller records NaN and says so. The values stay tensors until the step takes
them (no device sync per backward).
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from typing import Any

import torch

#: the capture of this process's open session (one at a time), weakly: a dropped session captures nothing
_active: "weakref.ref[LossCapture] | None" = None
_wrapped = False
_UNSCALED = "_hpcps_unscaled_loss"  # the attribute a scaler's product carries: the loss it scaled
log = logging.getLogger("hpcps")


class LossCapture:
    """The scalars backward ran from since the last :meth:`take`; see the module docstring."""

    def __init__(self, *, warn: bool = False) -> None:
        self._values: list[torch.Tensor] = []
        self._unknown = False  # a backward from a non-scalar since the last take
        self._warn = warn  # say (once) that a step's loss is unknown: worker 0's

    def open(self) -> "LossCapture":
        """From now on this capture takes this process's backward calls (it replaces any other)."""
        global _active
        _wrap_torch()
        _active = weakref.ref(self)
        return self

    def close(self) -> None:
        global _active
        if _active is not None and _active() is self:
            _active = None
        self._values.clear()

    def unknown(self) -> None:
        """A backward from something that is no scalar tensor (a graph edge): the step's loss is unknown."""
        self._unknown = True

    def note(self, tensor: torch.Tensor) -> None:
        if tensor.numel() != 1:
            self._unknown = True
            return
        self._values.append(getattr(tensor, _UNSCALED, tensor).detach().reshape(()))

    def take(self) -> float | None:
        """The loss of the step about to be pushed (the sum of the scalars backward ran from since the last
        take), or None where it is unknown (no backward, or one from a non-scalar); then start again."""
        values, unknown = self._values, self._unknown
        self._values, self._unknown = [], False
        if unknown or not values:
            return None
        return float(torch.stack([v.float().to(values[0].device) for v in values]).sum())

    def value(self, loss: torch.Tensor | float | None) -> float:
        """The step's loss: ``loss`` where the loop named it, else :meth:`take`'s; NaN where neither is known
        (said once where this capture warns)."""
        captured = self.take()
        if loss is not None:
            return float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        if captured is not None:
            return captured
        if self._warn:
            self._warn = False
            log.warning("worker 0: a step whose loss is unknown (no backward() from a scalar since the last step), "
                        "so its row's loss is NaN and the divergence watch does not see it: pass it "
                        "(ps.step(loss), ps.optimizer.step(loss=loss)); said once")
        return math.nan


def _note(tensors: Any) -> Any:
    """Note what a backward runs from (a tensor, or a sequence of them; a graph edge is no loss); return
    ``tensors`` for the backward, a one-shot iterable made a tuple so that noting it does not use it up."""
    capture = _active() if _active is not None else None
    if capture is None:
        return tensors
    if isinstance(tensors, torch.Tensor):
        capture.note(tensors)
        return tensors
    tensors = tuple(tensors)
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            capture.note(tensor)
        else:
            capture.unknown()
    return tensors


def _wrap_torch() -> None:
    """Put the two wrappers on, once per process (see the module docstring)."""
    global _wrapped
    if _wrapped:
        return
    _wrapped = True
    backward = torch.autograd.backward

    @functools.wraps(backward)
    def noted_backward(tensors, *args, **kwargs):
        return backward(_note(tensors), *args, **kwargs)

    torch.autograd.backward = noted_backward
    scaler_class = torch.amp.GradScaler
    scale = scaler_class.scale

    @functools.wraps(scale)
    def marked_scale(self, outputs):
        scaled = scale(self, outputs)
        if isinstance(outputs, torch.Tensor) and isinstance(scaled, torch.Tensor) and scaled is not outputs:
            setattr(scaled, _UNSCALED, outputs)
        return scaled

    scaler_class.scale = marked_scale
