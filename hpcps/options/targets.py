"""When a run has reached its goal: a metric of the evaluation against a value (pure).

``--target val_loss<=1.5`` stops the run at the first evaluation whose
``val_loss`` is 1.5 or less; ``--target accuracy>=0.9`` (what
``--target-accuracy 0.9`` says) at the first whose accuracy is 0.9 or more.
The name is any metric the evaluation returns (``loss``, ``accuracy``, or a
user's ``evaluate`` function's own names).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

_SPEC = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*(<=|>=|<|>)\s*([-+0-9.eE]+|inf|-inf)\s*$")


@dataclass(frozen=True)
class Target:
    name: str
    op: str
    value: float

    @classmethod
    def parse(cls, spec: str) -> "Target":
        """``NAME<=VALUE``, ``NAME>=VALUE`` (or ``<``, ``>``); ValueError saying the form otherwise."""
        m = _SPEC.match(spec)
        try:
            if m is None:
                raise ValueError
            return cls(m.group(1), m.group(2), float(m.group(3)))
        except ValueError:
            raise ValueError(f"{spec!r}: expected METRIC<=VALUE or METRIC>=VALUE, e.g. val_loss<=1.5 "
                             f"or accuracy>=0.9") from None

    def reached(self, value: float) -> bool:
        """Whether ``value`` of the metric meets the target (never for NaN)."""
        if math.isnan(value):
            return False
        return {"<=": value <= self.value, ">=": value >= self.value,
                "<": value < self.value, ">": value > self.value}[self.op]

    def first_time(self, t: np.ndarray, values: np.ndarray) -> float:
        """The first time ``t`` at which ``values`` meet the target (NaN: never)."""
        hits = [ti for ti, v in zip(t, values) if self.reached(float(v))]
        return float(min(hits)) if hits else float("nan")

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.value:g}"
