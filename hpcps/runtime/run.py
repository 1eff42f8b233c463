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

import hashlib
import json
import logging
import math
import os
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from hpcps.runtime import agree as agree_module
from hpcps.runtime import assembly, records
from hpcps.runtime.checkpoints import schedule as checkpointing
from hpcps.training import rates
from hpcps.runtime.agree import agree, meet
from hpcps.data.batches import DataSource
from hpcps.runtime.checkpoints.files import (Checkpoint, LoopState, check_compatible, check_same_optimizer,
                                             for_paradigm, read_checkpoint, reshaped, restore_int_buffers)
from hpcps.options.config import TrainConfig, steps_for
from hpcps.data.sharding import Redeal, batches_per_epoch
from hpcps.cluster.device import DevicePlan, detect_cuda_aware, plan_device
from hpcps.runtime import residence
from hpcps.cluster.emulation import emulated_compute_time
from hpcps.options.effects import no_effect
from hpcps.errors import RunAborted, UserError
from hpcps.training.flat import FlatParameters
from hpcps.cluster.grouping import speed_groups
from hpcps.cluster.layout import Layout, Role
from hpcps.cluster.slices import Slices, stripe_elements
from hpcps.cluster.placement import node_ids, place
from hpcps.metrics.board import check_installed
from hpcps.check.probe import link_between_nodes
from hpcps.options.defaults import describe as describe_defaults, needs_link, settle_layout, settle_transfers
from hpcps.options.planning import resolve
from hpcps.log import setup_logging
from hpcps.metrics.recorder import FileRecorder, ForwardingRecorder
from hpcps.metrics.runfile import RunFile
from hpcps.metrics.schema import RANK, summarize
from hpcps.training.optim import describe_optimizer, warm_optimizers
from hpcps.training.paramgroups import group_breaks, resolve_groups
from hpcps.policies import Policy
from hpcps.policies.registry import policy_class
from hpcps.runtime.faults import mark_launch
from hpcps.runtime.signals import StopSignals, announce
from hpcps.runtime import respawn
from hpcps.runtime.spares import wait_for_place
from hpcps.cluster.topology import Topology, node_local_index
from hpcps.transport.compress import make_codec
from hpcps.transport.failures import DeadRanks, left_out, part_ways, ulfm_enabled
from hpcps.transport.mpilib import query_cuda_support
from hpcps.transport.clocksync import shares_clock_with_rank0, sync_clock
from hpcps.transport.poll import Backoff, StallWatch, clear_signal, polite_barrier, watch_every_wait
from hpcps.transport.window import ParamWindow
from hpcps.runtime.plan import Leg, RunPlan, RunState
from hpcps.runtime.warmup import gather_pass_times, measure_pass_time
from hpcps.training.workload import Workload, data_shape, workload_from_config

log = logging.getLogger("hpcps")


@dataclass(frozen=True)
class RunResult:
    """What rank 0 returns.

    ``path``: the metrics file; ``summary``: its ``/summary``; ``steps``: iterations per
    worker; ``params``: the final flat vector (parameters, then float buffers);
    ``model``: the trained model (eval mode, on the CPU) and ``state_dict`` its state,
    a plain dict of tensors; ``metrics``: the final evaluation; ``saved``: where
    ``--save`` wrote the state_dict (None when nothing was saved); ``earlier``: the
    run files of the parts before this one of a run a death stopped and a newcomer
    resumed (``--respawn``), first first.
    """

    path: str
    summary: dict[str, Any]
    steps: int
    params: np.ndarray
    model: torch.nn.Module
    state_dict: dict[str, torch.Tensor]
    metrics: dict[str, float]
    saved: str | None
    earlier: tuple[str, ...] = ()


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


def _check_threads(cfg: TrainConfig, paradigm: type[Policy]) -> None:
    """Eager's helper thread pulls while the worker computes: MPI must allow calls from both threads."""
    if paradigm.eager_pull and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise UserError(f"--paradigm {cfg.paradigm} needs MPI_THREAD_MULTIPLE (a helper thread pulls while the worker "
                        f"computes), but this MPI provides MPI_THREAD_{names.get(MPI.Query_thread(), '?')}: "
                        f"enable it in your MPI (e.g. MPICH_MAX_THREAD_SAFETY=multiple on Cray) and keep mpi4py's "
                        f"default thread level (MPI4PY_RC_THREAD_LEVEL=multiple)")


def _check_start(cfg: TrainConfig, steps: int, start_iteration: int) -> None:
    """Where a loop that resumes itself may start: within its steps, not beside a checkpoint of hpcps's, and
    not under --local-steps (whose rounds would have to resume mid-round)."""
    if start_iteration == 0:
        return
    if isinstance(start_iteration, bool) or not isinstance(start_iteration, int) or not 0 < start_iteration < steps:
        raise UserError(f"start_iteration: {start_iteration!r} is not an iteration before the last of the run's "
                        f"{steps} steps")
    if cfg.resume:
        raise UserError("start_iteration: a run resumed from hpcps's checkpoint (resume=) starts where it was; "
                        "start_iteration is for a loop that resumes from a checkpoint of its own")
    if cfg.inner_steps is not None:
        raise UserError("start_iteration: not under --local-steps yet (its rounds would resume mid-round); "
                        "resume with hpcps's checkpoints (checkpoint_every=, resume=)")


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


def run_training(cfg: TrainConfig, comm: MPI.Comm, workload: Workload | None = None, *,
                 leg: Leg | None = None) -> RunResult | None:
    """Collective: train ``workload`` (default: the one ``cfg`` names) as ``cfg`` says on ``comm``;
    rank 0 returns the result, others None. ``leg``: the run is one leg of a longer training (:class:`Leg`).

    Workers run the built-in loop (:meth:`hpcps.runtime.session.Session.train_on`), a client of the step
    API like the user's own loop; servers serve.
    """
    from hpcps.runtime.session import Session

    with open_run(cfg, comm, workload, leg=leg) as run:
        run.start()
        if run.topo.role is Role.SPARE and not run.wait_for_place():
            return run.end()  # the run needed no spare
        if run.index is not None:  # a worker, or a spare in a dead worker's place
            with Session(run) as session:
                session.train_on(run.state.batches, run.plan.workload.loss)
                return session.close()
        run.serve()
        return run.end()


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


def open_run(cfg: TrainConfig, comm: MPI.Comm, workload: Workload | None = None, *, reseed: bool = True,
             start_iteration: int = 0, leg: Leg | None = None) -> "Run":
    """Collective: everything a run needs before it starts (roles, model, data, device, checkpoint to
    resume), as a :class:`Run` to use in a ``with`` block (which frees what it holds). ``reseed``: each
    worker's torch random stream its own after the model is built (:func:`worker_seed`); False keeps the
    stream the script's seeding gives (said where every worker would draw alike: :func:`_same_streams`).
    ``start_iteration``: where a loop that resumes itself starts (:attr:`RunPlan.start_iteration`);
    ``leg``: the run is one leg of a longer training (:class:`~hpcps.runtime.plan.Leg`).

    The run happens on a renumbered copy of ``comm`` (``--placement``, :mod:`hpcps.cluster.placement`): its
    ranks, in the metrics and the options that name ranks, are the run's; its rank 0 is ``comm``'s.
    """
    nodes = node_ids(comm)
    given = cfg
    # --servers auto made concrete, from the nodes the ranks are on (hpcps.options.defaults)
    cfg = agree(comm, lambda: settle_layout(cfg, nodes))
    # bad options fail before any placement (or the link's probe); the run's copy of comm has its size
    paradigm, layout = agree(comm, lambda: resolve(cfg, comm.size))
    measured = leg.link_bps if leg is not None else None  # (once for every leg of a training)
    link_bps = (measured or link_between_nodes(comm, nodes)) if needs_link(cfg, nodes) else None
    stack = ExitStack()
    run_comm, world_ranks = place(comm, cfg.servers, cfg.placement, nodes)
    stack.callback(run_comm.Free)
    try:
        return _prepare(cfg, run_comm, workload, world_ranks, stack, paradigm, layout, reseed=reseed,
                        start_iteration=start_iteration, spans_nodes=len(set(nodes)) > 1, link_bps=link_bps,
                        given=given, leg=leg)
    except BaseException:
        stack.close()
        raise


def _prepare(cfg: TrainConfig, comm: MPI.Comm, workload: Workload | None, world_ranks: list[int],
             stack: ExitStack, paradigm: type[Policy], layout: Layout, *, reseed: bool = True,
             start_iteration: int = 0, spans_nodes: bool = False, link_bps: float | None = None,
             given: TrainConfig | None = None, leg: Leg | None = None) -> "Run":
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    setup_logging(comm.rank, layout.role(comm.rank).value)
    if cfg.resume == "auto":  # rank 0 looks, every rank resumes what it found
        cfg = comm.bcast(agree(comm, lambda: checkpointing.resolve_resume(cfg) if comm.rank == 0 else None), root=0)
    if before != cfg.threads:  # the user's own setting (torch.set_num_threads, OMP_NUM_THREADS) is replaced
        log.info("torch threads per rank: %d, not %d (--threads / threads= sets it; one rank per core is the "
                 "usual layout)", cfg.threads, before)
    agree(comm, lambda: _check_threads(cfg, paradigm))
    if workload is None:
        workload = agree(comm, lambda: workload_from_config(cfg))
    if workload.prepare is not None:  # once, on rank 0, before anyone loads (agree: everyone waits)
        agree(comm, lambda: workload.prepare() if comm.rank == 0 else None)
    # workers train (and spares, once in a dead worker's place); rank 0 evaluates
    loads_data = comm.rank == 0 or layout.role(comm.rank) in (Role.WORKER, Role.SPARE)
    source = agree(comm, lambda: workload.data() if loads_data and workload.data is not None else None)
    facts = comm.bcast(agree(comm, lambda: _data_facts(source) if comm.rank == 0 else None), root=0)
    model = agree(comm, lambda: workload.build_model(seed=cfg.seed, in_shape=facts["in_shape"],
                                                     n_classes=facts["n_classes"], hidden=cfg.hidden))
    total = steps_for(cfg, agree(comm, lambda: _per_epoch(cfg, facts["n_train"], layout)))
    steps = min(leg.steps, total) if leg is not None and leg.steps is not None else total  # (a leg stops short)
    agree(comm, lambda: _check_start(cfg, steps, start_iteration))
    if cfg.tensorboard:
        agree(comm, lambda: check_installed() if comm.rank == 0 else None)
    device = _plan_device(cfg, comm, layout)
    slice_device = _slice_device(cfg, comm, layout)
    slice_devices = comm.allgather(None if slice_device is None else
                                   residence.DeviceSlice.describe_device(slice_device))
    devices = [said if where is None else f"{said}; slice on {where}"
               for said, where in zip(comm.allgather(device.describe()), slice_devices)]
    flat = FlatParameters(model, device.device, device.transfer)
    shapes = comm.allgather(model_shape(model))  # every rank's: a model that differs would train on garbage
    agree(comm, lambda: check_same_model(shapes))
    # --pull auto and --partition-mb auto made concrete, alike on every rank: from the model, the link and where
    # the workers compute
    cfg = settle_transfers(cfg, paradigm, flat.size * flat.params.itemsize, spans_nodes,
                           all(devices[r].startswith("cpu") for r in layout.training_ranks()), link_bps)
    chose = describe_defaults(given, cfg, link_bps) if comm.rank == 0 and given is not None else None
    if chose:
        log.info("%s", chose)
    stripe = stripe_elements(cfg.partition_mb)  # the one place --partition-mb becomes a stripe
    if workload.given_model:  # built by each rank's script, as DDP takes it: rank 0's parameters start the run
        comm.Bcast(flat.params, root=0)
        flat.upload()
    ckpt = agree(comm, lambda: _load_checkpoint(cfg, flat.size, layout, stripe, paradigm if leg else None)) \
        if cfg.resume else None
    if ckpt is not None:
        flat.params[:] = ckpt.params
        flat.upload()
    index = layout.worker_index(comm.rank) if layout.role(comm.rank) is Role.WORKER else None
    if index is not None and reseed:  # every worker its own random stream (dropout, the user's batches)
        torch.manual_seed(worker_seed(cfg.seed, index, int(ckpt.worker_clocks[index]) if ckpt is not None
                                      else start_iteration))
    elif not reseed:
        _same_streams(comm, index, layout.n_workers)
    redeal = Redeal(tuple(int(c) for c in ckpt.written_clocks), int(ckpt.worker_clocks[0])) \
        if ckpt is not None and ckpt.redealt else None  # another worker count: the epochs' rest dealt again

    def deal(worker: int):
        """Worker ``worker``'s batches (a spare's, once it takes that worker's place)."""
        return source.for_worker(worker, layout.n_workers, batch_size=cfg.batch_size, seed=cfg.seed,
                                 device=flat.device, steps=steps, redeal=redeal) if source is not None else None

    batches = agree(comm, lambda: deal(index) if index is not None else None)
    if cfg.group_by == "speed" and layout.n_groups:
        layout = _group_by_speed(cfg, comm, layout, model, flat, batches, workload)
    topo = stack.enter_context(Topology(comm, layout))
    signals = stack.enter_context(StopSignals(announce(comm.rank)))
    groups = tuple(resolve_groups(model, workload.param_groups))
    run_plan = RunPlan(
        cfg=cfg, layout=layout, paradigm=paradigm, workload=workload, size=flat.size, n_params=flat.n_params,
        stripe=stripe,
        # which values each central shard holds: contiguous blocks, striped with --partition-mb
        slices=Slices.plan(flat.size, flat.n_params, layout.n_servers, stripe, breaks=group_breaks(groups)),
        codec=make_codec(cfg.compress), steps=steps, facts=facts, devices=tuple(devices),
        slice_devices=tuple(slice_devices),
        world_ranks=tuple(world_ranks), groups=groups, ckpt=ckpt,
        reseed=reseed, start_iteration=start_iteration, horizon_steps=total if steps != total else None,
        keep_end=leg is not None and leg.keep_end, trial=leg is not None and leg.trial)
    state = RunState(topo=topo, model=model, flat=flat, source=source, batches=batches, signals=signals,
                     stack=stack, index=index, deal=deal, ckpt_dir=cfg.checkpoint_dir or "", slice_device=slice_device)
    return Run(run_plan, state)


#: how far apart the seeds of a resumed run's workers are from the first run's, per step done
RESUME_SEED_STRIDE = 1_000_003


def worker_seed(seed: int, worker_index: int, start_step: int = 0) -> int:
    """The seed of worker ``worker_index``'s torch random stream, drawn from after the model is built
    (every rank builds it right after ``torch.manual_seed(seed)``): ``seed + 1 + worker_index``, so no
    two workers draw the same dropout masks or batches, and none replays the model's initialisation;
    a run resumed at step ``start_step`` adds ``RESUME_SEED_STRIDE x start_step``, so it does not draw
    again what the first run drew from its start."""
    return seed + 1 + worker_index + RESUME_SEED_STRIDE * start_step


def _same_streams(comm: MPI.Comm, index: int | None, n_workers: int) -> None:
    """Collective, under ``reseed=False``: where every worker's torch random stream is at the same state (the
    script seeded every rank alike, and hpcps reseeds none), one warning from rank 0: the workers draw the same
    random batches and dropout masks."""
    state = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest() if index is not None else None
    states = {s for s in comm.allgather(state) if s is not None}
    if comm.rank == 0 and n_workers > 1 and len(states) == 1:
        log.warning("reseed=False: every worker's torch random stream is at the same state, so the %d workers "
                    "draw the same random batches (torch.randint, a shuffled sampler) and dropout masks; seed "
                    "each worker's stream from ps.worker_index after init (as a DDP script does from its rank), "
                    "or leave reseed on", n_workers)


def _plan_device(cfg: TrainConfig, comm: MPI.Comm, layout: Layout) -> DevicePlan:
    """Collective: this rank's device (``--device``) and how its tensors reach MPI (``--cuda-aware``)."""
    local = node_local_index(comm, layout.training_ranks())
    n_gpus = torch.cuda.device_count() if local is not None and cfg.device != "cpu" else 0
    plan = agree(comm, lambda: plan_device(
        cfg.device, cfg.cuda_aware, local, n_gpus,
        detect=lambda: detect_cuda_aware(MPI.Get_library_version(), os.environ, query_cuda_support())))
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
    return plan


def _slice_device(cfg: TrainConfig, comm: MPI.Comm, layout: Layout) -> torch.device | None:
    """Collective where ``--server-device`` is not ``host``: the device this rank's central shard steps its
    slice on (:mod:`hpcps.runtime.residence`); None for host memory and for every other role."""
    if cfg.server_device == "host":
        return None
    local = node_local_index(comm, range(layout.n_servers))
    n_gpus = torch.cuda.device_count() if local is not None and cfg.server_device == "cuda" else 0
    device = agree(comm, lambda: residence.shard_device(cfg.server_device, local, n_gpus) if local is not None else None)
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    return device


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


def _devices_summary(devices: list[str], what: str = "worker") -> str:
    """``cpu (4 workers)`` or ``cuda:0, staged ... (2 workers); cuda:1, ... (2 workers)``: the log's device line."""
    counts = Counter(devices)
    return "; ".join(f"{d} ({n} {what}{'s' if n > 1 else ''})" for d, n in counts.items())


def _load_checkpoint(cfg: TrainConfig, n_params: int, layout: Layout, stripe: int | None,
                     leg_paradigm: type[Policy] | None = None) -> Checkpoint:
    """The checkpoint ``--resume`` names, as this run goes on from it; ``leg_paradigm``: a leg's paradigm
    (:class:`~hpcps.runtime.plan.Leg`), which goes on from another paradigm's checkpoint too."""
    ckpt = read_checkpoint(cfg.resume, complete=True)
    check_compatible(ckpt, cfg.resume, cfg.as_json_dict(), n_params=n_params, any_paradigm=leg_paradigm is not None)
    if layout.n_workers != len(ckpt.worker_clocks) and layout.n_groups:
        raise UserError(f"--resume {cfg.resume}: grouped runs resume on their checkpoint's worker count "
                        f"({len(ckpt.worker_clocks)}), not {layout.n_workers}")
    if leg_paradigm is not None and ckpt.config["paradigm"] != cfg.paradigm:
        clients = layout.n_groups or layout.n_workers
        ckpt = for_paradigm(ckpt, written_per_step=policy_class(ckpt.config["paradigm"]).updates_per_step(clients),
                            per_step=leg_paradigm.updates_per_step(clients))
    return reshaped(ckpt, n_servers=layout.n_servers, n_workers=layout.n_workers, stripe=stripe)


class Run:
    """One run on one rank, from its plan to its end: built by :func:`open_run` once the start-up checks
    passed, it keeps the lifecycle: :meth:`start`, :meth:`serve` or a worker's steps
    (:mod:`hpcps.runtime.session`), :meth:`end`. What the run is lives in its :attr:`plan` (frozen, the
    same on every rank) and this rank's :attr:`state` (:mod:`hpcps.runtime.plan`). What each role is made
    of is assembled in :mod:`hpcps.runtime.assembly`; checkpoints are :mod:`hpcps.runtime.checkpoints.schedule`'s,
    the run file's records :mod:`hpcps.runtime.records`'s, the learning rates :mod:`hpcps.training.rates`'s."""

    def __init__(self, plan: RunPlan, state: RunState) -> None:
        self.plan, self.state = plan, state

    @property
    def topo(self) -> Topology:
        """This rank's place in the run: its role and communicators."""
        return self.state.topo

    @property
    def index(self) -> int | None:
        """This rank's worker index (None on a server, and on a spare until it takes a place)."""
        return self.state.index

    def clock(self) -> float:
        """Seconds since the run's start, on rank 0's clock (hpcps.transport.clocksync)."""
        return self.state.clock()

    def wait_for_place(self) -> bool:
        """A spare (:mod:`hpcps.runtime.spares`): wait, idle, until shard 0 gives this rank a dead worker's
        place (then take it: the worker's index, batches and random stream from its clock; True) or the run
        ends without needing it (False)."""
        plan, state = self.plan, self.state
        placed = wait_for_place(state.topo.ps, plan.shards[0])
        if placed is None:
            return False
        worker, clock = placed
        log.info("spare rank %d: taking the place of worker %d (rank %d) from its gradient %d on", state.topo.rank,
                 worker, plan.layout.worker_rank(worker), clock + 1)
        state.index, state.placed_at = worker, clock
        state.window.first = worker % len(plan.shards)  # the dead worker's place in the pulls' rotation
        if plan.reseed:
            torch.manual_seed(worker_seed(plan.cfg.seed, worker, clock))
        state.batches = state.deal(worker)
        return True

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        """Free what the run holds. The windows (whose free is a barrier) only when every rank gets
        here: without an error, or with bad input (a UserError is raised on every rank alike, see
        hpcps.runtime.agree); after a failure on one rank the others are not coming, and MPI_Abort follows."""
        if kind is None or issubclass(kind, UserError):
            for window in (self.state.window, self.state.group_window):
                if window is not None:
                    window.free()  # idempotent: end() has freed them, unless start() was refused
            agree_module.last_words.clear()  # nothing to say: the run ended on every rank
        self.state.stack.close()

    def _watch_every_wait(self) -> None:
        """While the run lasts, a wait with no watch of its own gets one (:func:`hpcps.transport.poll.watch_every_wait`)
        at twice the stall limits, so that the waits that name what they wait for speak first; and a stop signal
        that came during the run is forgotten when it ends."""
        cfg, rank = self.plan.cfg, self.state.topo.comm.rank
        warn, abort = 2 * cfg.stall_warn, 2 * cfg.stall_limit if cfg.stall_limit else None

        def make(text: str) -> StallWatch:
            return StallWatch(warn=warn, abort=abort, log=log, error=RunAborted,
                              describe=lambda: f"rank {rank} waiting {text}")
        self.state.stack.callback(watch_every_wait(make))
        self.state.stack.callback(clear_signal)

    def start(self) -> None:
        """Collective: the metrics file, the windows, the shards' optimizers; everyone meets, the clocks agree.

        Then each rank plays its role: :meth:`serve` (servers, group servers), or a worker's steps
        (:class:`hpcps.runtime.session.Session` over :func:`hpcps.runtime.assembly.make_worker`); and
        :meth:`end`, collective again.
        """
        plan, state = self.plan, self.state
        comm, topo = state.topo.comm, state.topo
        self._watch_every_wait()
        ulfm = ulfm_enabled()
        if ulfm and plan.layout.n_groups == 0 and plan.paradigm.runs_through:
            state.dead = DeadRanks([topo.ps, topo.metrics])
        elif ulfm and comm.rank == 0:
            log.warning("Open MPI's fault tolerance (ULFM) is on, but %s does not run through a dead worker: a "
                        "rank's death ends the job (resume it with --resume auto, or run under hpcps supervise)",
                        plan.cfg.paradigm)
        if state.dead is not None and plan.cfg.pull == "send" and comm.rank == 0:
            log.warning("--pull send: Open MPI's fault tolerance (ULFM) is on, and a shard's send to a worker that "
                        "died would fail it; the workers read each round's parameters out of the window instead")
        if plan.cfg.respawn and state.dead is None and comm.rank == 0:
            log.warning("--respawn: a death ends the job under this MPI; a newcomer takes a dead worker's place "
                        "under Open MPI's fault tolerance (mpirun --with-ft ulfm)")
        if plan.layout.n_spares and state.dead is None and comm.rank == 0:
            log.warning("--spare-workers %d: the spares stay idle, since a death ends the job under this MPI; "
                        "they take a dead worker's place under Open MPI's fault tolerance (mpirun --with-ft ulfm)",
                        plan.layout.n_spares)
        path = comm.bcast(plan.cfg.out or default_out(plan.cfg.paradigm) if comm.rank == 0 else None, root=0)
        state.ckpt_dir = checkpointing.checkpoint_dir(plan.cfg, path)
        runfile = agree(comm, lambda: records.open_runfile(plan, state, path) if comm.rank == 0 else None)
        recorder = (FileRecorder(topo.metrics, runfile, dead=state.dead) if comm.rank == 0
                    else ForwardingRecorder(topo.metrics))
        # an earlier run in this process that failed without ending it (exit_on_error=False) left its own
        agree_module.last_words.clear()
        if comm.rank != 0:  # a rank that fails sends rank 0 the rows it still holds before the job ends
            agree_module.last_words.append(recorder.flush)
        shard = comm.rank if topo.role is Role.SERVER else None
        window = ParamWindow(topo.ps, shard_ranks=plan.shards, slices=plan.slices,
                             local_len=plan.slices.length(shard) if shard is not None else 0, codec=plan.codec,
                             fanin=plan.cfg.shards_at_once, first=plan.layout.rotation_start(topo.rank, state.index))
        state.window = window  # freed by __exit__ if start() goes no further
        # a paradigm of rounds stops at a round's close: a stop asked for goes up with the shards' next publish
        window.stop_at_publish = plan.paradigm.holds_rounds
        if plan.cfg.shards_at_once and window.protocol == "locked" and comm.rank == 0:
            log.warning("--shards-at-once %d: ignored by the locked window protocol, whose pulls read every shard "
                        "at once under locks", plan.cfg.shards_at_once)
        group_window = None
        if topo.group != MPI.COMM_NULL:  # the group server (rank 0 of the group) exposes all parameters
            n = state.flat.size
            group_window = ParamWindow(topo.group, shard_ranks=[0], bounds=[(0, n)],
                                       local_len=n if topo.role is Role.GROUP else 0, codec=plan.codec)
            state.group_window = group_window
        master = plan.slices.take(shard, state.flat.params) if shard is not None else np.zeros(0, np.float32)
        if window.master is not None:  # a 16-bit window keeps the fp32 master weights (exact pulls read them)
            window.master[:] = master
            master = window.master
        optimizer = None
        if topo.role is Role.SERVER:
            # a resumed shard is at its checkpoint's version from its first publish: a worker's first pull
            # tags its gradient with it (with 0, the first gradients looked hundreds of versions stale)
            window.publish(master, plan.shard_start(comm.rank))
            # before the start: torch's first optimizer imports torch._dynamo, which took 1.5-2.5 s here,
            # and every worker's first push waited for it
            # where the slice is stepped (--server-device): the master itself, or its copy on a device
            state.home = residence.place(master, state.slice_device)
            optimizer = state.optimizer = assembly.shard_optimizer(plan, state, state.home.tensor[:plan.trainable(shard)],
                                                                   shard)
        elif topo.role in (Role.WORKER, Role.SPARE) and plan.cfg.inner_steps is not None:
            # likewise a worker's inner optimizer under --local-steps, built with its session after the start:
            # the import counted in the run's clock (2.5 s of a 2.7 s run of 10 rounds here)
            warm_optimizers()
        # the others wait for it polling, not in the broadcast below: MPICH's blocking collectives spin, and on
        # a node with more ranks than cores the spinning ranks took the cores the import needed
        meet(comm, "build the shards' optimizers", warn=plan.cfg.stall_warn, abort=plan.cfg.stall_limit)
        # the rate the servers' optimizer has of its own (a factory's, or --lr): rows record rates applied
        state.rate = comm.bcast(optimizer.default_lr if comm.rank == 0 else None, root=0)
        if comm.rank == 0:
            state.ran = {"optimizer_ran": describe_optimizer(optimizer, plan.groups),
                         "lr_schedule_values": rates.samples(optimizer.schedule, assembly.horizon(plan))}
            runfile.set_attrs(optimizer=json.dumps(state.ran["optimizer_ran"]),
                              lr_schedule_values=json.dumps(state.ran["lr_schedule_values"]))
            if plan.workload.optimizer is None and state.ran["optimizer_ran"]:  # a built-in's kernel: said
                fused = state.ran["optimizer_ran"]["defaults"].get("fused")
                log.info("the shards' %s runs torch's %s kernel (%s)", plan.cfg.optimizer,
                         "fused" if fused else "default", "--no-fused / fused=False for a plain torch optimizer's, "
                         "to the last bit" if fused else "--fused for the faster fused one")
        if plan.ckpt is not None:
            agree(comm, lambda: check_same_optimizer(plan.ckpt, plan.cfg.resume, state.ran["optimizer_ran"],
                                                     optimizer.schedule) if comm.rank == 0 else None)
        if topo.role is Role.GROUP:  # before the start barrier, so no worker can pull an empty window
            # at the version the group server will be at: the lowest central shard's (a resumed run's too)
            start = min(plan.shard_start(s) for s in plan.shards)
            group_window.publish(state.flat.params, start)
        if comm.rank == 0:
            f = plan.facts
            sizes = [f"{f[k]} {what}" for k, what in (("n_train", "train"), ("n_test", "test")) if f[k] is not None]
            data = f"data {f['name']}" + (f" ({' / '.join(sizes)})" if sizes else "")
            every = plan.cfg.inner_steps
            local = "" if every is None else (f" in {plan.rounds} rounds of {every} local steps "
                                              f"({plan.cfg.inner_optimizer} at {plan.cfg.inner_lr:g} inside)")
            log.info("%s on %s; model %s (%d parameters, %d buffer values), %s, %d steps per worker%s",
                     plan.cfg.paradigm, plan.layout.describe(), plan.workload.model_name, state.flat.n_params,
                     state.flat.size - state.flat.n_params, data, plan.steps, local)
            log.info("workers on %s", _devices_summary([plan.devices[r] for r in plan.layout.worker_ranks()]))
            if plan.cfg.server_device != "host":
                log.info("server shards' slices, optimizer state and sums on %s",
                         _devices_summary([plan.slice_devices[r] for r in range(plan.layout.n_servers)], "shard"))
            # once per run, on rank 0: the options nothing in this run reads
            for line in no_effect(plan.cfg, plan.paradigm):
                log.warning(line)
            if plan.ckpt is not None and plan.ckpt.describe_shape():
                log.info("resuming %s on another shape: %s", plan.cfg.resume, plan.ckpt.describe_shape())
        # everyone is set up: nobody waits long in the sync; a start that never completes ends the job
        polite_barrier(comm, Backoff(cap=1e-4), StallWatch(
            warn=plan.cfg.stall_warn, abort=plan.cfg.stall_limit, log=log, error=RunAborted,
            describe=lambda: f"rank {comm.rank} waiting at the start for the other ranks"))
        state.run_clock = sync_clock(topo.ps, shares_clock_with_rank0(topo.ps, topo.node))
        if comm.rank == 0:
            # the wall-clock time of the run's t = 0 (every row's times count from it), against other clocks
            runfile.set_attrs(clock_start=time.time() - state.run_clock())
            records.note_restart(plan, runfile)
            mark_launch("started")
        state.path, state.runfile, state.recorder = path, runfile, recorder
        state.master = master

    def serve(self) -> None:
        """A server's or group server's part, until every worker has left."""
        plan, state = self.plan, self.state
        topo, recorder = state.topo, state.recorder
        try:
            if topo.role is Role.SERVER:
                end = assembly.serve_shard(plan, state, state.window, state.master,
                                           state.optimizer, recorder)
                state.policy, state.final_version, state.final_metrics = end.policy, end.version, \
                    end.metrics
                state.final_clocks = end.clocks
            else:
                assembly.serve_group(plan, state, state.window, state.group_window, recorder)
        except BaseException:
            if state.runfile is not None:  # keep what rank 0 has recorded before the job is aborted
                recorder.drain()
                recorder.flush()
                state.runfile.close()
            raise

    def end(self, loop: LoopState | None = None) -> RunResult | None:
        """Collective, once every rank's part is over: recorders closed, a checkpoint if a signal stopped
        the run or at a leg's end (with ``loop``, worker 0's loop state), the summary; the result on rank 0."""
        plan, state = self.plan, self.state
        comm, recorder, runfile, window, group_window = (state.topo.comm, state.recorder, state.runfile, state.window,
                                                         state.group_window)
        wall_s = state.clock()
        recorder.close(state.backoff)
        if state.dead is not None:
            comm = self._survivors()
        # a fast worker waits here for the slowest and for rank 0's final evaluation, as long as they take; a
        # hung rank is its own waits' to end (every one of them is watched)
        polite_barrier(comm, state.backoff, watched=False)
        # a signal that a loop acted on; one that came after the last step (the final evaluation) stopped nothing
        stopped_by = next((s for s in comm.allgather(state.signals.acted) if s), None)
        diverged = stopped_by is None and comm.bcast(state.diverged is not None if comm.rank == 0 else None, root=0)
        # a checkpoint at a stop, and at a leg's end (the next leg goes on from it); none after a divergence
        saved_ckpt = checkpointing.checkpoint_at_stop(plan, state, comm, loop) \
            if stopped_by is not None or (plan.keep_end and not diverged) else None
        state.stopped_by = stopped_by = "diverged" if diverged else stopped_by
        ranks = comm.gather(records.rank_row(plan, state), root=0)  # after the barrier: nobody waits long
        # worker 0's integer buffers (BatchNorm's num_batches_tracked, counted on each rank) into the model saved
        ints = [i for i in comm.gather(loop.int_buffers if loop is not None else None, root=0) or [] if i]
        if ints:
            restore_int_buffers(state.model, ints[0])
        if comm is state.topo.comm:
            window.free()
            if group_window is not None:
                group_window.free()
        else:  # a window's free is a collective over every rank it was made on, the dead too: left to MPI
            state.window = state.group_window = None
            # the living end without MPI_Finalize: not before rank 0 has every rank's rows of the gathers
            part_ways(comm)
        if comm.rank != 0:
            return None
        result = self._finish(runfile, wall_s, state.path, ranks, stopped_by, saved_ckpt)
        mark_launch("finished")
        return result

    def _survivors(self) -> MPI.Comm:
        """Collective over the living (run-through): the run's communicator, or where ranks died, a shrunk
        copy of it for the end's collectives (the living keep their order: rank 0, a shard, is alive)."""
        state = self.state
        comm = state.topo.comm
        shrunk = comm.Shrink()
        if shrunk.size == comm.size:
            shrunk.Free()
            return comm
        state.stack.callback(shrunk.Free)
        gone = left_out(comm, shrunk)
        state.dead.add(gone)
        if comm.rank == 0:
            log.warning("the run ended without rank(s) %s, which died: their rows not yet sent are lost",
                        ", ".join(map(str, sorted(gone))))
        return shrunk

    def _finish(self, runfile: RunFile, wall_s: float, path: str, ranks: list[tuple], stopped_by: str | None,
                saved_ckpt: str | None) -> RunResult:
        plan, state = self.plan, self.state
        runfile.append("ranks", np.array(ranks, dtype=RANK))
        iterations = runfile.read("workers/iterations")
        summary = summarize(iterations, runfile.read("servers/updates"),
                            runfile.read("eval"), wall_s=wall_s, target=plan.cfg.stop_target,
                            eval_metrics=runfile.read("eval_metrics"), lost=runfile.read("servers/lost"),
                            joins=runfile.read("servers/joins"))
        summary.update(stopped_by=stopped_by or "", interrupted=stopped_by == "SIGINT", checkpoint=saved_ckpt or "")
        runfile.write_summary(summary)
        state.model.eval()  # as evaluated and saved, also when there was nothing to evaluate on
        state_dict = plain_state_dict(state.model)
        saved = None if plan.trial else save_model(state_dict, records.save_path(plan, path))  # (a trial's: unread)
        runfile.set_attrs(saved_model=saved or "")
        runfile.close()
        final = ", ".join(f"{k} {v:.4f}" for k, v in state.final_metrics.items() if not math.isnan(v))
        reached = (int(iterations["step"].max()) + 1 if len(iterations) else
                   max(plan.worker_start(w) for w in range(plan.layout.n_workers)))
        what = "steps" if plan.cfg.inner_steps is None else f"rounds of {plan.cfg.inner_steps} local steps"
        log.info("done in %.1f s after %d of %d %s: %s%d of %d gradients applied; metrics in %s%s",
                 summary["wall_s"], reached, plan.rounds, what, f"final evaluation {final}; " if final else "",
                 summary["gradients_applied"], summary["gradients_pushed"], runfile.path,
                 f", model in {saved}" if saved else "")
        say_stop(stopped_by, saved_ckpt, diverged=state.diverged, trial=plan.trial)
        return RunResult(runfile.path, summary, plan.steps, state.flat.params.copy(), state.model.cpu(), state_dict,
                         state.final_metrics, saved)


def say_stop(stopped_by: str | None, saved_ckpt: str | None, *, diverged: object, trial: bool) -> None:
    """Rank 0's last line of a run that stopped before its last step (``stopped_by``), if any: why, and what
    to resume from. A trial that diverged says nothing more: its watch said so as the trial's end, and there
    is nothing to resume (the next trial goes on from the one before)."""
    if stopped_by == "diverged":
        if not trial:
            log.warning("stopped because the training diverged: %s", diverged)
    elif stopped_by == respawn.STOPPED_BY:
        log.warning("stopped by a worker's death before the end: checkpoint %s written, from which the job "
                    "resumes with a process spawned in its place (--respawn)", saved_ckpt)
    elif stopped_by:
        log.warning("stopped by %s before the end: checkpoint written, continue with --resume %s",
                    stopped_by, saved_ckpt)


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state on the CPU as plain ``load_state_dict`` takes it into the model's uncompiled
    class: ``torch.compile`` puts ``_orig_mod.`` in the keys of what it compiled, which is dropped."""
    return {k.replace("_orig_mod.", ""): v.detach().cpu().clone() for k, v in model.state_dict().items()}


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
