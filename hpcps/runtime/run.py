"""One training run on a given communicator: set-up, roles, teardown, summary.

:func:`run_training` is collective over the communicator it is given (the
CLI passes ``COMM_WORLD``; tests pass sub-communicators). What it trains is
a :class:`~hpcps.training.workload.Workload`: the user's objects (:func:`hpcps.train`)
or those ``hpcps train`` names. Only workers and rank 0 load data. Start-up steps
that can fail on bad input go through :func:`hpcps.runtime.agree.agree`, so every
rank fails together with one message. Teardown, in order:

1. workers leave (``DONE``, wait for every shard's ``BYE``);
2. shards leave their loops once every worker has left, and wait for each
   other; rank 0 evaluates the final parameters (and buffers);
3. every rank closes its recorder (rank 0 waits for all the others' rows);
4. a polite barrier, then the RMA window and communicators are freed;
5. rank 0 writes ``/summary`` from the tables, saves the model's
   ``state_dict`` (``--save``) and closes the file.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import resource
import socket
import sys
import time
from collections import Counter
from contextlib import ExitStack, suppress
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

import hpcps
from hpcps.runtime import agree as agree_module
from hpcps.runtime.agree import agree
from hpcps.data.batches import DataSource
from hpcps.box import cluster_record, node_label
from hpcps.runtime.checkpoint import (Checkpoint, LoopState, check_compatible, check_same_optimizer, checkpoint_path,
                              optimizer_state_path, read_checkpoint, read_optimizer_state, read_policy_state,
                              reshaped, restore_int_buffers, write_checkpoint, write_optimizer_state,
                              write_user_state)
from hpcps.config import TrainConfig, steps_for
from hpcps.data.sharding import Redeal, batches_per_epoch
from hpcps.cluster.device import DevicePlan, detect_cuda_aware, plan_device
from hpcps.cluster.emulation import ComputeTime
from hpcps.cluster.effects import no_effect
from hpcps.training.momentum import StaleMomentum
from hpcps.errors import RunAborted, UserError
from hpcps.runtime.evaluator import Evaluator
from hpcps.training.flat import FlatParameters
from hpcps.cluster.grouping import speed_groups
from hpcps.runtime.groupserver import GroupServer
from hpcps.cluster.layout import Layout, Role
from hpcps.cluster.slices import Slices, stripe_elements
from hpcps.cluster.placement import place
from hpcps.cluster.planning import plan
from hpcps.runtime.progress import Progress
from hpcps.log import setup_logging
from hpcps.metrics.recorder import FileRecorder, ForwardingRecorder
from hpcps.metrics.runfile import RunFile
from hpcps.metrics.schema import RANK, summarize
from hpcps.metrics.timeline import NullTimeline, Timeline
from hpcps.training.divergence import DivergenceWatch, NonFiniteStart
from hpcps.training.optim import Schedule, ShardOptimizer, describe_optimizer, make_schedule
from hpcps.training.optstate import cut, from_shard, join, to_shard
from hpcps.training.paramgroups import resolve_groups, shard_group_indices, shard_groups
from hpcps.policies import Policy, make_policy, policy_class
from hpcps.runtime.optstate import StateDesk
from hpcps.runtime.rounds import RoundSum
from hpcps.runtime.server import ShardServer
from hpcps.runtime.signals import StopSignals, announce
from hpcps.runtime.backward import BackwardPushes
from hpcps.runtime.partitions import PartitionedPulls
from hpcps.runtime.snapshot import ClockCut, RoundCut, Snapshots
from hpcps.cluster.topology import Topology, node_local_index
from hpcps.transport import wire
from hpcps.transport.compress import make_codec
from hpcps.transport.mpilib import library_version, query_cuda_support
from hpcps.transport.clocksync import RunClock, shares_clock_with_rank0, sync_clock
from hpcps.transport.notices import NoticeBox, Notifier
from hpcps.transport.poll import Backoff, StallWatch, polite_barrier
from hpcps.transport.push import Pusher, PushInbox
from hpcps.transport.window import ParamWindow
from hpcps.runtime.warmup import gather_pass_times, measure_pass_time
from hpcps.runtime.worker import EagerWorker, HSPWorker, Worker
from hpcps.training.workload import Workload, data_shape, workload_from_config

log = logging.getLogger("hpcps")

#: a tag nobody sends on: probing it only drives MPI progress
_PROGRESS_TAG = 99
#: receive buffers of a shard (and of a group server): the gradients it holds at once, whatever the worker count
RECEIVE_POOL = 2


@dataclass(frozen=True)
class RunResult:
    """What rank 0 returns.

    ``path``: the metrics file; ``summary``: its ``/summary``; ``steps``: iterations per
    worker; ``params``: the final flat vector (parameters, then float buffers);
    ``model``: the trained model (eval mode, on the CPU) and ``state_dict`` its state,
    a plain dict of tensors; ``metrics``: the final evaluation; ``saved``: where
    ``--save`` wrote the state_dict (None when nothing was saved).
    """

    path: str
    summary: dict[str, Any]
    steps: int
    params: np.ndarray
    model: torch.nn.Module
    state_dict: dict[str, torch.Tensor]
    metrics: dict[str, float]
    saved: str | None


def _per_epoch(cfg: TrainConfig, n_train: int | None, layout: Layout) -> int | None:
    if n_train is None:  # a batch factory, or the user's own loop: its epochs are its own
        if cfg.epochs is not None:
            raise UserError("--epochs needs a data set of known size; with a batch factory give --steps")
        return None
    n = batches_per_epoch(n_train, batch_size=cfg.batch_size, n_workers=layout.n_workers)
    if n < 1:
        share = n_train // layout.n_workers
        raise UserError(f"--batch-size {cfg.batch_size} is larger than a worker's share of the training set "
                        f"({share} samples for each of {layout.n_workers} workers)")
    return n


def _check_threads(cfg: TrainConfig) -> None:
    """Eager's helper thread pulls while the worker computes: MPI must allow calls from both threads."""
    if policy_class(cfg.paradigm).eager_pull and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise UserError(f"--paradigm {cfg.paradigm} needs MPI_THREAD_MULTIPLE (a helper thread pulls while the worker "
                        f"computes), but this MPI provides MPI_THREAD_{names.get(MPI.Query_thread(), '?')}: "
                        f"enable it in your MPI (e.g. MPICH_MAX_THREAD_SAFETY=multiple on Cray) and keep mpi4py's "
                        f"default thread level (MPI4PY_RC_THREAD_LEVEL=multiple)")


def _data_facts(source: DataSource | None) -> dict[str, Any]:
    """What every rank needs to know of the data, which only some ranks load (none: the user's own loop)."""
    if source is None:
        return {"name": "the user's own", "kind": "own loop", "n_train": None, "n_test": None,
                "in_shape": None, "n_classes": None}
    in_shape, n_classes = data_shape(source)
    return {"name": source.name, "kind": source.kind, "n_train": source.n_train, "n_test": source.n_test,
            "in_shape": in_shape, "n_classes": n_classes}


def default_out(paradigm: str) -> str:
    """``runs/<paradigm>-<timestamp>.h5``, or ``$HPCPS_RUN_DIR/metrics.h5`` in a job of ``hpcps jobs render``."""
    if os.environ.get("HPCPS_RUN_DIR"):
        return os.path.join(os.environ["HPCPS_RUN_DIR"], "metrics.h5")
    return os.path.join("runs", f"{paradigm}-{time.strftime('%Y%m%d-%H%M%S')}.h5")


def run_training(cfg: TrainConfig, comm: MPI.Comm, workload: Workload | None = None) -> RunResult | None:
    """Collective: train ``workload`` (default: the one ``cfg`` names) as ``cfg`` says on ``comm``;
    rank 0 returns the result, others None.

    Workers run the built-in loop (:meth:`hpcps.runtime.session.Session.train_on`), a client of the step
    API like the user's own loop; servers serve.
    """
    from hpcps.runtime.session import Session

    with open_run(cfg, comm, workload) as run:
        run.start()
        if run.topo.role is Role.WORKER:
            with Session(run) as session:
                session.train_on(run.batches, run.workload.loss)
                return session.close()
        run.serve()
        return run.end()


def _pull_at(window: ParamWindow, buf: np.ndarray, versions: list[int]) -> None:
    """Pull every shard's fp32 parameters into ``buf`` as published at ``versions`` (one per shard), pulling
    again while a shard has not published its yet (its publish, or rank 0's own, may have been deferred
    for a lapped reader): for a checkpoint, taken while no shard steps past those versions."""
    got, _ = window.pull(buf, Backoff(), exact=True)
    while got.tolist() != list(versions):
        window.publish_held()
        got, _ = window.pull(buf, Backoff(), exact=True)


def model_shape(model: torch.nn.Module) -> tuple:
    """What must be the same on every rank: the names and shapes of the model's parameters and buffers."""
    return (tuple((n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad),
            tuple((n, tuple(b.shape)) for n, b in model.named_buffers()))


def check_same_model(shapes: list[tuple]) -> None:
    """Every rank built the same model (``shapes``: :func:`model_shape` of each rank), or one line saying
    which ranks differ from rank 0 and where."""
    first = shapes[0]
    differ = [r for r, s in enumerate(shapes) if s != first]
    if not differ:
        return
    theirs = shapes[differ[0]]
    where = next((f"{a[0]} is {list(a[1])} on rank 0, {b[0]} {list(b[1])} on rank {differ[0]}"
                  for a, b in zip(first[0] + first[1], theirs[0] + theirs[1]) if a != b),
                 f"rank 0 has {len(first[0]) + len(first[1])} tensors, rank {differ[0]} "
                 f"{len(theirs[0]) + len(theirs[1])}")
    ranks = ", ".join(map(str, differ))
    raise UserError(f"the model differs between ranks: rank(s) {ranks} built another than rank 0 ({where}); "
                    f"build the same model on every rank (a factory must not depend on the rank)")


def open_run(cfg: TrainConfig, comm: MPI.Comm, workload: Workload | None = None) -> "_Run":
    """Collective: everything a run needs before it starts (roles, model, data, device, checkpoint to
    resume), as a :class:`_Run` to use in a ``with`` block (which frees what it holds).

    The run happens on a renumbered copy of ``comm`` (``--placement``, :mod:`hpcps.cluster.placement`): its
    ranks, in the metrics and the options that name ranks, are the run's; its rank 0 is ``comm``'s.
    """
    agree(comm, lambda: plan(cfg, comm.size))  # bad options fail before any placement
    stack = ExitStack()
    run_comm, world_ranks = place(comm, cfg.servers, cfg.placement)
    stack.callback(run_comm.Free)
    try:
        return _prepare(cfg, run_comm, workload, world_ranks, stack)
    except BaseException:
        stack.close()
        raise


def _prepare(cfg: TrainConfig, comm: MPI.Comm, workload: Workload | None, world_ranks: list[int],
             stack: ExitStack) -> "_Run":
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    layout = agree(comm, lambda: plan(cfg, comm.size))
    setup_logging(comm.rank, layout.role(comm.rank).value)
    if before != cfg.threads:  # the user's own setting (torch.set_num_threads, OMP_NUM_THREADS) is replaced
        log.info("torch threads per rank: %d, not %d (--threads / threads= sets it; one rank per core is the "
                 "usual layout)", cfg.threads, before)
    agree(comm, lambda: _check_threads(cfg))
    if workload is None:
        workload = agree(comm, lambda: workload_from_config(cfg))
    if workload.prepare is not None:  # once, on rank 0, before anyone loads (agree: everyone waits)
        agree(comm, lambda: workload.prepare() if comm.rank == 0 else None)
    loads_data = comm.rank == 0 or layout.role(comm.rank) is Role.WORKER  # workers train, rank 0 evaluates
    source = agree(comm, lambda: workload.data() if loads_data and workload.data is not None else None)
    facts = comm.bcast(agree(comm, lambda: _data_facts(source) if comm.rank == 0 else None), root=0)
    model = agree(comm, lambda: workload.build_model(seed=cfg.seed, in_shape=facts["in_shape"],
                                                     n_classes=facts["n_classes"], hidden=cfg.hidden))
    steps = steps_for(cfg, agree(comm, lambda: _per_epoch(cfg, facts["n_train"], layout)))
    device = _plan_device(cfg, comm, layout)
    devices = comm.allgather(device.describe())
    flat = FlatParameters(model, device.device, device.transfer)
    shapes = comm.allgather(model_shape(model))  # every rank's: a model that differs would train on garbage
    agree(comm, lambda: check_same_model(shapes))
    ckpt = agree(comm, lambda: _load_checkpoint(cfg, flat.size, layout)) if cfg.resume else None
    if ckpt is not None:
        flat.params[:] = ckpt.params
        flat.upload()
    if layout.role(comm.rank) is Role.WORKER:  # every worker its own random stream (dropout, the user's batches)
        index = layout.worker_index(comm.rank)
        torch.manual_seed(worker_seed(cfg.seed, index, int(ckpt.worker_clocks[index]) if ckpt is not None else 0))
    redeal = Redeal(tuple(int(c) for c in ckpt.written_clocks), int(ckpt.worker_clocks[0])) \
        if ckpt is not None and ckpt.redealt else None  # another worker count: the epochs' rest dealt again
    batches = agree(comm, lambda: source.for_worker(
        layout.worker_index(comm.rank), layout.n_workers, batch_size=cfg.batch_size, seed=cfg.seed,
        device=flat.device, steps=steps, redeal=redeal)
        if layout.role(comm.rank) is Role.WORKER and source is not None else None)
    if cfg.group_by == "speed" and layout.n_groups:
        layout = _group_by_speed(cfg, comm, layout, model, flat, batches, workload)
    topo = stack.enter_context(Topology(comm, layout))
    signals = stack.enter_context(StopSignals(announce(comm.rank)))
    return _Run(cfg, topo, workload, source, facts, batches, model, flat, steps, ckpt, devices, signals,
                world_ranks, stack)


#: how far apart the seeds of a resumed run's workers are from the first run's, per step done
RESUME_SEED_STRIDE = 1_000_003


def worker_seed(seed: int, worker_index: int, start_step: int = 0) -> int:
    """The seed of worker ``worker_index``'s torch random stream, drawn from after the model is built
    (every rank builds it right after ``torch.manual_seed(seed)``): ``seed + 1 + worker_index``, so no
    two workers draw the same dropout masks or batches, and none replays the model's initialisation;
    a run resumed at step ``start_step`` adds ``RESUME_SEED_STRIDE x start_step``, so it does not draw
    again what the first run drew from its start."""
    return seed + 1 + worker_index + RESUME_SEED_STRIDE * start_step


def _plan_device(cfg: TrainConfig, comm: MPI.Comm, layout: Layout) -> DevicePlan:
    """Collective: this rank's device (``--device``) and how its tensors reach MPI (``--cuda-aware``)."""
    local = node_local_index(comm, layout.worker_ranks())
    n_gpus = torch.cuda.device_count() if local is not None and cfg.device != "cpu" else 0
    plan = agree(comm, lambda: plan_device(
        cfg.device, cfg.cuda_aware, local, n_gpus,
        detect=lambda: detect_cuda_aware(MPI.Get_library_version(), os.environ, query_cuda_support())))
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
    return plan


def emulated_compute_time(cfg: TrainConfig, rank: int, layout: Layout) -> ComputeTime:
    """The emulated compute time of worker ``rank`` (``--compute-time``, its ``--slowdown``, ``--jitter``,
    ``--straggler-episodes``)."""
    return ComputeTime(cfg.compute_time, cfg.slowdown.get(rank, 1.0), cfg.jitter, cfg.jitter_cv,
                       episodes=cfg.straggler_episodes, worker=layout.worker_index(rank), n_workers=layout.n_workers)


def _group_by_speed(cfg: TrainConfig, comm: MPI.Comm, layout: Layout, model: torch.nn.Module,
                    flat: FlatParameters, batches, workload: Workload) -> Layout:
    """Collective: time every worker in a warm-up, then group the workers of similar speed."""
    mine = None
    if layout.role(comm.rank) is Role.WORKER:
        mine = measure_pass_time(model, flat, batches, workload.loss, rank=comm.rank, seed=cfg.seed,
                                 compute_time=emulated_compute_time(cfg, comm.rank, layout))
    times = gather_pass_times(comm, mine)
    members = speed_groups(times, layout.n_groups)
    if comm.rank == 0:
        log.info("groups by measured speed (warm-up, ms per pass): %s", "; ".join(
            ", ".join(f"{r}: {times[r] * 1e3:.1f}" for r in group) for group in members))
    return replace(layout, members=tuple(tuple(m) for m in members))


def _devices_summary(devices: list[str]) -> str:
    """``cpu (4 workers)`` or ``cuda:0, staged ... (2 workers); cuda:1, ... (2 workers)``: the log's device line."""
    counts = Counter(devices)
    return "; ".join(f"{d} ({n} worker{'s' if n > 1 else ''})" for d, n in counts.items())


def _load_checkpoint(cfg: TrainConfig, n_params: int, layout: Layout) -> Checkpoint:
    ckpt = read_checkpoint(cfg.resume, complete=True)
    check_compatible(ckpt, cfg.resume, cfg.as_json_dict(), n_params=n_params)
    if layout.n_workers != len(ckpt.worker_clocks) and layout.n_groups:
        raise UserError(f"--resume {cfg.resume}: grouped runs resume on their checkpoint's worker count "
                        f"({len(ckpt.worker_clocks)}), not {layout.n_workers}")
    return reshaped(ckpt, n_servers=layout.n_servers, n_workers=layout.n_workers,
                    stripe=stripe_elements(cfg.partition_mb))


class _Run:
    """The per-rank state of one run (built after the start-up checks passed)."""

    def __init__(self, cfg: TrainConfig, topo: Topology, workload: Workload, source: DataSource | None,
                 facts: dict[str, Any], batches, model: torch.nn.Module, flat: FlatParameters, steps: int,
                 ckpt: Checkpoint | None, devices: list[str], signals: StopSignals, world_ranks: list[int],
                 stack: ExitStack) -> None:
        self.stack = stack  # the run's communicators and signal handlers, released by __exit__
        self.ran: dict = {}  # rank 0: what ran (the optimizer and schedule), for the run file and checkpoints
        self.window: ParamWindow | None = None  # start() makes them; __exit__ frees what it made
        self.group_window: ParamWindow | None = None
        self.cfg, self.topo, self.model, self.flat, self.steps = cfg, topo, model, flat, steps
        self.workload, self.source, self.facts, self.batches = workload, source, facts, batches
        self.final_metrics: dict[str, float] = {}  # rank 0: the final evaluation
        self.ckpt = ckpt
        self.signals = signals
        self.world_ranks = world_ranks  # the launcher's rank of each of the run's ranks (--placement)
        self.ckpt_dir = cfg.checkpoint_dir or ""  # set in start(), once the metrics file is named
        self.final_version: int | None = None  # a shard: its version at the end
        self.final_clock: int | None = None  # a worker: the gradients it has pushed, resumed ones included
        self.diverged: str | None = None  # rank 0: why the run was found diverged (--divergence stop)
        self.optimizer: ShardOptimizer | None = None
        self.policy: Policy | None = None  # a central shard: its paradigm (state saved with a checkpoint)
        self.devices = devices  # per rank, as DevicePlan.describe() says
        self.layout = topo.layout
        # which values each central shard holds: contiguous blocks, striped with --partition-mb
        self.slices = Slices.plan(flat.size, flat.n_params, self.layout.n_servers, stripe_elements(cfg.partition_mb))
        self.codec = make_codec(cfg.compress)  # what moves on the wire (a worker's: with its top-k residual)
        self.groups = resolve_groups(model, workload.param_groups)  # checked at start-up (_prepare)
        self.shards = list(range(self.layout.n_servers))
        self.backoff = Backoff()
        self.run_clock = RunClock(time.perf_counter(), 0.0, 0.0)  # until the start: see run()

    def clock(self) -> float:
        """Seconds since the run's start, on rank 0's clock (hpcps.transport.clocksync)."""
        return self.run_clock()

    def __enter__(self) -> "_Run":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        """Free what the run holds. The windows (whose free is a barrier) only when every rank gets
        here: without an error, or with bad input (a UserError is raised on every rank alike, see
        hpcps.runtime.agree); after a failure on one rank the others are not coming, and MPI_Abort follows."""
        if kind is None or issubclass(kind, UserError):
            for window in (self.window, self.group_window):
                if window is not None:
                    window.free()  # idempotent: end() has freed them, unless start() was refused
            agree_module.last_words.clear()  # nothing to say: the run ended on every rank
        self.stack.close()

    def start(self) -> None:
        """Collective: the metrics file, the windows, the shards' optimizers; everyone meets, the clocks agree.

        Then each rank plays its role: :meth:`serve` (servers, group servers), or a worker's steps
        (:class:`hpcps.runtime.session.Session` over :meth:`make_worker`); and :meth:`end`, collective again.
        """
        comm, topo = self.topo.comm, self.topo
        path = comm.bcast(self.cfg.out or default_out(self.cfg.paradigm) if comm.rank == 0 else None, root=0)
        self.ckpt_dir = checkpoint_dir(self.cfg, path)
        runfile = agree(comm, lambda: self._open(path) if comm.rank == 0 else None)
        recorder = FileRecorder(topo.metrics, runfile) if comm.rank == 0 else ForwardingRecorder(topo.metrics)
        # an earlier run in this process that failed without ending it (exit_on_error=False) left its own
        agree_module.last_words.clear()
        if comm.rank != 0:  # a rank that fails sends rank 0 the rows it still holds before the job ends
            agree_module.last_words.append(recorder.flush)
        shard = comm.rank if topo.role is Role.SERVER else None
        window = ParamWindow(topo.ps, shard_ranks=self.shards, slices=self.slices,
                             local_len=self.slices.length(shard) if shard is not None else 0, codec=self.codec)
        self.window = window  # freed by __exit__ if start() goes no further
        group_window = None
        if topo.group != MPI.COMM_NULL:  # the group server (rank 0 of the group) exposes all parameters
            n = self.flat.size
            group_window = ParamWindow(topo.group, shard_ranks=[0], bounds=[(0, n)],
                                       local_len=n if topo.role is Role.GROUP else 0, codec=self.codec)
            self.group_window = group_window
        master = self.slices.take(shard, self.flat.params) if shard is not None else np.zeros(0, np.float32)
        if window.master is not None:  # a 16-bit window keeps the fp32 master weights (exact pulls read them)
            window.master[:] = master
            master = window.master
        optimizer = None
        if topo.role is Role.SERVER:
            # a resumed shard is at its checkpoint's version from its first publish: a worker's first pull
            # tags its gradient with it (with 0, the first gradients looked hundreds of versions stale)
            window.publish(master, self.ckpt.shard_version(comm.rank) if self.ckpt else 0)
            # before the start: torch's first optimizer imports torch._dynamo, which took 1.5-2.5 s here,
            # and every worker's first push waited for it
            optimizer = self.optimizer = self._shard_optimizer(master[:self._n_params(shard)], shard)
        # the rate the servers' optimizer has of its own (a factory's, or --lr): rows record rates applied
        self.rate = comm.bcast(optimizer.default_lr if comm.rank == 0 else None, root=0)
        if comm.rank == 0:
            self.ran = {"optimizer_ran": describe_optimizer(optimizer, self.groups),
                        "lr_schedule_values": self._schedule_samples(optimizer.schedule)}
            runfile.set_attrs(optimizer=json.dumps(self.ran["optimizer_ran"]),
                              lr_schedule_values=json.dumps(self.ran["lr_schedule_values"]))
        if self.ckpt is not None:
            agree(comm, lambda: check_same_optimizer(self.ckpt, self.cfg.resume, self.ran["optimizer_ran"],
                                                     optimizer.schedule) if comm.rank == 0 else None)
        if topo.role is Role.GROUP:  # before the start barrier, so no worker can pull an empty window
            # at the version the group server will be at: the lowest central shard's (a resumed run's too)
            start = min(self.ckpt.shard_version(s) for s in self.shards) if self.ckpt else 0
            group_window.publish(self.flat.params, start)
        if comm.rank == 0:
            f = self.facts
            sizes = [f"{f[k]} {what}" for k, what in (("n_train", "train"), ("n_test", "test")) if f[k] is not None]
            data = f"data {f['name']}" + (f" ({' / '.join(sizes)})" if sizes else "")
            log.info("%s on %s; model %s (%d parameters, %d buffer values), %s, %d steps per worker",
                     self.cfg.paradigm, self.layout.describe(), self.workload.model_name, self.flat.n_params,
                     self.flat.size - self.flat.n_params, data, self.steps)
            log.info("workers on %s", _devices_summary([self.devices[r] for r in self.layout.worker_ranks()]))
            for line in no_effect(self.cfg):  # once per run, on rank 0: the options nothing in this run reads
                log.warning(line)
            if self.ckpt is not None and self.ckpt.describe_shape():
                log.info("resuming %s on another shape: %s", self.cfg.resume, self.ckpt.describe_shape())
        # everyone is set up: nobody waits long in the sync; a start that never completes ends the job
        polite_barrier(comm, Backoff(cap=1e-4), StallWatch(
            warn=self.cfg.stall_warn, abort=self.cfg.stall_limit, log=log, error=RunAborted,
            describe=lambda: f"rank {comm.rank} waiting at the start for the other ranks"))
        self.run_clock = sync_clock(topo.ps, shares_clock_with_rank0(topo.ps, topo.node))
        self.path, self.runfile, self.recorder = path, runfile, recorder
        self.master = master

    def serve(self) -> None:
        """A server's or group server's part, until every worker has left."""
        topo, recorder = self.topo, self.recorder
        try:
            if topo.role is Role.SERVER:
                self._serve(self.window, self.master, self.optimizer, recorder)
            else:
                self._group_serve(self.window, self.group_window, recorder)
        except BaseException:
            if self.runfile is not None:  # keep what rank 0 has recorded before the job is aborted
                recorder.drain()
                recorder.flush()
                self.runfile.close()
            raise

    def end(self, loop: LoopState | None = None) -> RunResult | None:
        """Collective, once every rank's part is over: recorders closed, a checkpoint if a signal
        stopped the run (with ``loop``, worker 0's loop state), the summary; the result on rank 0."""
        comm, recorder, runfile, window, group_window = (self.topo.comm, self.recorder, self.runfile, self.window,
                                                         self.group_window)
        wall_s = self.clock()
        recorder.close(self.backoff)
        polite_barrier(comm, self.backoff)
        # a signal that a loop acted on; one that came after the last step (the final evaluation) stopped nothing
        stopped_by = next((s for s in comm.allgather(self.signals.acted) if s), None)
        saved_ckpt = self._checkpoint_at_stop(comm, loop) if stopped_by else None
        if stopped_by is None and comm.bcast(self.diverged is not None if comm.rank == 0 else None, root=0):
            stopped_by = "diverged"  # no checkpoint: nothing worth resuming
        ranks = comm.gather(self._resources(), root=0)  # after the barrier: nobody waits long
        # worker 0's integer buffers (BatchNorm's num_batches_tracked, counted on each rank) into the model saved
        ints = [i for i in comm.gather(loop.int_buffers if loop is not None else None, root=0) or [] if i]
        if ints:
            restore_int_buffers(self.model, ints[0])
        window.free()
        if group_window is not None:
            group_window.free()
        return self._finish(runfile, wall_s, self.path, ranks, stopped_by, saved_ckpt) if comm.rank == 0 else None

    def _checkpoint_at_stop(self, comm: MPI.Comm, loop: LoopState | None) -> str:
        """Collective: the checkpoint of a run a signal stopped (every pushed gradient applied by now).

        Each shard writes its optimizer state and rank 0 the final parameters
        (which its final evaluation pulled), every shard's version and every
        worker's clock: the gradients it pushed, where its resumed run starts.
        Returns the path (on every rank).
        """
        shard_versions = [v for v in comm.allgather(self.final_version) if v is not None]
        clocks = comm.gather((self.topo.rank, self.final_clock), root=0)
        path = checkpoint_path(self.ckpt_dir, shard_versions[0])
        if self.optimizer is not None:
            write_optimizer_state(path, self.topo.rank, self.optimizer.state_dict(),
                                  self.policy.state_dict() if self.policy is not None else None)
        if loop:  # worker 0's loop: its fields, its optimizer's hyperparameters, its integer buffers
            write_user_state(path, loop)
        if comm.rank == 0:
            worker_clocks = np.zeros(self.layout.n_workers, np.int64)
            for rank, clock in clocks:
                if clock is not None and self.layout.role(rank) is Role.WORKER:
                    worker_clocks[self.layout.worker_index(rank)] = clock
            write_checkpoint(path, self.flat.params, version=shard_versions[0], worker_clocks=worker_clocks,
                             config=self.ran_config(), n_servers=self.layout.n_servers,
                             shard_versions=shard_versions)
        polite_barrier(comm, self.backoff)  # every part is written before anyone says so
        return path

    def _resources(self) -> tuple:
        """This rank's ``/ranks`` row: role, host, peak resident memory, samples read from a streamed set,
        clock offset, device."""
        read = getattr(self.source, "samples_read", -1) if self.source is not None else 0
        return (self.topo.rank, self.topo.role.value.encode(), node_label(socket.gethostname()).encode()[:64],
                peak_rss_bytes(), read, self.run_clock.offset, self.run_clock.uncertainty,
                str(self.flat.device).encode()[:16])

    def _save_path(self, path: str) -> str:
        """``--save``, or the metrics file's name with ``.pt``."""
        return self.cfg.save or os.path.splitext(path)[0] + ".pt"

    def _open(self, path: str) -> RunFile:
        save = self._save_path(path)
        save_dir = os.path.dirname(os.path.abspath(save))
        try:  # refuse at the start, not after hours of training
            os.makedirs(save_dir, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--save {save}: cannot create its directory ({exc})") from None
        if not os.access(save_dir, os.W_OK):
            raise UserError(f"--save {save}: directory {save_dir} is not writable")
        try:
            return RunFile(path, {
                "hpcps_version": hpcps.__version__,
                "config": json.dumps(self.cfg.as_json_dict(), sort_keys=True),
                "paradigm": self.cfg.paradigm,
                "world_size": self.layout.world_size,
                "n_workers": self.layout.n_workers,
                "n_servers": self.layout.n_servers,
                "n_groups": self.layout.n_groups,
                "steps_per_worker": self.steps,
                "groups": json.dumps({self.layout.group_server_rank(g): members
                                      for g, members in enumerate(self.layout.group_members())}),
                "resumed_from": self.cfg.resume or "",
                "start_version": self.ckpt.version if self.ckpt else 0,
                "resumed_shape": self.ckpt.describe_shape() if self.ckpt else "",
                "mpi_library": library_version(),
                "devices": json.dumps(self.devices),
                "placement": json.dumps({"mode": self.cfg.placement, "world_rank_of": self.world_ranks}),
                "cluster": json.dumps(cluster_record() or {"emulated": False}),
                "dataset_kind": self.facts["kind"],
                "compress": json.dumps(self._wire_record()),
                "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            })
        except OSError as exc:
            raise UserError(f"--out {path}: cannot create the metrics file ({exc})") from None

    def _clients(self) -> list[int]:
        """The ranks that push to a central shard: the workers, or (grouped) the group servers."""
        layout = self.layout
        if layout.n_groups > 0:
            return [layout.group_server_rank(g) for g in range(layout.n_groups)]
        return list(layout.worker_ranks())

    def _n_params(self, shard: int) -> int:
        """Trainable values at the start of central shard ``shard``'s slice; the rest of it is buffers
        (BatchNorm statistics)."""
        return self.slices.trainable(shard, self.flat.n_params)

    def _serve(self, window: ParamWindow, master, optimizer: ShardOptimizer, recorder) -> None:
        topo, layout, cfg = self.topo, self.layout, self.cfg
        grouped = layout.n_groups > 0  # then the central shards' clients are the group servers
        workers = self._clients()
        notifier = Notifier(topo.ps, worker_ranks=workers)
        serial = policy_class(cfg.paradigm).serial_transfers and not grouped
        n_params = self._n_params(topo.rank)
        policy = make_policy(cfg.paradigm, len(workers), cfg.paradigm_option, staleness=cfg.s_lo,
                             staleness_max=cfg.s_hi)
        start_version = self.ckpt.shard_version(topo.rank) if self.ckpt else 0
        policy.resume_at(start_version)
        if self.ckpt is not None and not (self.ckpt.resharded or self.ckpt.redealt):
            # what the paradigm kept of its own (clocks, a controller's intervals); another shape starts it afresh
            policy.load_state_dict(read_policy_state(cfg.resume, topo.rank))
        self.policy = policy
        # paradigms that hold rounds (bsp, hsp) sum each as it arrives (hpcps.runtime.rounds): bsp in worker
        # order (reproducible), hsp in the order its serial transfers come; those and the ones that apply
        # every gradient on arrival receive into a pool of RECEIVE_POOL buffers, whatever the worker count;
        # any other (a plug-in that holds gradients) keeps one buffer per worker
        rounds = RoundSum(len(master), n_params, len(workers), policy.active, ordered=not serial) \
            if policy.holds_rounds and not grouped else None
        pooled = rounds is not None or policy.applies_on_arrival or grouped
        inbox = PushInbox(topo.ps, worker_ranks=workers, shard_len=self.codec.push_len(len(master)),
                          dtype=self.codec.push_dtype, clock=self.clock,
                          on_transfer=(lambda i: notifier.send(i, wire.TRANSFER)) if serial else None,
                          pool=RECEIVE_POOL if pooled else None,
                          reserve=rounds.expected if rounds and rounds.ordered else None,
                          pieces=self._send_pieces(self.codec)[topo.rank])
        side_tasks, bar, evaluator = [("other", self._spread_signal(window))], None, None
        side_tasks.append(("other", StateDesk(topo.ps, optimizer, len(master))))  # ps.optimizer's state
        if topo.rank == 0:
            # evaluate in a helper thread where the pull may run beside the loop (pinned window, THREAD_MULTIPLE)
            # (HPCPS_EVAL_BACKGROUND=0 forces the loop's thread: tools/bench_eval_latency.py compares both)
            background = (window.protocol == "pinned" and MPI.Query_thread() >= MPI.THREAD_MULTIPLE
                          and os.environ.get("HPCPS_EVAL_BACKGROUND", "1") != "0")
            evaluator = Evaluator(model=self.model, flat=self.flat,
                                  batches=self.source.test_batches(cfg.eval_batch_size) if self.source else None,
                                  evaluate=self.workload.evaluation(),
                                  pull=lambda out: window.pull(out, Backoff()), recorder=recorder,
                                  clock=self.clock, interval=cfg.eval_interval, target=cfg.stop_target,
                                  on_target=window.set_stop, background=background, log_every=cfg.log_every,
                                  every=cfg.eval_every, version=lambda: server.version)
            bar = Progress(len(workers) * self.steps, cfg.paradigm, enabled=cfg.progress, every=cfg.progress_every,
                           accuracy=lambda: evaluator.accuracy)
            side_tasks += [("metrics", recorder.drain), ("evaluate", evaluator.tick)]
            if cfg.divergence == "stop":
                recorder.watchers.setdefault("workers/iterations", []).append(self._divergence_watch(window))
                recorder.watchers.setdefault("servers/updates", []).append(self._nonfinite_start_watch(window))
        periodic = policy.periodic_cut() if cfg.checkpoint_every or cfg.checkpoint_interval else None
        # every bsp worker waits at a round's close: bsp checkpoints there, from the publish hook; the others
        # take a consistent cut while the run goes on (hpcps.runtime.snapshot)
        at_publish = periodic is not None and policy.checkpoints_at_publish()
        snapshots = None
        if periodic and not at_publish:
            snapshots = self._snapshots(window, optimizer, policy, RoundCut() if periodic == "rounds" else ClockCut())
            side_tasks.append(("checkpoint", snapshots.tick))
        server = ShardServer(
            shard=topo.rank, rank=topo.rank, policy=policy,
            table="groups/updates" if grouped else "servers/updates",
            inbox=inbox, notifier=notifier, window=window, master=master,
            optimizer=optimizer, n_params=n_params, unit_lr=cfg.lr,
            abort_on_nonfinite=cfg.nonfinite == "abort",
            version=start_version,
            stall_warn=cfg.stall_warn, stall_abort=cfg.stall_limit,
            on_published=self._checkpointer(window, optimizer, lambda: server.clocks) if at_publish else None,
            worker_ranks=workers, recorder=recorder, clock=self.clock,
            progress=lambda: topo.ps.Iprobe(source=MPI.ANY_SOURCE, tag=_PROGRESS_TAG),
            side_tasks=side_tasks, on_applied=bar.update if bar is not None else None, backoff=self.backoff,
            round_sum=rounds, timeline=self.timeline(recorder), codec=self.codec,
        )
        if self.ckpt is not None and not grouped:  # the clocks the workers resume at (one that ended stays there)
            server.clocks = [int(c) for c in self.ckpt.worker_clocks]
            server.gradients_applied = int(sum(server.clocks))  # where hsp's schedule resumes
        if snapshots is not None:
            snapshots.server, snapshots.last_version = server, start_version
        server.run()
        if snapshots is not None:
            snapshots.finish(self.backoff)  # a checkpoint under way completes; shard 0 says none follows
        self.final_version = server.version
        inbox.free()
        polite_barrier(topo.role_comm, self.backoff)  # every shard has published its final version
        if evaluator is not None:
            evaluator.pull = lambda out: window.pull(out, Backoff(), exact=True)  # the shards' fp32 masters
            evaluator.evaluate()  # also leaves the final global parameters and buffers in self.model
            self.final_metrics = evaluator.metrics
            bar.close()

    def _divergence_watch(self, window: ParamWindow):
        """Rank 0: the workers' rows as they arrive, checked for divergence (hpcps.training.divergence); once
        diverged, one line saying what to try, and every shard's stop flag up."""
        watch, cfg = DivergenceWatch(), self.cfg
        per_step = policy_class(cfg.paradigm).updates_per_step(len(self._clients()))
        rate = cfg.lr * self.lr_scale()

        def on_rows(rows: np.ndarray) -> None:
            reason = watch.observe(rows)
            if reason is None or self.diverged is not None:
                return
            self.diverged = reason
            opt = self.optimizer  # shard 0's: the rate a loop set through ps.optimizer, if it set one
            loop_lr = opt.recorded_lr if opt is not None and opt.recorded_lr != opt.default_lr else None
            if loop_lr is not None:
                how = (f"the loop set the rate to {loop_lr:g} in ps.optimizer's param groups (--lr {cfg.lr:g} is "
                       f"not the rate in force): try a smaller one there, or --clip-norm")
            elif per_step > 1 and cfg.lr_scaling == "none":
                how = (f"each worker's gradient is applied as its own update at --lr {cfg.lr:g} (--lr-scaling "
                       f"none), {per_step} updates per step of every worker: try --lr-scaling auto (--lr / "
                       f"{per_step} per update)")
            elif per_step > 1:
                how = (f"each worker's gradient is applied as its own update at {rate:g} (--lr {cfg.lr:g} / "
                       f"{per_step}): try a smaller --lr, --clip-norm, or a bounded paradigm (ssp, dssp)")
            else:
                how = f"one update per round at {rate:g} (--lr {cfg.lr:g}): try a smaller --lr, or --clip-norm"
            log.error("training diverged under %s: %s; %s, or --divergence ignore to train on; stopping",
                      cfg.paradigm, reason, how)
            window.set_stop()
        return on_rows

    def _nonfinite_start_watch(self, window: ParamWindow):
        """Rank 0: the shards' rows as they arrive; if the run's first gradients were all non-finite, one line
        saying so, and every shard's stop flag up (stopped by divergence: nothing worth resuming)."""
        watch = NonFiniteStart()

        def on_rows(rows: np.ndarray) -> None:
            reason = watch.observe(rows)
            if reason is None or self.diverged is not None:
                return
            self.diverged = reason
            log.error("training cannot start under %s: %s; stopping (--divergence ignore trains on)",
                      self.cfg.paradigm, reason)
            window.set_stop()
        return on_rows

    def _spread_signal(self, window: ParamWindow, own: ParamWindow | None = None):
        """A server's side task: a stop signal this rank received, or (a group server, ``own``) a stop one
        of its workers asked for, raises the stop flag of every shard of ``window``, once."""
        spread = False

        def task() -> None:
            nonlocal spread
            if spread:
                return
            if self.signals.take() or (own is not None and own.stop_raised()):
                window.request_stop()
                spread = True
        return task

    def _shard_optimizer(self, params: np.ndarray, shard: int) -> ShardOptimizer:
        """The optimizer of central shard ``shard``'s trainable values ``params``, cut into the run's param
        groups, its schedule over the run's updates, resumed state."""
        cfg = self.cfg
        groups = shard_groups(self.groups, self.slices.pieces[shard])
        optimizer = ShardOptimizer(torch.from_numpy(params), self.workload.optimizer_factory(cfg), lambda v: 1.0,
                                   groups=groups, indices=shard_group_indices(self.groups, self.slices.pieces[shard]))
        # the schedule's floor (--min-lr) is a rate, over the one the optimizer was built with
        optimizer.schedule = self.schedule(optimizer.default_lr or cfg.lr)
        if cfg.stale_momentum == "auto":
            optimizer.stale = StaleMomentum()
        if self.ckpt is not None and self.ckpt.resharded:
            optimizer.load_state_dict(self._resliced_optimizer_state(optimizer, shard))
        elif self.ckpt is not None:
            optimizer.load_state_dict(read_optimizer_state(cfg.resume, self.topo.rank))
        return optimizer

    def _resliced_optimizer_state(self, optimizer: ShardOptimizer, shard: int) -> dict:
        """This shard's optimizer state, cut from a checkpoint written by shards sliced otherwise (another
        count, or another stripe): each written shard's state laid over the flat vector, then cut at this
        shard's chunks (:mod:`hpcps.training.optstate`)."""
        cfg, ckpt, n_params, size = self.cfg, self.ckpt, self.flat.n_params, self.flat.size
        written = Slices.plan(size, n_params, ckpt.written_servers, ckpt.written_stripe)
        parts = []
        for s in range(written.n_shards):
            n = written.trainable(s, n_params)
            state = read_optimizer_state(cfg.resume, s) if n else {}
            spans = ShardOptimizer(torch.zeros(n), self.workload.optimizer_factory(cfg), lambda v: 1.0,
                                   groups=shard_groups(self.groups, written.pieces[s])).spans if state else []
            parts.append(from_shard(state, spans, written.length(s)))
        flat = join(parts, written.put, size)
        if optimizer.optimizer is None or not flat:
            return {}
        return to_shard(cut(flat, lambda v: self.slices.take(shard, v)), optimizer.spans, optimizer.state_dict())

    def schedule(self, base_lr: float) -> Schedule:
        """The learning-rate multiplier by server version: the user's, or ``--lr-schedule`` over the run's
        updates (down to ``--min-lr`` over the optimizer's own rate ``base_lr``)."""
        cfg = self.cfg
        return self.workload.lr_schedule or make_schedule(cfg.lr_schedule, horizon=self._horizon(),
                                                          warmup=cfg.warmup_steps,
                                                          step_every=cfg.lr_step_every, gamma=cfg.lr_gamma,
                                                          floor=(cfg.min_lr or 0.0) / base_lr)

    def ran_config(self) -> dict:
        """What checkpoints record of the run (rank 0): its options and what ran (the optimizer, the schedule)."""
        return {**self.cfg.as_json_dict(), **self.ran}

    def lr_scale(self, extra: bool = False) -> float:
        """What a gradient's learning rate is multiplied by under ``--lr-scaling`` (the paradigm's
        :meth:`~hpcps.policies.base.Policy.lr_scale`; 1 under ``none``); ``extra``: an extra gradient's."""
        if self.cfg.lr_scaling == "none":
            return 1.0
        return policy_class(self.cfg.paradigm).lr_scale(len(self._clients()), extra=extra)

    def _horizon(self) -> int:
        """The updates a central shard applies over the run (its last version): the schedules' horizon."""
        return self.steps * policy_class(self.cfg.paradigm).updates_per_step(len(self._clients()))

    def _schedule_samples(self, schedule: Schedule) -> list[list[float]]:
        """``[version, multiplier]`` at 9 versions over the run: what the run file and checkpoints record of
        the schedule in force (a resumed run must have the same)."""
        horizon = self._horizon()
        return [[v, float(schedule(v))] for v in sorted({int(horizon * k / 8) for k in range(9)})]

    def _group_serve(self, central: ParamWindow, window: ParamWindow, recorder) -> None:
        """A group server: BSP over its group (on the group communicator), a client of the central shards."""
        topo, cfg, n = self.topo, self.cfg, self.flat.size
        members = self.layout.group_members()[self.layout.group_of(topo.rank)]
        local = list(range(1, topo.group.size))  # the workers' ranks in the group communicator
        agg = np.zeros(n, np.float32)
        # the round's update goes to the central shards as the wire carries it (--compress), with this group
        # server's own top-k residual; its workers push to it, and pull from its window, the same way
        # (in the central shards' wire order when their slices are striped)
        codec, encode = make_codec(cfg.compress), None
        bounds = self.slices.wire_bounds
        send = agg if codec.identity_push and not self.slices.striped else codec.new_push_buffer(bounds)
        if send is not agg:
            stage = self._stager(codec, torch.from_numpy(agg), bounds, striped=self.slices.striped)
            encode = lambda: stage(send, True)  # noqa: E731
        central_pusher = Pusher(topo.ps, buffers=[send], shard_ranks=self.shards,
                                bounds=codec.push_bounds(bounds), worker_rank=topo.rank,
                                pieces=self._send_pieces(codec, wire_order=True))
        central_notices = NoticeBox(topo.ps, shard_ranks=self.shards)
        policy = make_policy(policy_class(cfg.paradigm).group_policy, len(members))
        rounds = RoundSum(n, self.flat.n_params, len(members), policy.active)  # the group's rounds, summed
        inbox = PushInbox(topo.group, worker_ranks=local, shard_len=self.codec.push_len(n), pool=RECEIVE_POOL,
                          reserve=rounds.expected, dtype=self.codec.push_dtype)
        GroupServer(
            shard=0, rank=topo.rank, policy=policy, round_sum=rounds,
            inbox=inbox, notifier=Notifier(topo.group, worker_ranks=local), window=window,
            master=window.master if window.master is not None else np.zeros(n, np.float32),
            n_params=self.flat.n_params, unit_lr=cfg.lr, codec=self.codec, encode=encode,
            worker_ranks=members, recorder=recorder, clock=self.clock,
            progress=lambda: topo.group.Iprobe(source=MPI.ANY_SOURCE, tag=_PROGRESS_TAG),
            abort_on_nonfinite=cfg.nonfinite == "abort", stall_warn=cfg.stall_warn, stall_abort=cfg.stall_limit,
            backoff=self.backoff, central_pusher=central_pusher, central_notices=central_notices,
            side_tasks=[("other", self._spread_signal(central, own=window))],
            central_window=central, agg=agg, weight=len(members) * self.layout.n_groups / self.layout.n_workers,
            central_rate=self.rate, central_schedule=self.schedule(self.rate),
            timeline=self.timeline(recorder),
        ).run()
        inbox.free()
        central_pusher.free()
        central_notices.free()

    def make_worker(self) -> Worker:
        """This worker rank's :class:`~hpcps.runtime.worker.Worker` of the paradigm (its transfers freed by
        :meth:`free_worker`)."""
        topo, cfg, recorder, window = self.topo, self.cfg, self.recorder, self.group_window or self.window
        policy = policy_class(cfg.paradigm)
        codec = self.codec
        grouped = topo.group != MPI.COMM_NULL  # then it pushes to its group server
        bounds = self._push_slices()
        striped = self.slices.striped and not grouped  # then the push leaves in the shards' wire order
        new_buffer = self.flat.new_push_buffer if codec.identity_push else lambda: codec.new_push_buffer(bounds)
        extra, buffers = {}, [self.flat.push_grads if codec.identity_push and not striped else new_buffer()]
        timeline = self.timeline(recorder)
        if cfg.partition_mb:  # (on a GPU, each partition goes up to the device as it comes)
            extra["partitions"] = PartitionedPulls(
                self.model, self.flat._spans, stripe_elements(cfg.partition_mb), timeline=timeline,
                upload=None if self.flat.transfer == "shared" else self.flat.upload_ranges)
        # pushes from a copy, so that a push leaves while the next pass computes: eager and hsp compute
        # while they wait; a partitioned pull's pass begins while the pull (and the push) are in flight
        if policy.eager_pull or policy.extra_gradients or "partitions" in extra:
            buffers = extra["send_buffers"] = [new_buffer() for _ in range(2)]
        if striped or not codec.identity_push:  # reordered, encoded (hpcps.transport.compress) into the push buffer
            stage = self._stager(codec, self.flat.grads_t, bounds, striped=striped)
            extra["stage"] = lambda out, keep: (stage(out, keep), self.flat.synchronize())
        if policy.eager_pull:
            extra["bound"] = cfg.staleness  # None: never wait for fresher parameters
        if policy.extra_gradients:
            extra["max_extra"] = cfg.hsp_max_stale
            extra["extra_scale"] = self.lr_scale(extra=True) / self.lr_scale()
        # grouped: talk to the group server, rank 0 of the group communicator
        comm, shards = (topo.group, [0]) if grouped else (topo.ps, self.shards)
        pusher = Pusher(comm, buffers=buffers, shard_ranks=shards, bounds=codec.push_bounds(bounds),
                        worker_rank=topo.rank, serial=policy.serial_transfers,
                        pieces=None if grouped else self._send_pieces(codec, wire_order=True))
        notices = NoticeBox(comm, shard_ranks=shards)
        if self._pushes_during_backward(policy, striped, bool(extra.get("send_buffers"))):
            extra["backward_pushes"] = BackwardPushes(
                self.model, self.flat._spans,
                order=[self.slices.send_order(s, self.flat.n_params) for s in range(self.slices.n_shards)],
                bases=[w for w, _ in self.slices.wire_bounds], n_params=self.flat.n_params, grads=self.flat.grads,
                buffers=buffers, send=pusher.start_piece)
        worker_class = EagerWorker if policy.eager_pull else HSPWorker if policy.extra_gradients else Worker
        self.model.train()
        self._transfers = (pusher, notices)
        return worker_class(rank=topo.rank, model=self.model, flat=self.flat,
                     window=window, pusher=pusher, notices=notices,
                     blocks=policy.worker_blocks, recorder=recorder,
                     clock=self.clock, steps=self.steps, lr=cfg.lr * self.lr_scale(),
                     lr_staleness=cfg.lr_staleness or policy.default_lr_staleness,
                     faults=[f for f in cfg.faults if f.rank == topo.rank],
                     start_step=int(self.ckpt.worker_clocks[self.layout.worker_index(topo.rank)]) if self.ckpt else 0,
                     stall_warn=cfg.stall_warn, stall_abort=cfg.stall_limit,
                     backoff=self.backoff, take_signal=self.signals.take, timeline=timeline,
                     overflow=codec.overflow, **extra)

    def _push_slices(self) -> list[tuple[int, int]]:
        """The slices of a worker's push buffer, one per shard (the shards' wire order,
        :mod:`hpcps.cluster.slices`), or (grouped) the whole flat vector, for its group server."""
        return [(0, self.flat.size)] if self.layout.n_groups else self.slices.wire_bounds

    def _pushes_during_backward(self, policy, striped: bool, slotted: bool) -> bool:
        """Whether a worker pushes each piece of its gradient as backward produces it (in hpcps's own loop,
        :mod:`hpcps.runtime.backward`): its push goes in pieces (striped slices), from a copy, unencoded,
        unclipped, from a CPU worker's flat buffer, under a paradigm that waits for its grant (and whose
        learning rate is known before the pass)."""
        cfg = self.cfg
        return (striped and slotted and self.codec.identity_push and cfg.clip_norm is None
                and self.flat.transfer == "shared" and policy.worker_blocks and not policy.serial_transfers
                and not policy.eager_pull and not policy.extra_gradients
                and (cfg.lr_staleness or policy.default_lr_staleness) == "none")

    def _send_pieces(self, codec, *, wire_order: bool = False) -> list[list[tuple[int, int]]]:
        """Per central shard, the ranges of a push to it, one message each, in the order they are sent
        (:meth:`hpcps.cluster.slices.Slices.send_order`): in the shard's own slice, or (``wire_order``) in
        a client's push buffer. An encoded push (``--compress``) goes whole."""
        wire_bounds = codec.push_bounds(self.slices.wire_bounds)
        out = []
        for s, (w, end) in enumerate(wire_bounds):
            base = w if wire_order else 0
            order = self.slices.send_order(s, self.flat.n_params)
            out.append([(base + at, base + at + hi - lo) for at, lo, hi in order]
                       if codec.identity_push else [(base, base + end - w)])
        return out

    def _stager(self, codec, grads: torch.Tensor, bounds: list[tuple[int, int]], *,
                striped: bool) -> Callable[[Any, bool], None]:
        """``stage(out, keep)``: put the flat-order gradient ``grads`` into push buffer ``out`` (cut at
        ``bounds``) as the wire carries it: in the central shards' wire order where their slices are
        striped, encoded under ``--compress`` (``keep``: the gradient is to be applied, see
        hpcps.transport.compress)."""
        if codec.identity_push:
            return lambda out, keep: self.slices.gather(grads, out)
        if not striped:
            return lambda out, keep: codec.encode(grads, out, bounds, keep=keep)
        ordered = torch.empty_like(grads)

        def stage(out, keep: bool) -> None:
            self.slices.gather(grads, ordered)
            codec.encode(ordered, out, bounds, keep=keep)
        return stage

    def _wire_record(self) -> dict:
        """What one push and one pull move (payload bytes, all shards together), for the run file."""
        codec = self.codec
        push = codec.push_bounds(self._push_slices())[-1][1] * codec.push_dtype.itemsize
        return {**codec.describe(), "push_bytes": push, "pull_bytes": self.flat.size * codec.pull_dtype.itemsize,
                "fp32_bytes": 4 * self.flat.size}

    def timeline(self, recorder) -> Timeline | NullTimeline:
        """Where this rank's phases go: ``/timeline`` under ``--timeline``, nowhere otherwise."""
        return Timeline(self.topo.rank, recorder.add, self.clock) if self.cfg.timeline else NullTimeline()

    def free_worker(self, worker: Worker) -> None:
        """After the worker left: note the gradients it pushed, free its transfers."""
        self.final_clock = worker.clock_count
        worker.close()
        for transfer in self._transfers:
            transfer.free()

    def _snapshots(self, window: ParamWindow, optimizer: ShardOptimizer, policy: Policy,
                   cut: ClockCut | RoundCut) -> Snapshots:
        """This shard's side of the periodic checkpoints taken as a consistent cut (:mod:`hpcps.runtime.snapshot`):
        its part is its optimizer and paradigm state; shard 0 also reads every shard's parameters at the
        cut's versions and writes the checkpoint."""
        cfg, rank = self.cfg, self.topo.rank

        def write_part(path: str) -> None:
            write_optimizer_state(path, rank, optimizer.state_dict(), policy.state_dict())

        def write_main(staging: str, cut_clocks: list[int], versions: list[int]) -> str:
            clocks = self._worker_clocks_at(cut_clocks)
            buf = np.empty(self.flat.size, np.float32)
            _pull_at(window, buf, versions)
            path = checkpoint_path(self.ckpt_dir, versions[0])
            for shard in range(self.layout.n_servers):  # the parts beside it; the main file last, so a
                os.replace(optimizer_state_path(staging, shard), optimizer_state_path(path, shard))  # whole one
            write_checkpoint(path, buf, version=versions[0], worker_clocks=clocks, config=self.ran_config(),
                             n_servers=self.layout.n_servers, shard_versions=versions)
            return path

        def discard(staging: str) -> None:
            for shard in range(self.layout.n_servers):
                with suppress(FileNotFoundError):
                    os.remove(optimizer_state_path(staging, shard))

        return Snapshots(self.topo.role_comm, every=cfg.checkpoint_every, interval=cfg.checkpoint_interval,
                         write_part=write_part, write_main=write_main, discard=discard, cut=cut,
                         path_for=lambda epoch: os.path.join(self.ckpt_dir, f"cut-{epoch:06d}.h5"))

    def _worker_clocks_at(self, cut: list[int]) -> list[int]:
        """Each worker's clock at a cut of the central shards' clients' clocks: the workers' own, or
        (grouped) each group's rounds of this run after its members' clock at the start. A group's round in
        progress at the group server is not in the cut: its members push it again on resume."""
        layout = self.layout
        if not layout.n_groups:
            return list(cut)
        clocks = [0] * layout.n_workers
        for g, members in enumerate(layout.group_members()):
            for rank in members:
                w = layout.worker_index(rank)
                clocks[w] = int(cut[g]) + (int(self.ckpt.worker_clocks[w]) if self.ckpt is not None else 0)
        return clocks

    def _checkpointer(self, window: ParamWindow, optimizer: ShardOptimizer, clocks: Callable[[], list[int]]):
        """Every shard's ``on_published``: every ``--checkpoint-every`` versions, checkpoint.

        Each shard writes its optimizer state; rank 0 also snapshots all
        shards' parameters, and each worker's clock as its shard knows it
        (``clocks()``: the gradients it pushed; a worker that left early
        stays at its last). Called after the shard published version v and
        before it grants anyone, so under BSP every worker is blocked and
        every other shard is at v or about to be (its round-v pushes are in
        flight): rank 0 pulls until all are at v.
        """
        cfg, rank = self.cfg, self.topo.rank
        buf = np.empty(self.flat.size, np.float32) if rank == 0 else None

        def on_published(version: int) -> None:
            if version % cfg.checkpoint_every:
                return
            path = checkpoint_path(self.ckpt_dir, version)
            write_optimizer_state(path, rank, optimizer.state_dict())
            if rank != 0:
                return
            _pull_at(window, buf, [version] * self.layout.n_servers)
            write_checkpoint(path, buf, version=version, worker_clocks=list(clocks()),
                             config=self.ran_config(), n_servers=self.layout.n_servers)
            log.info("checkpoint of version %d written to %s", version, path)

        return on_published

    def _finish(self, runfile: RunFile, wall_s: float, path: str, ranks: list[tuple], stopped_by: str | None,
                saved_ckpt: str | None) -> RunResult:
        runfile.append("ranks", np.array(ranks, dtype=RANK))
        iterations = runfile.read("workers/iterations")
        summary = summarize(iterations, runfile.read("servers/updates"),
                            runfile.read("eval"), wall_s=wall_s, target=self.cfg.stop_target,
                            eval_metrics=runfile.read("eval_metrics"))
        summary.update(stopped_by=stopped_by or "", interrupted=stopped_by == "SIGINT", checkpoint=saved_ckpt or "")
        runfile.write_summary(summary)
        self.model.eval()  # as evaluated and saved, also when there was nothing to evaluate on
        state = plain_state_dict(self.model)
        saved = save_model(state, self._save_path(path))
        runfile.set_attrs(saved_model=saved or "")
        runfile.close()
        final = ", ".join(f"{k} {v:.4f}" for k, v in self.final_metrics.items() if not math.isnan(v))
        reached = (int(iterations["step"].max()) + 1 if len(iterations) else
                   int(max(self.ckpt.worker_clocks)) if self.ckpt is not None else 0)
        log.info("done in %.1f s after %d of %d steps: %s%d of %d gradients applied; metrics in %s%s",
                 summary["wall_s"], reached, self.steps, f"final evaluation {final}; " if final else "",
                 summary["gradients_applied"], summary["gradients_pushed"], runfile.path,
                 f", model in {saved}" if saved else "")
        if stopped_by == "diverged":
            log.warning("stopped because the training diverged: %s", self.diverged)
        elif stopped_by:
            log.warning("stopped by %s before the end: checkpoint written, continue with --resume %s",
                        stopped_by, saved_ckpt)
        return RunResult(runfile.path, summary, self.steps, self.flat.params.copy(), self.model.cpu(), state,
                         self.final_metrics, saved)


def checkpoint_dir(cfg: TrainConfig, metrics_path: str) -> str:
    """``--checkpoint-dir``, else the run's own: ``$HPCPS_RUN_DIR/checkpoints`` in a job of ``hpcps jobs
    render``, else beside the metrics file (``runs/bsp-<time>-checkpoints``), never shared by two runs."""
    if cfg.checkpoint_dir:
        return cfg.checkpoint_dir
    if os.environ.get("HPCPS_RUN_DIR"):
        return os.path.join(os.environ["HPCPS_RUN_DIR"], "checkpoints")
    return os.path.splitext(metrics_path)[0] + "-checkpoints"


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state on the CPU as plain ``load_state_dict`` takes it into the model's uncompiled
    class: ``torch.compile`` puts ``_orig_mod.`` in the keys of what it compiled, which is dropped."""
    return {k.replace("_orig_mod.", ""): v.detach().cpu().clone() for k, v in model.state_dict().items()}


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def save_model(state: dict[str, torch.Tensor], path: str) -> str | None:
    """Write ``state`` for plain ``torch.load`` (atomically: a temporary file, then a rename); return the
    path, or None (with a warning) if it cannot be written: the run's metrics are already safe."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    except OSError as exc:
        log.warning("--save %s: cannot write the model (%s)", path, exc)
        return None
    return path
