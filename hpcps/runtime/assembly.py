"""Assembling a run's roles from its context: the central shards (with their optimizer, evaluator,
progress line and watchers), the group servers, and the workers with their transfers.

Each function takes the run's plan (:class:`~hpcps.runtime.plan.RunPlan`: its options, layout, paradigm, slices,
codec) and, where it needs this rank's part, its state (:class:`~hpcps.runtime.plan.RunState`: communicators,
model, windows, recorder), and builds one role's objects from the value objects and ports of
:mod:`hpcps.runtime.parts`; :mod:`hpcps.runtime.run` keeps the lifecycle.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

from hpcps.metrics.board import TABLES as BOARD_TABLES, Board, run_logdir
from hpcps.metrics.timeline import NullTimeline, Timeline
from hpcps.policies import Policy, make_policy
from hpcps.runtime import faults, residence, watchers
from hpcps.runtime.checkpoints import schedule as checkpointing
from hpcps.runtime.backward import BackwardPushes
from hpcps.runtime.checkpoints.files import SPANS_KEY, read_optimizer_state, read_policy_state
from hpcps.runtime.evaluator import EvalPlan, Evaluator
from hpcps.runtime.groupserver import CentralLink, GroupServer
from hpcps.runtime.optstate import StateDesk
from hpcps.runtime.parts import (PullPlan, PushPlan, Records, ServerHooks, ServerPorts, ShardUpdate, StepPlan,
                                 Watch, WorkerPorts)
from hpcps.runtime.plan import RunPlan, RunState, start_clock
from hpcps.runtime.partitions import PartitionedPulls
from hpcps.runtime.progress import Progress
from hpcps.runtime.rounds import RoundSum
from hpcps.runtime.server import ShardServer
from hpcps.runtime.checkpoints.cut import ClockCut, RoundCut
from hpcps.runtime.respawn import DeathStop
from hpcps.runtime.spares import SpareDesk
from hpcps.runtime.worker import EagerWorker, HSPWorker, Worker
from hpcps.training import rates
from hpcps.training.momentum import StaleMomentum
from hpcps.training.optim import Schedule, ShardOptimizer
from hpcps.training.paramgroups import shard_group_indices, shard_groups
from hpcps.transport import wire
from hpcps.transport.compress import make_codec
from hpcps.transport.notices import NoticeBox, Notifier
from hpcps.transport.failures import retried
from hpcps.transport.poll import Backoff, polite_barrier
from hpcps.transport.push import Pusher, PushInbox, RunThrough
from hpcps.transport.sent import ParamSender, SentPull
from hpcps.transport.window import ParamWindow

log = logging.getLogger("hpcps")

#: a tag nobody sends on: probing it only drives MPI progress
_PROGRESS_TAG = 99
#: receive buffers of a shard (and of a group server): the gradients it holds at once, whatever the worker count
RECEIVE_POOL = 2


def sends_pulls(plan: RunPlan, state: RunState) -> bool:
    """Whether a round's parameters are sent by the shards (``--pull send``; the paradigm and the options
    were checked at start-up, :mod:`hpcps.options.effects`). Not under run-through (ULFM): a send to a
    worker that died would fail the shard, so the workers read the window as by default (rank 0 says so
    at the start, :meth:`hpcps.runtime.run.Run.start`, and the run file's ``pull`` says what ran)."""
    return plan.cfg.pull == "send" and state.dead is None


def piece_ranges(plan: RunPlan, state: RunState) -> list[tuple[int, int]] | None:
    """The ranges of this shard's slice whose rounds it releases one at a time from the last verdict on
    (:mod:`hpcps.runtime.release`; the optimizer's chunks are cut at them), or None: each round at once.
    Where its rounds are sent (not under run-through), by a paradigm of bsp's rounds with no group servers,
    the slice in host memory, pushes as they are, in pieces."""
    ranges = [(at, at + hi - lo) for at, lo, hi in plan.slices.local_ranges(state.topo.rank)]
    if releases_pieces(plan, state) and len(ranges) > 1:
        return ranges
    return None


def releases_pieces(plan: RunPlan, state: RunState) -> bool:
    """Whether the run's shards release their rounds a piece at a time (:func:`piece_ranges`: each shard
    whose slice is in pieces, as a striped one's are; the slices in host memory, ``--server-device host``,
    where :mod:`hpcps.runtime.residence` steps them in place): what the run file's ``release`` says."""
    cls = plan.paradigm
    return bool(getattr(cls, "releases_pieces", False) and sends_pulls(plan, state) and plan.layout.n_groups == 0
                and not cls.serial_transfers and plan.cfg.server_device == "host" and plan.codec.identity_push
                and plan.slices.striped)


@dataclass(frozen=True)
class ShardEnd:
    """What a central shard leaves for the run's end: its paradigm (whose state a stop's checkpoint keeps), its
    final version, (rank 0) the final evaluation, and each worker's gradients it received whole (a stop's
    checkpoint takes a dead worker's clock from them)."""

    policy: Policy
    version: int
    metrics: dict[str, float]
    clocks: list[int]


def serve_shard(plan: RunPlan, state: RunState, window: ParamWindow, master, optimizer: ShardOptimizer,
                recorder) -> ShardEnd:
    """A central shard's part, until every worker has left (then, on rank 0, the final evaluation)."""
    topo, layout, cfg = state.topo, plan.layout, plan.cfg
    grouped = layout.n_groups > 0  # then the central shards' clients are the group servers
    workers = plan.clients
    notifier = Notifier(topo.ps, worker_ranks=workers, dead=state.dead)
    serial = plan.paradigm.serial_transfers and not grouped
    trainable = plan.trainable(topo.rank)
    policy = make_policy(cfg.paradigm, len(workers), cfg.paradigm_option, staleness=cfg.s_lo,
                         staleness_max=cfg.s_hi)
    start_version = plan.shard_start(topo.rank)
    policy.resume_at(start_version)
    if plan.ckpt is not None and not (plan.ckpt.resharded or plan.ckpt.redealt or plan.ckpt.written_paradigm):
        # what the paradigm kept of its own (clocks, a controller's intervals); another shape, or another
        # paradigm's checkpoint, starts it afresh
        policy.load_state_dict(read_policy_state(cfg.resume, topo.rank))
    # paradigms that hold rounds (bsp, hsp) sum each as it arrives (hpcps.runtime.rounds): bsp in worker
    # order (reproducible), hsp in the order its serial transfers come; those and the ones that apply
    # every gradient on arrival receive into a pool of RECEIVE_POOL buffers, whatever the worker count;
    # any other (a plug-in that holds gradients) keeps one buffer per worker
    home = state.home
    rounds = RoundSum(len(master), trainable, len(workers), policy.active, ordered=not serial,
                      device=home.device) if policy.holds_rounds and not grouped else None
    pooled = rounds is not None or policy.applies_on_arrival or grouped
    spares = SpareDesk(topo.ps, shard=topo.rank, shards=plan.shards, spares=layout.spare_ranks(),
                       rounds=plan.rounds, dead=state.dead) if layout.n_spares else None  # (idle ones told to end)
    if cfg.respawn and state.dead is not None:  # a death stops the run, which resumes with a newcomer
        spares = DeathStop(shard=topo.rank, stop=window.request_stop, signals=state.signals, rounds=plan.rounds)
    # (a slice on a GPU uploads every gradient from the receive buffers: pinned, one DMA each)
    inbox_class = residence.PinnedPushInbox if home.pinned else PushInbox
    inbox = inbox_class(topo.ps, worker_ranks=workers, shard_len=plan.codec.push_len(len(master)),
                      dtype=plan.codec.push_dtype, clock=state.clock,
                      on_transfer=(lambda i: notifier.send(i, wire.TRANSFER)) if serial else None,
                      pool=RECEIVE_POOL if pooled else None,
                      reserve=rounds.expected if rounds and rounds.ordered else None,
                      pieces=send_pieces(plan, plan.codec)[topo.rank],
                      runthrough=RunThrough(state.dead, layout.spare_ranks()) if state.dead is not None else None)
    side_tasks, bar, evaluator = [("other", watchers.spread_signal(plan, state, window))], None, None
    side_tasks.append(("other", StateDesk(topo.ps, optimizer, len(master), dead=state.dead)))  # ps.optimizer's state
    if topo.rank == 0:
        # evaluate in a helper thread where the pull may run beside the loop (pinned window, THREAD_MULTIPLE)
        # (HPCPS_EVAL_BACKGROUND=0 forces the loop's thread: tools/bench_eval_latency.py compares both)
        background = (window.protocol == "pinned" and MPI.Query_thread() >= MPI.THREAD_MULTIPLE
                      and os.environ.get("HPCPS_EVAL_BACKGROUND", "1") != "0")
        evaluator = Evaluator(model=state.model, flat=state.flat,
                              batches=state.source.test_batches(cfg.eval_batch_size)
                              if state.source and not plan.trial else None,
                              evaluate=plan.workload.evaluation(),
                              # (--eval-every's version itself, where the shards are past it: under rounds)
                              pull=lambda out, at=None: window.pull_one_version(
                                  out, Backoff(), at=at if policy.holds_rounds else None),
                              records=Records(recorder, state.clock),
                              plan=EvalPlan(cfg.eval_interval, every=cfg.eval_every, target=cfg.stop_target,
                                            on_target=window.set_stop, log_every=cfg.log_every),
                              background=background, version=lambda: server.version,
                              settled=lambda: int(window.peek(Backoff()).min()))
        bar = Progress(len(workers) * plan.rounds, cfg.paradigm, enabled=cfg.progress, every=cfg.progress_every,
                       accuracy=lambda: evaluator.accuracy)
        side_tasks += [("metrics", recorder.drain), ("evaluate", evaluator.tick)]
        if cfg.tensorboard:  # the rows as they come, to TensorBoard too (hpcps.metrics.board)
            board = state.stack.enter_context(closing(Board(run_logdir(cfg.tensorboard, state.path),
                                                            time.time() - state.clock())))
            log.info("TensorBoard: the run's scalars live in %s (tensorboard --logdir %s)", board.logdir,
                     cfg.tensorboard)
            for table in BOARD_TABLES:
                recorder.watchers.setdefault(table, []).append(board.watcher(table))
        if cfg.divergence == "stop":
            add = recorder.watchers.setdefault
            add("workers/iterations", []).append(watchers.divergence_watch(plan, state, window))
            flat = watchers.flat_loss_watch(plan, state, window)
            if flat is not None:
                add("workers/iterations", []).append(flat)
            add("servers/updates", []).append(watchers.nonfinite_start_watch(plan, state, window))
    periodic = policy.periodic_cut() if cfg.checkpoint_every or cfg.checkpoint_interval else None
    if periodic and topo.rank == 0:
        side_tasks.append(("checkpoint", checkpointing.progress_note(plan, state, lambda: server.clocks)))
    # every bsp worker waits at a round's close: bsp checkpoints there, from the publish hook; the others
    # take a consistent cut while the run goes on (hpcps.runtime.checkpoints.cut)
    at_publish = periodic is not None and policy.checkpoints_at_publish()
    snapshots = None
    if periodic and not at_publish:
        snapshots = checkpointing.snapshots(plan, state, window, optimizer, policy,
                                            RoundCut() if periodic == "rounds" else ClockCut())
        side_tasks.append(("checkpoint", snapshots.tick))
    on_published = checkpointing.checkpointer(plan, state, window, optimizer, policy, lambda: server.clocks) \
        if at_publish else None
    ports = ServerPorts(
        inbox, notifier, window,
        progress=lambda: retried(state.dead, lambda: topo.ps.Iprobe(source=MPI.ANY_SOURCE, tag=_PROGRESS_TAG)),
        spares=spares, sender=ParamSender(topo.ps, worker_ranks=workers, ranges=plan.slices.local_ranges(topo.rank),
                                          length=len(master)) if sends_pulls(plan, state) else None)
    update = ShardUpdate(master, cfg.lr, optimizer=optimizer, n_params=trainable, version=start_version,
                         round_sum=rounds, codec=plan.codec, abort_on_nonfinite=cfg.nonfinite == "abort",
                         home=home, pieces=piece_ranges(plan, state) if rounds is not None and rounds.ordered else None)
    server = ShardServer(
        shard=topo.rank, rank=topo.rank, policy=policy, worker_ranks=workers, ports=ports, update=update,
        records=Records(recorder, state.clock, timeline(plan, state, recorder)),
        watch=Watch(cfg.stall_warn, cfg.stall_limit, state.backoff),
        hooks=ServerHooks(side_tasks, on_applied=bar.update if bar is not None else None, on_published=on_published),
        table="groups/updates" if grouped else "servers/updates")
    if not grouped:  # the clocks the workers start at: a resumed one's (one that ended stays there), else 0
        server.clocks = [plan.worker_start(w) for w in range(len(workers))]
        server.gradients_applied = int(sum(server.clocks))  # where hsp's schedule resumes
    if snapshots is not None:
        snapshots.server, snapshots.last_version = server, start_version
    server.run()
    if spares is not None:  # shard 0: no spare will be needed now
        spares.close(state.backoff)
    if snapshots is not None:
        snapshots.finish(state.backoff)  # a checkpoint under way completes; shard 0 says none follows
    inbox.free()
    polite_barrier(topo.role_comm, state.backoff)  # every shard has published its final version
    if state.dead is not None and layout.n_servers > 1:
        reconcile_lost(plan, state, server, recorder)
    if evaluator is not None:
        evaluator.pull = lambda out: window.pull(out, Backoff(), exact=True)  # the shards' fp32 masters
        evaluator.evaluate()  # also leaves the final global parameters and buffers in state.model
        bar.close()
    return ShardEnd(policy, server.version, evaluator.metrics if evaluator is not None else {},
                    [int(c) for c in server.clocks])


def reconcile_lost(plan: RunPlan, state: RunState, server: ShardServer, recorder) -> None:
    """Collective over the shards (run-through): a worker that died between its pushes to two shards left a
    gradient one applied and the other never received; each shard records those it lacks as lost (reason 2),
    so every shard accounts for the same pushes."""
    reached = {server.worker_ranks[w]: max([server.clocks[w], *lost])  # received whole, or cut off here
               for w, lost in server.lost_clocks.items()}
    everyone = state.topo.role_comm.allgather(reached)
    t = state.clock()
    for rank, mine in reached.items():
        for clock in range(mine + 1, max(d.get(rank, 0) for d in everyone) + 1):
            recorder.add("servers/lost", (server.rank, server.shard, t, rank, clock, 2))


def shard_optimizer(plan: RunPlan, state: RunState, params: torch.Tensor, shard: int) -> ShardOptimizer:
    """The optimizer of central shard ``shard``'s trainable values ``params`` (on the slice's device), cut
    into the run's param groups, its schedule over the run's updates, resumed state."""
    cfg = plan.cfg
    groups = shard_groups(plan.groups, plan.slices.pieces[shard])
    pieces = piece_ranges(plan, state)
    optimizer = ShardOptimizer(params, plan.workload.optimizer_factory(cfg), lambda v: 1.0,
                               groups=groups, indices=shard_group_indices(plan.groups, plan.slices.pieces[shard]),
                               cuts=[lo for lo, _ in pieces] if pieces else ())
    # the schedule's floor (--min-lr) is a rate, over the one the optimizer was built with
    optimizer.schedule = schedule(plan, optimizer.default_lr or cfg.lr)
    restored = plan.ckpt is not None and not plan.ckpt.optimizer_afresh  # (another batch's statistics: afresh)
    if cfg.stale_momentum == "auto" and cfg.momentum_period == 1:  # (Delayed Nesterov's momentum is its own cure)
        # resumed: the ramp goes on from the shard's version, as its restored momentum buffers do
        optimizer.stale = StaleMomentum(updates=plan.shard_start(shard) if restored else 0)
    if restored and plan.ckpt.resharded:
        optimizer.load_state_dict(checkpointing.resliced_optimizer_state(plan, state, optimizer, shard))
    elif restored:  # cut where the writer cut it (a part that does not say: without pieces)
        written = read_optimizer_state(cfg.resume, state.topo.rank)
        optimizer.load_state_dict(written, spans=written.pop(SPANS_KEY, None) or optimizer.uncut_spans)
    return optimizer


def schedule(plan: RunPlan, base_lr: float) -> Schedule:
    """The run's learning-rate schedule (:func:`hpcps.training.rates.schedule`) over its optimizer's rate
    ``base_lr``."""
    return rates.schedule(plan.cfg, plan.workload.lr_schedule, horizon(plan), base_lr)


def lr_scale(plan: RunPlan, extra: bool = False) -> float:
    """A gradient's learning-rate factor in this run (:func:`hpcps.training.rates.lr_scale`)."""
    return rates.lr_scale(plan.cfg, plan.paradigm, len(plan.clients), extra=extra)


def horizon(plan: RunPlan) -> int:
    """The updates a central shard applies over the run, or over the training a leg is part of
    (:func:`hpcps.training.rates.horizon`)."""
    return rates.horizon(plan.paradigm, plan.horizon_rounds, len(plan.clients))


def serve_group(plan: RunPlan, state: RunState, central: ParamWindow, window: ParamWindow, recorder) -> None:
    """A group server: BSP over its group (on the group communicator), a client of the central shards."""
    topo, cfg, n = state.topo, plan.cfg, plan.size
    members = plan.layout.group_members()[plan.layout.group_of(topo.rank)]
    local = list(range(1, topo.group.size))  # the workers' ranks in the group communicator
    agg = np.zeros(n, np.float32)
    # the round's update goes to the central shards as the wire carries it (--compress), with this group
    # server's own top-k residual; its workers push to it, and pull from its window, the same way
    # (in the central shards' wire order when their slices are striped)
    codec, encode = make_codec(cfg.compress), None
    bounds = plan.slices.wire_bounds
    send = agg if codec.identity_push and not plan.slices.striped else codec.new_push_buffer(bounds)
    if send is not agg:
        stage = stager(plan, codec, torch.from_numpy(agg), bounds, striped=plan.slices.striped)
        encode = lambda keep: stage(send, keep)  # noqa: E731
    # --shards-at-once: to one central shard at a time, in a rotation from its group (as a worker from its index)
    central_pusher = Pusher(topo.ps, buffers=[send], shard_ranks=plan.shards,
                            bounds=codec.push_bounds(bounds), worker_rank=topo.rank,
                            pieces=send_pieces(plan, codec, wire_order=True), fanout=cfg.shards_at_once,
                            first=plan.layout.rotation_start(topo.rank))
    central_notices = NoticeBox(topo.ps, shard_ranks=plan.shards)
    policy = make_policy(plan.paradigm.group_policy, len(members))
    rounds = RoundSum(n, plan.n_params, len(members), policy.active)  # the group's rounds, summed
    inbox = PushInbox(topo.group, worker_ranks=local, shard_len=plan.codec.push_len(n), pool=RECEIVE_POOL,
                      reserve=rounds.expected, dtype=plan.codec.push_dtype)
    ports = ServerPorts(inbox, Notifier(topo.group, worker_ranks=local), window,
                        progress=lambda: topo.group.Iprobe(source=MPI.ANY_SOURCE, tag=_PROGRESS_TAG))
    update = ShardUpdate(window.master if window.master is not None else np.zeros(n, np.float32), cfg.lr,
                         n_params=plan.n_params, round_sum=rounds, codec=plan.codec,
                         abort_on_nonfinite=cfg.nonfinite == "abort")
    link = CentralLink(central_pusher, central_notices, central, agg,
                       weight=len(members) * plan.layout.n_groups / plan.layout.n_workers,
                       rate=state.rate, schedule=schedule(plan, state.rate), encode=encode)
    GroupServer(
        link, shard=0, rank=topo.rank, policy=policy, worker_ranks=members, ports=ports, update=update,
        records=Records(recorder, state.clock, timeline(plan, state, recorder)),
        watch=Watch(cfg.stall_warn, cfg.stall_limit, state.backoff),
        hooks=ServerHooks([("other", watchers.spread_signal(plan, state, central, own=window))]),
    ).run()
    inbox.free()
    central_pusher.free()
    central_notices.free()


def make_worker(plan: RunPlan, state: RunState) -> tuple[Worker, tuple]:
    """This worker rank's :class:`~hpcps.runtime.worker.Worker` of the paradigm, and its transfers (the
    pusher and the notice box, freed by :func:`free_worker` once it has left)."""
    topo, cfg, recorder, window = state.topo, plan.cfg, state.recorder, state.group_window or state.window
    policy = plan.paradigm
    codec = plan.codec
    grouped = topo.group != MPI.COMM_NULL  # then it pushes to its group server
    bounds = push_slices(plan)
    striped = plan.slices.striped and not grouped  # then the push leaves in the shards' wire order
    new_buffer = state.flat.new_push_buffer if codec.identity_push else lambda: codec.new_push_buffer(bounds)
    buffers = [state.flat.push_grads if codec.identity_push and not striped else new_buffer()]
    tl = timeline(plan, state, recorder)
    partitions = send_buffers = stage = backward_pushes = None
    if plan.stripe:  # (on a GPU, each partition goes up to the device as it comes)
        partitions = PartitionedPulls(state.model, state.flat.spans, plan.stripe, timeline=tl,
                                      upload=None if state.flat.transfer == "shared" else state.flat.upload_ranges)
    # pushes from a copy, so that a push leaves while the next pass computes: eager and hsp compute
    # while they wait; a partitioned pull's pass begins while the pull (and the push) are in flight; under
    # --overlap-steps the next round's first steps compute before the grant and the pull
    defer_pull = bool(cfg.inner_steps is not None and cfg.overlap_steps)  # the next round computes meanwhile
    if policy.eager_pull or policy.extra_gradients or partitions is not None or defer_pull:
        buffers = send_buffers = [new_buffer() for _ in range(2)]
    if striped or not codec.identity_push:  # reordered, encoded (hpcps.transport.compress) into the push buffer
        staged = stager(plan, codec, state.flat.grads_t, bounds, striped=striped)
        stage = lambda out, keep: (staged(out, keep), state.flat.synchronize())  # noqa: E731
    extra = {}  # the worker side's own (hpcps.runtime.worker)
    if policy.eager_pull:
        extra["bound"] = cfg.staleness  # None: never wait for fresher parameters
    if policy.extra_gradients:
        extra["max_extra"] = cfg.hsp_max_stale
        extra["extra_scale"] = lr_scale(plan, extra=True) / lr_scale(plan)
    # grouped: talk to the group server, rank 0 of the group communicator
    comm, shards = (topo.group, [0]) if grouped else (topo.ps, plan.shards)
    pusher = Pusher(comm, buffers=buffers, shard_ranks=shards, bounds=codec.push_bounds(bounds),
                    worker_rank=topo.rank, serial=policy.serial_transfers,
                    pieces=None if grouped else send_pieces(plan, codec, wire_order=True),
                    fanout=cfg.shards_at_once, first=plan.layout.rotation_start(topo.rank, state.index))
    notices = NoticeBox(comm, shard_ranks=shards)
    sent_pull = (lambda out, parts, watch: SentPull(comm, shards, plan.slices, out, parts, state.backoff, watch)) \
        if sends_pulls(plan, state) else None
    if pushes_during_backward(plan, state, policy, striped, bool(send_buffers)):
        backward_pushes = BackwardPushes(
            state.model, state.flat.spans,
            order=[plan.slices.send_order(s, plan.n_params) for s in range(plan.slices.n_shards)],
            bases=[w for w, _ in plan.slices.wire_bounds], n_params=plan.n_params, grads=state.flat.grads,
            buffers=buffers, send=pusher.start_piece, overflow=codec.overflow)
    worker_class = WORKER_SIDES[policy.worker_side()]
    state.model.train()
    steps = StepPlan(steps=plan.rounds, lr=cfg.lr * lr_scale(plan), blocks=policy.worker_blocks,
                     lr_staleness=cfg.lr_staleness or policy.default_lr_staleness,
                     start_step=start_clock(plan, state),
                     faults=[f for f in faults.armed(cfg.faults, os.environ) if f.rank == topo.rank])
    worker = worker_class(
        rank=topo.rank, model=state.model, flat=state.flat, ports=WorkerPorts(window, pusher, notices), plan=steps,
        records=Records(recorder, state.clock, tl),
        push=PushPlan(stage=stage, send_buffers=send_buffers, backward_pushes=backward_pushes,
                      overflow=codec.overflow),
        pull=PullPlan(partitions=partitions, defer_pull=defer_pull, sent_pull=sent_pull),
        watch=Watch(cfg.stall_warn, cfg.stall_limit, state.backoff, state.signals.take), **extra)
    return worker, (pusher, notices)


#: the worker of each side a paradigm names (:meth:`hpcps.policies.base.Policy.worker_side`)
WORKER_SIDES: dict[str, type[Worker]] = {"steps": Worker, "eager": EagerWorker, "extra": HSPWorker}


def push_slices(plan: RunPlan) -> list[tuple[int, int]]:
    """The slices of a worker's push buffer, one per shard (the shards' wire order,
    :mod:`hpcps.cluster.slices`), or (grouped) the whole flat vector, for its group server."""
    return [(0, plan.size)] if plan.layout.n_groups else plan.slices.wire_bounds


def pushes_during_backward(plan: RunPlan, state: RunState, policy, striped: bool, slotted: bool) -> bool:
    """Whether a worker pushes each piece of its gradient as backward produces it (in hpcps's own loop,
    :mod:`hpcps.runtime.backward`): its push goes in pieces (striped slices), from a copy, unencoded,
    unclipped, from a CPU worker's flat buffer, without local steps (a round's push follows its last step), under a paradigm that waits for its grant (and whose
    learning rate is known before the pass)."""
    cfg = plan.cfg
    return (striped and slotted and cfg.inner_steps is None and plan.codec.identity_push and cfg.clip_norm is None
            and state.flat.transfer == "shared" and policy.worker_blocks and not policy.serial_transfers
            and not policy.eager_pull and not policy.extra_gradients
            and (cfg.lr_staleness or policy.default_lr_staleness) == "none")


def send_pieces(plan: RunPlan, codec, *, wire_order: bool = False) -> list[list[tuple[int, int]]]:
    """Per central shard, the ranges of a push to it, one message each, in the order they are sent
    (:meth:`hpcps.cluster.slices.Slices.send_order`): in the shard's own slice, or (``wire_order``) in
    a client's push buffer. An encoded push (``--compress``) goes whole."""
    wire_bounds = codec.push_bounds(plan.slices.wire_bounds)
    out = []
    for s, (w, end) in enumerate(wire_bounds):
        base = w if wire_order else 0
        order = plan.slices.send_order(s, plan.n_params)
        out.append([(base + at, base + at + hi - lo) for at, lo, hi in order]
                   if codec.identity_push else [(base, base + end - w)])
    return out


def stager(plan: RunPlan, codec, grads: torch.Tensor, bounds: list[tuple[int, int]], *,
           striped: bool) -> Callable[[Any, bool], None]:
    """``stage(out, keep)``: put the flat-order gradient ``grads`` into push buffer ``out`` (cut at
    ``bounds``) as the wire carries it: in the central shards' wire order where their slices are
    striped, encoded under ``--compress`` (``keep``: the gradient is to be applied, see
    hpcps.transport.compress)."""
    if codec.identity_push:
        return lambda out, keep: plan.slices.gather(grads, out)
    if not striped:
        return lambda out, keep: codec.encode(grads, out, bounds, keep=keep)
    ordered = torch.empty_like(grads)

    def stage(out, keep: bool) -> None:
        plan.slices.gather(grads, ordered)
        codec.encode(ordered, out, bounds, keep=keep)
    return stage


def wire_record(plan: RunPlan) -> dict:
    """What one push and one pull move (payload bytes, all shards together), for the run file."""
    codec = plan.codec
    push = codec.push_bounds(push_slices(plan))[-1][1] * codec.push_dtype.itemsize
    return {**codec.describe(), "push_bytes": push, "pull_bytes": plan.size * codec.pull_dtype.itemsize,
            "fp32_bytes": 4 * plan.size}


def timeline(plan: RunPlan, state: RunState, recorder) -> Timeline | NullTimeline:
    """Where this rank's phases go: ``/timeline`` under ``--timeline``, nowhere otherwise."""
    return Timeline(state.topo.rank, recorder.add, state.clock) if plan.cfg.timeline else NullTimeline()


def free_worker(worker: Worker, transfers: tuple) -> int:
    """After the worker left: free its transfers; the gradients it pushed (resumed ones included)."""
    worker.close()
    for transfer in transfers:
        transfer.free()
    return worker.clock_count
