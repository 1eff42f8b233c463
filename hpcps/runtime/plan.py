"""What a run is, on one rank: its plan (what was asked and resolved, fixed before it starts) and its state
(what this rank holds and what changes as it runs).

:class:`RunPlan` is built once by :func:`hpcps.runtime.run.open_run`, after the start-up checks, and is
the same on every rank: the options, the layout, the paradigm's class (resolved from its name once, here),
the slices and the stripe, the codec, the shards, the steps and rounds, the data's facts, the checkpoint
resumed. Nothing writes into it.

:class:`RunState` is this rank's: its communicators, model and flat vector, data, windows, recorder, the
ranks found dead, and the final values each role leaves for the end. The roles
(:mod:`hpcps.runtime.assembly`), checkpoints (:mod:`hpcps.runtime.checkpoints.schedule`) and records
(:mod:`hpcps.runtime.records`) take both, typed; the lifecycle (start, serve, end) is
:class:`hpcps.runtime.run.Run`'s.

The split follows torch.distributed.elastic's ``WorkerSpec`` (what was asked) and ``WorkerGroup``
(what changes).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from hpcps.options.config import TrainConfig, outer_rounds
from hpcps.cluster.layout import Layout
from hpcps.cluster.slices import ALIGN, Slices
from hpcps.runtime.checkpoints.files import SLICE_ALIGN
from hpcps.policies.base import Policy
from hpcps.transport.clocksync import RunClock
from hpcps.transport.compress import Codec
from hpcps.transport.poll import Backoff

if TYPE_CHECKING:  # (annotations only: these import MPI or the runtime's roles)
    from hpcps.cluster.topology import Topology
    from hpcps.data.batches import DataSource
    from hpcps.metrics.runfile import RunFile
    from hpcps.runtime.checkpoints.files import Checkpoint
    from hpcps.runtime.signals import StopSignals
    from hpcps.training.flat import FlatParameters
    from hpcps.training.optim import ShardOptimizer
    from hpcps.training.workload import Workload
    from hpcps.transport.failures import DeadRanks
    from hpcps.transport.window import ParamWindow


@dataclass(frozen=True)
class Leg:
    """A run that is one leg of a longer training: ``--paradigm auto``'s trials, each going on from the
    last one's end, and the run after them (:func:`hpcps.runtime.tune.choose_paradigm`).

    ``steps``: where each worker stops (its clock), short of the options' steps, which stay the
    schedule's horizon (None: the options' end); ``keep_end``: the end writes a checkpoint, as a stop
    does, from which the next leg goes on; ``link_bps``: the link between nodes as measured once for
    every leg (None: the leg measures it, where its defaults read it). A leg may go on from another
    paradigm's checkpoint (:func:`hpcps.runtime.checkpoints.files.for_paradigm`), which a user's
    ``--resume`` may not. ``trial``: the leg is a trial (``--paradigm auto``'s, ``hpcps tune``'s), which
    no one reads an accuracy of: rank 0 evaluates nothing on the held-out set (its end still pulls the
    final parameters, as the next leg's checkpoint and a saved model need, but skips the pass, seconds a
    trial on ResNet-18) and saves no model (the next leg goes on from its checkpoint), and a divergence
    ends it with a warning that it is not chosen, not with advice for a run.
    """

    steps: int | None = None
    keep_end: bool = False
    link_bps: float | None = None
    trial: bool = False


@dataclass(frozen=True)
class RunPlan:
    """A run as resolved before it starts, the same on every rank.

    ``paradigm``: the policy class ``cfg.paradigm`` names (:mod:`hpcps.policies`), which says what its
    worker side is and what it reads; ``size``/``n_params``: values of the flat vector, and the trainable
    ones at its start (the rest are float buffers); ``stripe``: ``--partition-mb`` in values (None: whole
    slices); ``codec``: what moves on the wire (a worker's keeps its top-k residual); ``facts``: what every
    rank knows of the data (only workers and rank 0 load it); ``devices``: each rank's device, as
    :meth:`~hpcps.cluster.device.DevicePlan.describe` says (a shard's with where its slice is, under
    ``--server-device``); ``slice_devices``: where each rank's slice is, if on a device
    (:meth:`~hpcps.runtime.residence.DeviceSlice.describe_device`; None: host memory, and every rank
    but a central shard); ``world_ranks``: the launcher's rank of each
    of the run's ranks (``--placement``); ``groups``: the model's param groups
    (:func:`~hpcps.training.paramgroups.resolve_groups`); ``ckpt``: the checkpoint resumed, or None;
    ``reseed``: each worker draws its own torch random stream (``hpcps.init(reseed=False)`` keeps the
    script's); ``start_iteration``: the iteration a loop that resumes itself (from its own checkpoint, not
    hpcps's) starts at (``hpcps.init(start_iteration=k)``): its steps, versions and schedule go on from there.
    """

    cfg: TrainConfig
    layout: Layout
    paradigm: type[Policy]
    workload: "Workload"
    size: int
    n_params: int
    stripe: int | None
    slices: Slices
    codec: Codec
    steps: int
    facts: Mapping[str, Any]
    devices: tuple[str, ...]
    world_ranks: tuple[int, ...]
    groups: tuple
    ckpt: "Checkpoint | None" = None
    slice_devices: tuple[str | None, ...] = ()
    reseed: bool = True
    start_iteration: int = 0
    #: a leg of a longer training (:class:`Leg`): the whole training's steps, the schedule's horizon (None:
    #: ``steps``), whether the run's end writes a checkpoint for the next leg, and whether it is a trial
    horizon_steps: int | None = None
    keep_end: bool = False
    trial: bool = False

    def worker_start(self, index: int) -> int:
        """The gradients worker ``index`` had pushed when the run starts: its clock in the checkpoint resumed,
        or the iteration a loop resumes itself at."""
        return int(self.ckpt.worker_clocks[index]) if self.ckpt is not None else self.start_iteration

    def shard_start(self, shard: int) -> int:
        """The version central shard ``shard`` starts at: the checkpoint's, or for a loop that resumes itself
        at iteration k, the version an uninterrupted run is at after k steps in the paradigm's rhythm (k
        where it averages rounds, k x clients where each gradient is an update: ``updates_per_step``)."""
        if self.ckpt is not None:
            return int(self.ckpt.shard_version(shard))
        return self.start_iteration * self.paradigm.updates_per_step(len(self.clients))

    @property
    def shards(self) -> list[int]:
        """The central shards' ranks: ``0 .. n_servers - 1``."""
        return list(range(self.layout.n_servers))

    @property
    def rounds(self) -> int:
        """Pushes each worker makes: its steps, or under ``--local-steps H`` its outer rounds (ceil(steps/H))."""
        return self._rounds(self.steps)

    @property
    def horizon_rounds(self) -> int:
        """:attr:`rounds` of the whole training this run is part of (a :class:`Leg`'s; else this run's)."""
        return self._rounds(self.horizon_steps or self.steps)

    def _rounds(self, steps: int) -> int:
        every = self.cfg.inner_steps
        return steps if every is None else outer_rounds(steps, every)

    @property
    def clients(self) -> list[int]:
        """The ranks that push to a central shard: the workers, or (grouped) the group servers."""
        layout = self.layout
        if layout.n_groups > 0:
            return [layout.group_server_rank(g) for g in range(layout.n_groups)]
        return list(layout.worker_ranks())

    def trainable(self, shard: int) -> int:
        """Trainable values at the start of central shard ``shard``'s slice; the rest of it is buffers
        (BatchNorm statistics)."""
        return self.slices.trainable(shard, self.n_params)


@dataclass
class RunState:
    """This rank's part of a run: what it holds (communicators, model, data), what :meth:`Run.start
    <hpcps.runtime.run.Run.start>` makes (windows, recorder, the shard's optimizer), and what changes as it
    runs (a spare's place, the ranks found dead, the final values its role leaves for the end).

    ``index``: this rank's worker index (None on a server, and on a spare until it takes a place);
    ``deal(worker)``: worker ``worker``'s batches; ``stack``: the communicators and signal handlers,
    released when the run is left.
    """

    topo: "Topology"
    model: torch.nn.Module
    flat: "FlatParameters"
    source: "DataSource | None"
    batches: Any
    signals: "StopSignals"
    stack: ExitStack
    index: int | None = None
    deal: Callable[[int], Any] | None = None
    backoff: Backoff = field(default_factory=Backoff)
    run_clock: RunClock = field(default_factory=lambda: RunClock(time.perf_counter(), 0.0, 0.0))
    placed_at: int | None = None  # a spare: the dead worker's clock it took over
    #: under run-through (Open MPI's ULFM, a paradigm that allows it): the run's ranks found dead
    dead: "DeadRanks | None" = None
    window: "ParamWindow | None" = None  # start() makes them; leaving the run frees what it made
    group_window: "ParamWindow | None" = None
    path: str = ""  # the metrics file
    ckpt_dir: str = ""  # where checkpoints go, once the metrics file is named
    runfile: "RunFile | None" = None  # rank 0's
    recorder: Any = None
    master: Any = None  # a central shard's fp32 slice
    optimizer: "ShardOptimizer | None" = None  # a central shard's
    slice_device: Any = None  # a central shard's --server-device (None: host memory)
    home: Any = None  # a central shard's slice where it is stepped (hpcps.runtime.residence)
    policy: Policy | None = None  # a central shard's paradigm, once it serves (its state goes in checkpoints)
    rate: float | None = None  # the rate the servers' optimizer has of its own (a factory's, or --lr)
    ran: dict = field(default_factory=dict)  # rank 0: what ran (optimizer, schedule), for files and checkpoints
    final_version: int | None = None  # a shard: its version at the end
    final_clock: int | None = None  # a worker: the gradients it has pushed, resumed ones included
    final_clocks: list[int] | None = None  # a central shard: each worker's gradients received whole
    final_metrics: dict[str, float] = field(default_factory=dict)  # rank 0: the final evaluation
    diverged: str | None = None  # rank 0: why the run was found diverged (--divergence stop)
    #: rank 0: the untrained loss its divergence watch compares with, once known (carried in checkpoints)
    loss_start: Callable[[], float | None] | None = None
    stopped_by: str | None = None  # every rank, once the run has ended: a signal's name, "diverged", a loop's stop

    def clock(self) -> float:
        """Seconds since the run's start, on rank 0's clock (:mod:`hpcps.transport.clocksync`)."""
        return self.run_clock()


def start_clock(plan: RunPlan, state: RunState) -> int:
    """The gradients this worker's index had pushed when its loop starts: its checkpoint's clock on resume,
    a spare's the dead worker's, else 0."""
    if state.placed_at is not None:
        return state.placed_at
    return plan.worker_start(state.index) if state.index is not None else 0


#: the key of a checkpoint's config that carries the run's untrained loss (hpcps.training.divergence)
LOSS_START = "loss_start"


def ran_config(plan: RunPlan, state: RunState) -> dict:
    """What checkpoints record of the run (rank 0): its options, what ran (the optimizer, the schedule),
    and the untrained loss the divergence watch compares with, so that a run resumed from it does too
    (known once the first losses came; else the one the run's own checkpoint carried)."""
    start = state.loss_start() if state.loss_start is not None else None
    if start is None:
        start = carried_loss_start(plan)
    return {**plan.cfg.as_json_dict(), **state.ran, SLICE_ALIGN: ALIGN,
            **({LOSS_START: float(start)} if start is not None else {})}


def carried_loss_start(plan: RunPlan) -> float | None:
    """The untrained loss the checkpoint this run goes on from carries (None: a run from the start, or a
    checkpoint that carries none)."""
    carried = plan.ckpt.config.get(LOSS_START) if plan.ckpt is not None else None
    return float(carried) if carried is not None else None
