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
  version the extra was computed on. Under ``--lr-scaling auto`` (the
  default) an extra's rate is also divided by the worker count: it is one
  worker's gradient applied alone, where a round averages N, so per
  training sample it moves the model as far as a round's share of it.

The policy counts versions itself (one per update it names), so it knows
``s`` when it decides; a resumed run starts counting at its checkpoint's
version (:meth:`resume_at`). Extras are versions too, in numbers nobody
knows ahead, so a shard runs an hsp run's learning-rate schedule on the
gradients applied over the workers instead of the version
(:meth:`hpcps.runtime.server.ShardServer.position`): it reaches ``--steps``
with the run's last gradient.
"""

from __future__ import annotations

from hpcps.policies.base import Decision
from hpcps.policies.registry import register
from hpcps.policies.sync import BSP


@register
class HSP(BSP):
    """BSP's rounds, plus extras applied alone and scaled. The shard sums a round in the order
    its transfers come, not in worker order (see :mod:`hpcps.runtime.rounds`): hsp runs are not
    reproducible bit for bit."""

    name = "hsp"
    runs_through = False  # serial transfers and extra gradients: not built for a worker that dies
    summary = "rounds collected one worker at a time (no incast); waiting workers add scaled extra gradients"
    serial_transfers = True
    extra_gradients = True

    def __init__(self, n_workers: int, **options) -> None:
        super().__init__(n_workers)
        self.version = 0

    @classmethod
    def lr_scale(cls, n_clients: int, *, extra: bool = False) -> float:
        return 1.0 / n_clients if extra else 1.0

    def resume_at(self, version: int) -> None:
        self.version = version

    def threshold(self, worker: int) -> int:
        return -1

    def on_push(self, worker: int, clock: int, version: int, now: float, extra: bool = False) -> Decision:
        if extra:
            s = self.version - version
            self.version += 1
            return Decision(updates=((worker,),), grants=(worker,), weights=(1.0 / (1 + s),))
        return super().on_push(worker, clock, version, now)

    def _close_round(self) -> Decision:
        decision = super()._close_round()
        self.version += len(decision.updates)
        return decision
