"""HSP: hybrid synchronous parallelism (Li et al., ICPP 2022).

Rounds as in BSP: every active worker's *regular* gradient of a round is
held until all have arrived, then applied as one averaged update and every
worker released. Two things differ:

* **No incast.** The runtime streams gradients into a shard one worker at a
  time, in the order the workers became ready (``serial_transfers``; see
  :mod:`hpcps.transport.push`), and logs each transfer.
* **Idle workers compute cautiously.** A worker waiting for its round to
  close computes up to ``--hsp-max-stale k`` *extra* gradients on the
  parameters it has (``extra_gradients``). The shard reads an extra only
  once the worker's regular gradient is used up, i.e. after the round
  closed, and applies it on its own at once, its learning rate multiplied
  by ``1/(1+s)``, where ``s`` is the number of updates applied since the
  version the extra was computed on.

The policy counts versions itself (one per update it names), so it knows
``s`` when it decides; runs of hsp start at version 0 (no resume).
"""

from __future__ import annotations

from hpcps.policies.base import Decision, Policy
from hpcps.policies.registry import register


@register
class HSP(Policy):
    name = "hsp"
    summary = "rounds collected one worker at a time (no incast); waiting workers add scaled extra gradients"
    serial_transfers = True
    extra_gradients = True

    def __init__(self, n_workers: int, **options) -> None:
        super().__init__(n_workers)
        self.round: list[int] = []
        self.version = 0

    def threshold(self, worker: int) -> int:
        return -1

    def on_push(self, worker: int, clock: int, version: int, now: float, extra: bool = False) -> Decision:
        if extra:
            s = self.version - version
            self.version += 1
            return Decision(updates=((worker,),), grants=(worker,), weights=(1.0 / (1 + s),))
        self.round.append(worker)
        return self._close_round()

    def on_leave(self, worker: int, now: float) -> Decision:
        super().on_leave(worker, now)
        return self._close_round()

    def _close_round(self) -> Decision:
        if not self.round or not self.active.issubset(self.round):
            return Decision()
        done, self.round = tuple(sorted(self.round)), []
        self.version += 1
        return Decision(updates=(done,), grants=done)
