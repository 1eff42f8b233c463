"""The interface between a synchronization paradigm and the runtime.

A policy is a small, pure object: it imports no MPI and does no I/O, so it
is unit-tested in microseconds and a simulator can drive the very same
object the real server does. The server shard calls it on two events and
carries out what it returns:

* ``on_push(worker, clock, version, now)``: worker ``worker`` (an index
  0..N-1) pushed its ``clock``-th gradient, computed on parameter
  ``version``; ``now`` is seconds since the run's start (rank 0's clock).
* ``on_leave(worker, now)``: the worker has finished and will push no more.

Each returns a :class:`Decision`:

* ``updates``: gradients to apply now, as tuples of worker indices. Each
  tuple becomes *one* update of the parameters (the average of those
  workers' pending gradients) and advances the server version by one.
* ``weights``: optional, one factor per update (default 1): the update's
  learning rates are multiplied by it (hsp scales late gradients down).
* ``grants``: workers that may start their next iteration. Every push is
  granted exactly once (unless its worker leaves first); a worker of a
  policy whose ``worker_blocks`` is true waits for its grant before it
  computes again.

A gradient named in no ``updates`` stays pending in the server until a
later decision names it; the runtime never applies a gradient on its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class Decision:
    """What the server does after an event; see the module docstring."""

    updates: tuple[tuple[int, ...], ...] = ()
    grants: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()


class Policy(ABC):
    """Base class of every paradigm's server-side rule."""

    #: name under which the registry knows the paradigm (``--paradigm``)
    name: ClassVar[str]
    #: one line for ``--help`` and the docs
    summary: ClassVar[str]
    #: whether a worker waits for its grant before computing again
    worker_blocks: ClassVar[bool] = True
    #: whether the paradigm runs group servers (``--groups``)
    uses_groups: ClassVar[bool] = False
    #: whether workers pull eagerly, behind their computation (hpcps.runtime.worker.EagerWorker)
    eager_pull: ClassVar[bool] = False
    #: whether each shard lets one worker at a time stream its gradient in (hpcps.transport.push)
    serial_transfers: ClassVar[bool] = False
    #: whether workers compute extra gradients while they wait for their grant (hsp; on_push gets ``extra``)
    extra_gradients: ClassVar[bool] = False
    #: whether gradients wait for others (a round) before they are applied; a shard then sums each
    #: round as it arrives (hpcps.runtime.rounds) instead of holding its gradients
    holds_rounds: ClassVar[bool] = False
    #: ``--lr-staleness`` when the user gives none
    default_lr_staleness: ClassVar[str] = "none"

    def __init__(self, n_workers: int, *, staleness: int = 0, staleness_max: int | None = None) -> None:
        if n_workers < 1:
            raise ValueError("a policy needs at least one worker")
        self.n_workers = n_workers
        self.staleness = staleness
        self.staleness_max = staleness if staleness_max is None else staleness_max
        self.active = set(range(n_workers))

    @classmethod
    def updates_per_step(cls, n_clients: int) -> int:
        """Updates a shard applies while each of its ``n_clients`` pushes one gradient.

        The learning-rate schedule's horizon is ``steps`` times this: every
        gradient is an update of its own unless the paradigm averages rounds.
        """
        return n_clients

    def resume_at(self, version: int) -> None:
        """The shard resumes at ``version`` (from a checkpoint); policies that count versions start there."""

    def threshold(self, worker: int) -> int:
        """Clock-gap bound in force for ``worker`` (recorded with each update; -1: none)."""
        return -1

    @abstractmethod
    def on_push(self, worker: int, clock: int, version: int, now: float) -> Decision:
        """A gradient from ``worker`` arrived; say what to apply and whom to release."""

    def on_leave(self, worker: int, now: float) -> Decision:
        """``worker`` finished; by default it simply stops counting."""
        self.active.discard(worker)
        return Decision()
