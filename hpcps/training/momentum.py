"""Momentum under staleness: the rule that keeps one ``--momentum`` safe under every paradigm (pure).

Asynchrony begets momentum (Mitliagkas, Zhang, Hadjis and Ré, 2016): an
update computed on parameters ``s`` updates old behaves, in expectation, like
SGD with an implicit momentum ``s / (1 + s)`` on top of the optimizer's own.
At bsp's momentum 0.9, an asynchronous run whose gradients are ~5 updates
stale carries far more momentum than bsp did, and on MNIST-1D's CNN asp
ended at 0.40-0.70 where bsp reached 0.92.

The rule keeps the total where the user set it. With ``s̄`` the running
mean staleness of the updates a shard applies, the optimizer's momentum
becomes

    μ' = max(0, 1 - (1 - μ)(1 + s̄))

(the implicit and explicit memories compound: ``1 - μ_total = (1 - μ')
(1 - s̄/(1+s̄))``), and the update's rate is multiplied by ``(1 - μ') /
(1 - μ)``, so that ``rate / (1 - momentum)``, how far a steady gradient
moves the model, is what the user's flags say. At ``s̄ = 0`` (bsp, hsp's
rounds, grouped's groups) it is the identity: bsp's flags are unchanged.

The raise ramps up as the user's optimizer's steps do. A momentum buffer
starts empty: under a steady gradient torch's SGD moves ``rate (1 - μ^k) /
(1 - μ)`` at its k-th update, a tenth of its stride at the first one for
μ = 0.9. The lowered momentum's buffer fills faster, so the raise at the
k-th update of a shard is ``(1 - μ') / (1 - μ) x (1 - μ^k) / (1 - μ'^k)``:
1 at the first update, the full raise once both buffers are full, and
each update moves exactly as far as the user's optimizer's would. Raised
in full from the first update, the first steps were 7x the user's (at
s̄ = 6) on a network that had not yet trained: on MNIST-1D's 1-D CNN,
asp at bsp's settings sat at chance on one seed of five and reached
0.09-0.72 on the others; ramped, 0.61-0.83, every seed better
(docs/results.md). (What kept asp below bsp there was its pull, begun
with its push: reading its own writes, asp reaches 0.90-0.92.)
"""

from __future__ import annotations


class StaleMomentum:
    """The running mean staleness of a shard's updates and the momentum and rate factor it implies.

    ``memory``: the updates the mean weighs (an exponential mean with weight ``1/memory``, corrected for
    its start as Adam's moments are, so the first updates count at once). ``updates``: those the shard has
    applied already (a resumed run's version: its momentum buffers are restored full, so the ramp goes on
    where it was instead of starting again; the mean, not saved, starts again from the next update).
    """

    def __init__(self, memory: float = 100.0, updates: int = 0) -> None:
        self.decay = 1.0 - 1.0 / memory
        self._sum = 0.0
        self._weight = 0.0
        self.updates = updates

    def observe(self, staleness: float) -> None:
        """An update applied ``staleness`` versions after the version its gradient was computed on."""
        self._sum = self.decay * self._sum + max(float(staleness), 0.0)
        self._weight = self.decay * self._weight + 1.0
        self.updates += 1

    @property
    def mean(self) -> float:
        """``s̄``: the running mean staleness (0 before any update)."""
        return self._sum / self._weight if self._weight else 0.0

    def adjusted(self, momentum: float) -> tuple[float, float]:
        """``(μ', rate factor)`` for the optimizer's momentum ``momentum`` at the current mean staleness and
        the updates observed so far (:attr:`updates`, the ramp)."""
        if momentum <= 0.0 or momentum >= 1.0 or self.mean == 0.0:  # (exactly the user's at no staleness)
            return momentum, 1.0
        explicit = max(0.0, 1.0 - (1.0 - momentum) * (1.0 + self.mean))
        factor = (1.0 - explicit) / (1.0 - momentum)
        if self.updates:  # the k-th update moves as far as the user's optimizer's k-th: the ramp of a fresh buffer
            k = self.updates
            factor *= (1.0 - momentum ** k) / (1.0 - explicit ** k)
        return explicit, factor
