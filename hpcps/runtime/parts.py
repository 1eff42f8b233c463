"""What the roles are built from: the ports they talk through, and small value objects for the rest.

A worker (:class:`hpcps.runtime.worker.Worker`) and a shard (:class:`hpcps.runtime.server.ShardServer`)
each take a handful of these instead of two dozen keywords. The ports are :class:`typing.Protocol`\\ s:
what the MPI transports (:mod:`hpcps.transport`) offer and the roles call, and what a fake offers in a unit
test that drives a role without ``mpiexec`` (``tests/unit/test_roles.py``). As torchft's ``Manager`` takes
its ``ProcessGroup``, a role is written against what it calls, not against MPI.

Ports, by role:

- a worker reads parameters from a :class:`PullSource` (the shards' window), pushes through a
  :class:`PushSink` (the pusher) and hears receipts and grants in a :class:`NoticeSource` (its notice box);
- a shard receives from an :class:`Inbox`, answers through a :class:`NoticeSink` (the notifier) and
  publishes to a :class:`PublishTarget` (its window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from hpcps.transport.poll import Backoff


# -- the ports ------------------------------------------------------------------------------------------
class PullSource(Protocol):
    """Where a worker reads the shards' parameters (:class:`hpcps.transport.window.ParamWindow`)."""

    shard_ranks: Sequence[int]

    def pull(self, out: np.ndarray, backoff: Backoff | None = None, *,
             exact: bool = False) -> tuple[np.ndarray, bool]: ...

    def begin_pull(self, out: np.ndarray, backoff: Backoff | None = None, **kw) -> Any: ...

    def peek(self, backoff: Backoff | None = None) -> np.ndarray: ...

    def request_stop(self) -> None: ...


class PushSink(Protocol):
    """Where a worker's gradients leave (:class:`hpcps.transport.push.Pusher`): persistent sends of a
    header and a payload to every shard, from one of its ``buffers`` (slots)."""

    buffers: list
    shard_ranks: Sequence[int]

    def start(self, clock: int, versions: np.ndarray, lr: float, slot: int = 0, flags: int = 0) -> None: ...

    def test(self, slot: int | None = None) -> bool: ...

    def transfer(self, shard: int) -> None: ...

    def start_done(self, clock: int) -> None: ...

    def test_done(self) -> bool: ...


class NoticeSource(Protocol):
    """Where a worker hears its receipts and grants (:class:`hpcps.transport.notices.NoticeBox`)."""

    open: int

    def poll(self) -> list: ...


class Inbox(Protocol):
    """Where a shard receives pushes (:class:`hpcps.transport.push.PushInbox`): ``poll()`` returns the
    events (push, leave, lost) completed since the last poll."""

    worker_ranks: Sequence[int]
    open: int

    def poll(self) -> list: ...

    def gradient(self, worker: int) -> np.ndarray: ...

    def release(self, worker: int) -> None: ...


class NoticeSink(Protocol):
    """Where a shard sends receipts, grants and goodbyes (:class:`hpcps.transport.notices.Notifier`)."""

    worker_ranks: Sequence[int]

    def send(self, worker: int, flags: int, clock: int = -1, version: int = -1, staleness: int = -1, **kw) -> None: ...

    def progress(self) -> None: ...

    def drain(self, backoff: Backoff | None = None) -> None: ...


class PublishTarget(Protocol):
    """Where a shard publishes its parameters (:class:`hpcps.transport.window.ParamWindow`)."""

    def publish(self, params: np.ndarray, version: int) -> bool: ...

    def publish_held(self) -> bool: ...

    def set_stop(self) -> None: ...

    def stop_raised(self) -> bool: ...

    def stop_once_published(self) -> bool: ...


# -- the value objects ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Records:
    """Where a role's rows go: ``recorder.add(table, row)`` (:mod:`hpcps.metrics.recorder`), stamped with
    ``clock()`` (seconds on the run's clock); ``timeline``: where its phases go (:mod:`hpcps.metrics.timeline`;
    none by default)."""

    recorder: Any
    clock: Callable[[], float]
    timeline: Any = None


@dataclass(frozen=True)
class Watch:
    """How a role waits: a wait that makes no progress warns after ``stall_warn`` seconds and (``stall_abort``,
    if set) ends the run; ``backoff``: how it sleeps between polls; ``take_signal()``: a stop signal this rank
    received (:mod:`hpcps.runtime.signals`), once."""

    stall_warn: float = 60.0
    stall_abort: float | None = None
    backoff: Backoff | None = None
    take_signal: Callable[[], str | None] | None = None


@dataclass(frozen=True)
class WorkerPorts:
    """A worker's transports: the ``window`` it pulls from, the ``pusher`` its gradients leave through, the
    ``notices`` its receipts and grants come in."""

    window: PullSource
    pusher: PushSink
    notices: NoticeSource


@dataclass(frozen=True)
class StepPlan:
    """A worker's steps: ``steps`` pushes in all (from ``start_step`` on, when resuming), each at learning
    rate ``lr`` (scaled by the staleness it knows of under ``lr_staleness``), waiting for a grant after each
    push where the paradigm ``blocks``; ``faults``: ``--fault`` injections due on this rank."""

    steps: int
    lr: float
    blocks: bool = True
    lr_staleness: str = "none"
    start_step: int = 0
    faults: Sequence = ()


@dataclass(frozen=True)
class PushPlan:
    """How a worker's gradient leaves. ``stage(out, keep)``: put the gradient into push buffer ``out``
    (``keep``: it is to be applied), where compression encodes it (:mod:`hpcps.transport.compress`); by
    default the flat buffer's own. ``send_buffers``: push from a copy of the gradient in one of these two
    (the pusher's slots), so that the push may leave while the next pass computes. ``backward_pushes``: in
    hpcps's own loop, push each piece of the gradient as backward produces it (:mod:`hpcps.runtime.backward`).
    ``overflow``: where a finite value becomes infinite on the wire
    (:attr:`hpcps.transport.compress.Codec.overflow`), for the verdict on each gradient its push carries."""

    stage: Callable[[np.ndarray, bool], None] | None = None
    send_buffers: list | None = None
    backward_pushes: Any = None
    overflow: float = math.inf


@dataclass(frozen=True)
class PullPlan:
    """How a worker's parameters come. ``partitions``: in partitions, the pass starting before the last has
    come (:mod:`hpcps.runtime.partitions`); ``defer_pull`` (``--overlap-steps``, needs
    :attr:`PushPlan.send_buffers`): a push is not followed by the grant's wait and the pull, which come when
    the loop asks for them, computation going on meanwhile; ``sent_pull(out, parts, watch)`` (``--pull send``,
    bsp): after each push, the round's values as the shards send them after the grant
    (:class:`~hpcps.transport.sent.SentPull`), in the place of a window pull."""

    partitions: Any = None
    defer_pull: bool = False
    sent_pull: Callable[..., Any] | None = None


@dataclass(frozen=True)
class ServerPorts:
    """A shard's transports: the ``inbox`` pushes come in, the ``notifier`` that answers, the ``window`` it
    publishes to; ``progress()``: drive MPI's progress between chunks of an update; ``sender``: ``--pull
    send``, a granted worker's round sent to it (:mod:`hpcps.transport.sent`); ``spares``: where spare
    workers take dead workers' places (:mod:`hpcps.runtime.spares`)."""

    inbox: Inbox
    notifier: NoticeSink
    window: PublishTarget
    progress: Callable[[], object] = lambda: None
    sender: Any = None
    spares: Any = None


@dataclass(frozen=True)
class ShardUpdate:
    """What a shard steps: ``master`` (its slice; ``[:n_params]`` trainable, stepped by ``optimizer``, the
    rest buffers), from ``version`` on; ``unit_lr``: the learning rate a push asks for at factor 1
    (``--lr``); ``round_sum``: sum each round (bsp, hsp) as it arrives (:mod:`hpcps.runtime.rounds`)
    instead of holding it; ``codec``: what a push's payload holds (:mod:`hpcps.transport.compress`; fp32 by
    default); ``abort_on_nonfinite``: a non-finite gradient ends the run (``--nonfinite abort``) instead of
    being dropped; ``home``: where the slice is stepped (:mod:`hpcps.runtime.residence`; default: ``master``
    itself, in place); ``pieces``: the slice's ranges, a round's released one at a time from the last
    verdict on (:mod:`hpcps.runtime.release`; the optimizer's chunks cut at them), or None: each round at once."""

    master: np.ndarray
    unit_lr: float
    optimizer: Any = None
    n_params: int | None = None
    version: int = 0
    round_sum: Any = None
    codec: Any = None
    abort_on_nonfinite: bool = False
    home: Any = None
    pieces: Sequence[tuple[int, int]] | None = None


@dataclass(frozen=True)
class ServerHooks:
    """What a shard calls besides its loop: ``side_tasks``, ``(phase, task)`` pairs called every loop, the
    time of one that returns true going to its phase of the timeline; ``on_applied(n)``, after ``n`` gradients
    were applied; ``on_published(version)``, after each publish."""

    side_tasks: Sequence[tuple[str, Callable[[], object]]] = field(default_factory=tuple)
    on_applied: Callable[[int], object] | None = None
    on_published: Callable[[int], object] | None = None
