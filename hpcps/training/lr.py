"""Staleness-aware learning rates (``--lr-staleness``), pure.

A worker scales the learning rate of a gradient by how stale it *knows* the
gradient to be when it pushes it: the newest server version it has seen
(through pulls and receipts) minus the version it computed on. Stale
gradients then move the global model less.
"""

from __future__ import annotations

import math
from typing import Callable

SCHEDULES: dict[str, Callable[[float, int], float]] = {
    "none": lambda lr, s: lr,
    "inverse": lambda lr, s: lr / (1.0 + s),
    "sqrt": lambda lr, s: lr / math.sqrt(1.0 + s),
    "exp": lambda lr, s: lr * math.exp(-s),
}


def scaled_lr(schedule: str, lr: float, staleness: int) -> float:
    """``lr`` scaled for a gradient ``staleness`` versions stale (``staleness >= 0``)."""
    return SCHEDULES[schedule](lr, max(0, staleness))
