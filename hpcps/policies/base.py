"""The interface between a synchronization paradigm and the runtime: the base class of every paradigm.

The built-in paradigms and yours (``--paradigm path/to/file.py:Name``,
``hpcps.train(paradigm=Name)``; docs/paradigms.md, "Write your own paradigm")
subclass :class:`Policy`. A policy is a small, pure object: it imports no MPI
and does no I/O, so it is unit-tested in microseconds and the simulator can
drive the very same object the real server does. Every central shard holds
one instance (built with the number of workers that push to it) and calls it
on two events, one at a time, and carries out what it returns:

* ``on_push(worker, clock, version, now)``: worker ``worker`` (an index
  0..N-1) pushed its ``clock``-th gradient, computed on parameter
  ``version``; ``now`` is seconds since the run's start (rank 0's clock).
* ``on_leave(worker, now)``: the worker has finished and will push no more.
* ``on_join(worker, now)``: a spare took the place of ``worker``, which died (``--spare-workers``, under
  run-through): it pushes from the dead worker's clock on. Called only where ``takes_spares`` is true.

Each returns a :class:`Decision`:

* ``updates``: gradients to apply now, as tuples of worker indices. Each
  tuple becomes *one* update of the parameters (the average of those
  workers' pending gradients) and advances the server version by one.
* ``weights``: optional, one factor per update (default 1): the update's
  learning rates are multiplied by it (hsp scales late gradients down).
* ``drops``: workers whose pending gradient is discarded unapplied: it is
  recorded as dropped by the paradigm (``reason`` 3 in ``/servers/updates``)
  and its worker's receipt says so (backup workers drop a round's late
  gradients). A policy whose ``holds_rounds`` is true cannot drop.
* ``grants``: workers that may start their next iteration. Every push is
  granted exactly once (unless its worker leaves first); a worker of a
  policy whose ``worker_blocks`` is true waits for its grant before it
  computes again.

A gradient named in no ``updates`` or ``drops`` stays pending in the shard
until a later decision names it; the runtime never applies or drops a
gradient on its own, and a run that ends with a gradient pending fails. A
worker has at most one gradient pending at a shard: its next push is taken
up only once the last is applied or dropped.

What the class declares (class attributes, read before the run starts):
the worker side (``worker_blocks``, ``eager_pull``, ``extra_gradients``),
how the shard receives (``applies_on_arrival``, ``holds_rounds``,
``serial_transfers``), and how many updates one step of every worker makes
(:meth:`Policy.updates_per_step`), which sets the learning-rate schedules'
horizon and, under ``--lr-scaling auto`` (the default), the learning rate of
each update (:meth:`Policy.lr_scale`).

Checkpoints: each shard saves what :meth:`Policy.state_dict` returns with its
part of the checkpoint; a resumed shard builds its policy afresh, calls
:meth:`Policy.resume_at` with its version, then :meth:`Policy.load_state_dict`
with what was saved (ssp's clocks, dssp's bounds and intervals).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

#: the most of its gradients a worker that never waits for a grant (``worker_blocks`` False) may have pushed
#: and not yet applied by every shard, the one about to leave included: before a push it waits until its
#: gradient of two pushes ago was applied, so a shard slower than its workers slows them rather than
#: queueing their gradients without end (:meth:`hpcps.runtime.worker.Worker._keep_pace`; the simulator
#: holds its workers alike)
UNAPPLIED_AT_MOST = 2


@dataclass(frozen=True, slots=True)
class Decision:
    """What the server does after an event; see the module docstring."""

    updates: tuple[tuple[int, ...], ...] = ()
    grants: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    drops: tuple[int, ...] = ()


class Policy(ABC):
    """Base class of every paradigm's server-side rule.

    Subclass it, set ``name`` and ``summary``, implement :meth:`on_push` (and
    :meth:`on_leave` where a leaving worker matters to a pending decision).
    The constructor takes the number of workers and keyword options: the
    shard offers ``staleness`` and ``staleness_max`` (``--staleness``,
    ``--staleness-max``) to a constructor that accepts them, and passes every
    ``--paradigm-option NAME=VALUE`` as ``NAME=VALUE``.
    """

    #: name under which the registry knows the paradigm (``--paradigm``); a plug-in's own is shown in logs
    name: ClassVar[str] = ""
    #: one line for ``--help`` and the docs
    summary: ClassVar[str] = ""
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
    #: whether a worker that dies (Open MPI's ULFM: docs/running.md) may leave the run as one that finished
    #: does (``on_leave``), the others going on; False: its death ends the job, as under any other MPI
    runs_through: ClassVar[bool] = True
    #: whether a spare worker may take a dead worker's place mid-run (``--spare-workers``; :meth:`on_join`):
    #: the asynchronous paradigms, whose rules hold a newcomer at any clock; a round (bsp) would not know
    #: which of its rounds the newcomer's first push belongs to
    takes_spares: ClassVar[bool] = False
    #: whether every decision on a push applies that gradient at once (asp, ssp, dssp, eager): a shard then
    #: receives into a small pool of buffers; otherwise it keeps one receive buffer per worker, as it
    #: may hold every worker's gradient at once
    applies_on_arrival: ClassVar[bool] = False
    #: ``--lr-staleness`` when the user gives none
    default_lr_staleness: ClassVar[str] = "none"
    #: the run's options (config fields: ``staleness``, ``staleness_max``, ...) this paradigm reads beyond
    #: what its flags imply (:meth:`reads_options`); an option set that no part of a run reads is named in a
    #: warning at start-up (:mod:`hpcps.options.effects`)
    reads: ClassVar[frozenset[str]] = frozenset()

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

    @classmethod
    def lr_scale(cls, n_clients: int, *, extra: bool = False) -> float:
        """The factor ``--lr-scaling auto`` multiplies a gradient's learning rate by, ``n_clients``
        pushing to each shard: ``1 / updates_per_step``, so that one step of every worker moves the
        model as far as one BSP round at ``--lr`` (an asynchronous paradigm applies each gradient as its
        own update: ``--lr / N``). ``extra``: the factor of an extra gradient (``extra_gradients``)."""
        return 1.0 / cls.updates_per_step(n_clients)

    @classmethod
    def reads_options(cls) -> frozenset[str]:
        """The run's options this paradigm reads: :attr:`reads`; for a plug-in, ``--staleness`` and
        ``--staleness-max`` where a constructor of its own takes ``staleness`` and ``staleness_max``;
        ``--staleness`` where workers pull eagerly (the pull's bound), ``--hsp-max-stale`` with extra
        gradients, and ``--lr-staleness`` where a gradient can be stale as its worker sees it (applied on
        arrival, or an extra gradient; not through group servers, whose rounds the central shards see)."""
        options = set(cls.reads)
        init = cls.__init__
        if not init.__module__.startswith("hpcps.policies"):  # a plug-in's own constructor
            import inspect

            options |= {name for name in ("staleness", "staleness_max") if name in inspect.signature(init).parameters}
        if cls.eager_pull:
            options.add("staleness")
        if cls.extra_gradients:
            options.add("hsp_max_stale")
        if (cls.applies_on_arrival or cls.extra_gradients) and not cls.uses_groups:
            options.add("lr_staleness")
        return frozenset(options)

    @classmethod
    def periodic_cut(cls) -> str | None:
        """Where a periodic checkpoint (``--checkpoint-every``, ``--checkpoint-interval``) can cut a run of
        this paradigm (hpcps.runtime.checkpoints.cut): ``"rounds"``, between two rounds (a paradigm that holds
        rounds, each over one gradient of every active worker, with extras between them if it has any);
        ``"clocks"``, anywhere, at a clock per worker (every gradient applied on arrival); None: nowhere
        yet (a paradigm that holds gradients its own way), and a run asking for one is refused."""
        if cls.holds_rounds:
            return "rounds"
        return "clocks" if cls.applies_on_arrival else None

    @classmethod
    def worker_side(cls) -> str:
        """Which worker drives this paradigm's workers (:data:`hpcps.runtime.assembly.WORKER_SIDES`):
        ``"eager"``, a pull behind each computation (:attr:`eager_pull`); ``"extra"``, extra gradients
        while it waits for its grant (:attr:`extra_gradients`); ``"steps"``, pull, compute, push (waiting
        for a grant where :attr:`worker_blocks`)."""
        return "eager" if cls.eager_pull else "extra" if cls.extra_gradients else "steps"

    @classmethod
    def releases_rounds(cls) -> bool:
        """Whether every worker of a round is released at its close, each then pulling once from the
        central shards (bsp and its presets, :class:`hpcps.policies.sync.BSP`): the paradigms under which
        a shard may send each round's values (``--pull send``). None here."""
        return False

    @classmethod
    def checkpoints_at_publish(cls) -> bool:
        """Whether a periodic checkpoint is taken at a round's close, from the shard's publish hook (every
        worker waits for its grant there, so the shards and worker 0's loop are at one version: bsp and
        its subclasses; ``--checkpoint-every`` rounds only), rather than as a cut while the run goes on."""
        return cls.periodic_cut() == "rounds" and cls.worker_blocks and not cls.extra_gradients

    def resume_at(self, version: int) -> None:
        """The shard resumes at ``version`` (from a checkpoint); policies that count versions start there."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this policy beyond its version: numbers, strings and lists in a dict
        (saved with each checkpoint: when a signal stops the run, once every worker has left, and at each
        periodic cut); ``{}``: nothing."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """A resumed run's policy (built afresh, after :meth:`resume_at`): take back :meth:`state_dict`'s
        ``state`` (``{}`` where the checkpoint has none)."""

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

    def on_join(self, worker: int, now: float) -> Decision:
        """A spare took the place of ``worker``, which died (and left through :meth:`on_leave`): it counts
        again, at the clock the dead worker's last push here left it, from now on. By default it simply
        counts again."""
        self.active.add(worker)
        return Decision()
