"""Assembling a run's roles from its context: the central shards (with their optimizer, evaluator,
progress line and watchers), the group servers, and the workers with their transfers.

Each function takes the run (:class:`hpcps.runtime.run._Run`: its options, layout, slices, codec, model,
recorder, windows) and builds one role's objects; :mod:`hpcps.runtime.run` keeps the lifecycle.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

from hpcps.cluster.slices import stripe_elements
from hpcps.metrics.timeline import NullTimeline, Timeline
from hpcps.policies import make_policy, policy_class
from hpcps.runtime import checkpointing, faults, watchers
from hpcps.runtime.backward import BackwardPushes
from hpcps.runtime.checkpoint import read_optimizer_state, read_policy_state
from hpcps.runtime.evaluator import Evaluator
from hpcps.runtime.groupserver import GroupServer
from hpcps.runtime.optstate import StateDesk
from hpcps.runtime.partitions import PartitionedPulls
from hpcps.runtime.progress import Progress
from hpcps.runtime.rounds import RoundSum
from hpcps.runtime.server import ShardServer
from hpcps.runtime.snapshot import ClockCut, RoundCut
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
from hpcps.transport.push import Pusher, PushInbox
from hpcps.transport.sent import ParamSender, SentPull
from hpcps.transport.window import ParamWindow

log = logging.getLogger("hpcps")

#: a tag nobody sends on: probing it only drives MPI progress
_PROGRESS_TAG = 99
#: receive buffers of a shard (and of a group server): the gradients it holds at once, whatever the worker count
RECEIVE_POOL = 2


def clients(run) -> list[int]:
    """The ranks that push to a central shard: the workers, or (grouped) the group servers."""
    layout = run.layout
    if layout.n_groups > 0:
        return [layout.group_server_rank(g) for g in range(layout.n_groups)]
    return list(layout.worker_ranks())


def n_params(run, shard: int) -> int:
    """Trainable values at the start of central shard ``shard``'s slice; the rest of it is buffers
    (BatchNorm statistics)."""
    return run.slices.trainable(shard, run.flat.n_params)


def sends_pulls(run) -> bool:
    """Whether a round's parameters are sent by the shards (``--pull send``; the paradigm and the options
    were checked at start-up, :mod:`hpcps.cluster.effects`). Not under run-through (ULFM): a send to a
    worker that died would fail the shard, so the workers read the window as by default (rank 0 says so
    at the start, :meth:`hpcps.runtime.run.Run.start`, and the run file's ``pull`` says what ran)."""
    return run.cfg.pull == "send" and run.dead is None


def serve_shard(run, window: ParamWindow, master, optimizer: ShardOptimizer, recorder) -> None:
    topo, layout, cfg = run.topo, run.layout, run.cfg
    grouped = layout.n_groups > 0  # then the central shards' clients are the group servers
    workers = clients(run)
    notifier = Notifier(topo.ps, worker_ranks=workers, dead=run.dead)
    serial = policy_class(cfg.paradigm).serial_transfers and not grouped
    trainable = n_params(run, topo.rank)
    policy = make_policy(cfg.paradigm, len(workers), cfg.paradigm_option, staleness=cfg.s_lo,
                         staleness_max=cfg.s_hi)
    start_version = run.ckpt.shard_version(topo.rank) if run.ckpt else 0
    policy.resume_at(start_version)
    if run.ckpt is not None and not (run.ckpt.resharded or run.ckpt.redealt):
        # what the paradigm kept of its own (clocks, a controller's intervals); another shape starts it afresh
        policy.load_state_dict(read_policy_state(cfg.resume, topo.rank))
    run.policy = policy
    # paradigms that hold rounds (bsp, hsp) sum each as it arrives (hpcps.runtime.rounds): bsp in worker
    # order (reproducible), hsp in the order its serial transfers come; those and the ones that apply
    # every gradient on arrival receive into a pool of RECEIVE_POOL buffers, whatever the worker count;
    # any other (a plug-in that holds gradients) keeps one buffer per worker
    rounds = RoundSum(len(master), trainable, len(workers), policy.active, ordered=not serial) \
        if policy.holds_rounds and not grouped else None
    pooled = rounds is not None or policy.applies_on_arrival or grouped
    spares = SpareDesk(topo.ps, shard=topo.rank, shards=run.shards, spares=layout.spare_ranks(),
                       rounds=run.rounds, dead=run.dead) if layout.n_spares else None  # (idle ones told to end)
    inbox = PushInbox(topo.ps, worker_ranks=workers, shard_len=run.codec.push_len(len(master)),
                      dtype=run.codec.push_dtype, clock=run.clock, spares=layout.spare_ranks(),
                      on_transfer=(lambda i: notifier.send(i, wire.TRANSFER)) if serial else None,
                      pool=RECEIVE_POOL if pooled else None,
                      reserve=rounds.expected if rounds and rounds.ordered else None,
                      pieces=send_pieces(run, run.codec)[topo.rank], dead=run.dead)
    side_tasks, bar, evaluator = [("other", watchers.spread_signal(run, window))], None, None
    side_tasks.append(("other", StateDesk(topo.ps, optimizer, len(master), dead=run.dead)))  # ps.optimizer's state
    if topo.rank == 0:
        # evaluate in a helper thread where the pull may run beside the loop (pinned window, THREAD_MULTIPLE)
        # (HPCPS_EVAL_BACKGROUND=0 forces the loop's thread: tools/bench_eval_latency.py compares both)
        background = (window.protocol == "pinned" and MPI.Query_thread() >= MPI.THREAD_MULTIPLE
                      and os.environ.get("HPCPS_EVAL_BACKGROUND", "1") != "0")
        evaluator = Evaluator(model=run.model, flat=run.flat,
                              batches=run.source.test_batches(cfg.eval_batch_size) if run.source else None,
                              evaluate=run.workload.evaluation(),
                              pull=lambda out: window.pull(out, Backoff()), recorder=recorder,
                              clock=run.clock, interval=cfg.eval_interval, target=cfg.stop_target,
                              on_target=window.set_stop, background=background, log_every=cfg.log_every,
                              every=cfg.eval_every, version=lambda: server.version)
        bar = Progress(len(workers) * run.rounds, cfg.paradigm, enabled=cfg.progress, every=cfg.progress_every,
                       accuracy=lambda: evaluator.accuracy)
        side_tasks += [("metrics", recorder.drain), ("evaluate", evaluator.tick)]
        if cfg.divergence == "stop":
            recorder.watchers.setdefault("workers/iterations", []).append(watchers.divergence_watch(run, window))
            recorder.watchers.setdefault("servers/updates", []).append(watchers.nonfinite_start_watch(run, window))
    periodic = policy.periodic_cut() if cfg.checkpoint_every or cfg.checkpoint_interval else None
    if periodic and topo.rank == 0:
        side_tasks.append(("checkpoint", checkpointing.progress_note(run, lambda: server.clocks)))
    # every bsp worker waits at a round's close: bsp checkpoints there, from the publish hook; the others
    # take a consistent cut while the run goes on (hpcps.runtime.snapshot)
    at_publish = periodic is not None and policy.checkpoints_at_publish()
    snapshots = None
    if periodic and not at_publish:
        snapshots = checkpointing.snapshots(run, window, optimizer, policy, RoundCut() if periodic == "rounds" else ClockCut())
        side_tasks.append(("checkpoint", snapshots.tick))
    server = ShardServer(
        shard=topo.rank, rank=topo.rank, policy=policy,
        table="groups/updates" if grouped else "servers/updates",
        inbox=inbox, notifier=notifier, window=window, master=master,
        optimizer=optimizer, n_params=trainable, unit_lr=cfg.lr,
        abort_on_nonfinite=cfg.nonfinite == "abort",
        version=start_version,
        stall_warn=cfg.stall_warn, stall_abort=cfg.stall_limit,
        on_published=checkpointing.checkpointer(run, window, optimizer, lambda: server.clocks) if at_publish else None,
        worker_ranks=workers, recorder=recorder, clock=run.clock,
        progress=lambda: retried(run.dead, lambda: topo.ps.Iprobe(source=MPI.ANY_SOURCE, tag=_PROGRESS_TAG)),
        side_tasks=side_tasks, on_applied=bar.update if bar is not None else None, backoff=run.backoff,
        round_sum=rounds, timeline=timeline(run, recorder), codec=run.codec, spares=spares,
        sender=ParamSender(topo.ps, worker_ranks=workers, ranges=run.slices.local_ranges(topo.rank),
                           length=len(master)) if sends_pulls(run) else None,
    )
    if run.ckpt is not None and not grouped:  # the clocks the workers resume at (one that ended stays there)
        server.clocks = [int(c) for c in run.ckpt.worker_clocks]
        server.gradients_applied = int(sum(server.clocks))  # where hsp's schedule resumes
    if snapshots is not None:
        snapshots.server, snapshots.last_version = server, start_version
    server.run()
    if spares is not None:  # shard 0: no spare will be needed now
        spares.close(run.backoff)
    if snapshots is not None:
        snapshots.finish(run.backoff)  # a checkpoint under way completes; shard 0 says none follows
    run.final_version = server.version
    inbox.free()
    polite_barrier(topo.role_comm, run.backoff)  # every shard has published its final version
    if run.dead is not None and layout.n_servers > 1:
        reconcile_lost(run, server, recorder)
    if evaluator is not None:
        evaluator.pull = lambda out: window.pull(out, Backoff(), exact=True)  # the shards' fp32 masters
        evaluator.evaluate()  # also leaves the final global parameters and buffers in run.model
        run.final_metrics = evaluator.metrics
        bar.close()


def reconcile_lost(run, server: ShardServer, recorder) -> None:
    """Collective over the shards (run-through): a worker that died between its pushes to two shards left a
    gradient one applied and the other never received; each shard records those it lacks as lost (reason 2),
    so every shard accounts for the same pushes."""
    reached = {server.worker_ranks[w]: max([server.clocks[w], *lost])  # received whole, or cut off here
               for w, lost in server.lost_clocks.items()}
    everyone = run.topo.role_comm.allgather(reached)
    t = run.clock()
    for rank, mine in reached.items():
        for clock in range(mine + 1, max(d.get(rank, 0) for d in everyone) + 1):
            recorder.add("servers/lost", (server.rank, server.shard, t, rank, clock, 2))


def shard_optimizer(run, params: np.ndarray, shard: int) -> ShardOptimizer:
    """The optimizer of central shard ``shard``'s trainable values ``params``, cut into the run's param
    groups, its schedule over the run's updates, resumed state."""
    cfg = run.cfg
    groups = shard_groups(run.groups, run.slices.pieces[shard])
    optimizer = ShardOptimizer(torch.from_numpy(params), run.workload.optimizer_factory(cfg), lambda v: 1.0,
                               groups=groups, indices=shard_group_indices(run.groups, run.slices.pieces[shard]))
    # the schedule's floor (--min-lr) is a rate, over the one the optimizer was built with
    optimizer.schedule = schedule(run, optimizer.default_lr or cfg.lr)
    if cfg.stale_momentum == "auto" and cfg.momentum_period == 1:  # (Delayed Nesterov's momentum is its own cure)
        optimizer.stale = StaleMomentum()
    if run.ckpt is not None and run.ckpt.resharded:
        optimizer.load_state_dict(checkpointing.resliced_optimizer_state(run, optimizer, shard))
    elif run.ckpt is not None:
        optimizer.load_state_dict(read_optimizer_state(cfg.resume, run.topo.rank))
    return optimizer


def schedule(run, base_lr: float) -> Schedule:
    """The run's learning-rate schedule (:func:`hpcps.training.rates.schedule`) over its optimizer's rate ``base_lr``."""
    return rates.schedule(run.cfg, run.workload.lr_schedule, horizon(run), base_lr)


def lr_scale(run, extra: bool = False) -> float:
    """A gradient's learning-rate factor in this run (:func:`hpcps.training.rates.lr_scale`)."""
    return rates.lr_scale(run.cfg, len(clients(run)), extra=extra)


def horizon(run) -> int:
    """The updates a central shard applies over the run (:func:`hpcps.training.rates.horizon`)."""
    return rates.horizon(run.cfg, run.rounds, len(clients(run)))


def serve_group(run, central: ParamWindow, window: ParamWindow, recorder) -> None:
    """A group server: BSP over its group (on the group communicator), a client of the central shards."""
    topo, cfg, n = run.topo, run.cfg, run.flat.size
    members = run.layout.group_members()[run.layout.group_of(topo.rank)]
    local = list(range(1, topo.group.size))  # the workers' ranks in the group communicator
    agg = np.zeros(n, np.float32)
    # the round's update goes to the central shards as the wire carries it (--compress), with this group
    # server's own top-k residual; its workers push to it, and pull from its window, the same way
    # (in the central shards' wire order when their slices are striped)
    codec, encode = make_codec(cfg.compress), None
    bounds = run.slices.wire_bounds
    send = agg if codec.identity_push and not run.slices.striped else codec.new_push_buffer(bounds)
    if send is not agg:
        stage = stager(run, codec, torch.from_numpy(agg), bounds, striped=run.slices.striped)
        encode = lambda keep: stage(send, keep)  # noqa: E731
    # --shards-at-once: to one central shard at a time, in a rotation from its group (as a worker from its index)
    central_pusher = Pusher(topo.ps, buffers=[send], shard_ranks=run.shards,
                            bounds=codec.push_bounds(bounds), worker_rank=topo.rank,
                            pieces=send_pieces(run, codec, wire_order=True), fanout=cfg.shards_at_once,
                            first=run.layout.rotation_start(topo.rank))
    central_notices = NoticeBox(topo.ps, shard_ranks=run.shards)
    policy = make_policy(policy_class(cfg.paradigm).group_policy, len(members))
    rounds = RoundSum(n, run.flat.n_params, len(members), policy.active)  # the group's rounds, summed
    inbox = PushInbox(topo.group, worker_ranks=local, shard_len=run.codec.push_len(n), pool=RECEIVE_POOL,
                      reserve=rounds.expected, dtype=run.codec.push_dtype)
    GroupServer(
        shard=0, rank=topo.rank, policy=policy, round_sum=rounds,
        inbox=inbox, notifier=Notifier(topo.group, worker_ranks=local), window=window,
        master=window.master if window.master is not None else np.zeros(n, np.float32),
        n_params=run.flat.n_params, unit_lr=cfg.lr, codec=run.codec, encode=encode,
        worker_ranks=members, recorder=recorder, clock=run.clock,
        progress=lambda: topo.group.Iprobe(source=MPI.ANY_SOURCE, tag=_PROGRESS_TAG),
        abort_on_nonfinite=cfg.nonfinite == "abort", stall_warn=cfg.stall_warn, stall_abort=cfg.stall_limit,
        backoff=run.backoff, central_pusher=central_pusher, central_notices=central_notices,
        side_tasks=[("other", watchers.spread_signal(run, central, own=window))],
        central_window=central, agg=agg, weight=len(members) * run.layout.n_groups / run.layout.n_workers,
        central_rate=run.rate, central_schedule=schedule(run, run.rate),
        timeline=timeline(run, recorder),
    ).run()
    inbox.free()
    central_pusher.free()
    central_notices.free()


def make_worker(run) -> Worker:
    """This worker rank's :class:`~hpcps.runtime.worker.Worker` of the paradigm (its transfers freed by
    :meth:`free_worker`)."""
    topo, cfg, recorder, window = run.topo, run.cfg, run.recorder, run.group_window or run.window
    policy = policy_class(cfg.paradigm)
    codec = run.codec
    grouped = topo.group != MPI.COMM_NULL  # then it pushes to its group server
    bounds = push_slices(run)
    striped = run.slices.striped and not grouped  # then the push leaves in the shards' wire order
    new_buffer = run.flat.new_push_buffer if codec.identity_push else lambda: codec.new_push_buffer(bounds)
    extra, buffers = {}, [run.flat.push_grads if codec.identity_push and not striped else new_buffer()]
    tl = timeline(run, recorder)
    if cfg.partition_mb:  # (on a GPU, each partition goes up to the device as it comes)
        extra["partitions"] = PartitionedPulls(
            run.model, run.flat._spans, stripe_elements(cfg.partition_mb), timeline=tl,
            upload=None if run.flat.transfer == "shared" else run.flat.upload_ranges)
    # pushes from a copy, so that a push leaves while the next pass computes: eager and hsp compute
    # while they wait; a partitioned pull's pass begins while the pull (and the push) are in flight; under
    # --overlap-steps the next round's first steps compute before the grant and the pull
    if cfg.inner_steps is not None and cfg.overlap_steps:  # the next round computes while its push is under way
        extra["defer_pull"] = True
    if policy.eager_pull or policy.extra_gradients or "partitions" in extra or "defer_pull" in extra:
        buffers = extra["send_buffers"] = [new_buffer() for _ in range(2)]
    if striped or not codec.identity_push:  # reordered, encoded (hpcps.transport.compress) into the push buffer
        stage = stager(run, codec, run.flat.grads_t, bounds, striped=striped)
        extra["stage"] = lambda out, keep: (stage(out, keep), run.flat.synchronize())
    if policy.eager_pull:
        extra["bound"] = cfg.staleness  # None: never wait for fresher parameters
    if policy.extra_gradients:
        extra["max_extra"] = cfg.hsp_max_stale
        extra["extra_scale"] = lr_scale(run, extra=True) / lr_scale(run)
    # grouped: talk to the group server, rank 0 of the group communicator
    comm, shards = (topo.group, [0]) if grouped else (topo.ps, run.shards)
    pusher = Pusher(comm, buffers=buffers, shard_ranks=shards, bounds=codec.push_bounds(bounds),
                    worker_rank=topo.rank, serial=policy.serial_transfers,
                    pieces=None if grouped else send_pieces(run, codec, wire_order=True),
                    fanout=cfg.shards_at_once, first=run.layout.rotation_start(topo.rank, run.index))
    notices = NoticeBox(comm, shard_ranks=shards)
    if sends_pulls(run):
        extra["sent_pull"] = lambda out, parts, watch: SentPull(comm, shards, run.slices, out, parts, run.backoff, watch)
    if pushes_during_backward(run, policy, striped, bool(extra.get("send_buffers"))):
        extra["backward_pushes"] = BackwardPushes(
            run.model, run.flat._spans,
            order=[run.slices.send_order(s, run.flat.n_params) for s in range(run.slices.n_shards)],
            bases=[w for w, _ in run.slices.wire_bounds], n_params=run.flat.n_params, grads=run.flat.grads,
            buffers=buffers, send=pusher.start_piece, overflow=codec.overflow)
    worker_class = EagerWorker if policy.eager_pull else HSPWorker if policy.extra_gradients else Worker
    run.model.train()
    run._transfers = (pusher, notices)
    return worker_class(rank=topo.rank, model=run.model, flat=run.flat,
                 window=window, pusher=pusher, notices=notices,
                 blocks=policy.worker_blocks, recorder=recorder,
                 clock=run.clock, steps=run.rounds, lr=cfg.lr * lr_scale(run),
                 lr_staleness=cfg.lr_staleness or policy.default_lr_staleness,
                 faults=[f for f in faults.armed(cfg.faults, os.environ) if f.rank == topo.rank],
                 start_step=run.start_clock,
                 stall_warn=cfg.stall_warn, stall_abort=cfg.stall_limit,
                 backoff=run.backoff, take_signal=run.signals.take, timeline=tl,
                 overflow=codec.overflow, **extra)


def push_slices(run) -> list[tuple[int, int]]:
    """The slices of a worker's push buffer, one per shard (the shards' wire order,
    :mod:`hpcps.cluster.slices`), or (grouped) the whole flat vector, for its group server."""
    return [(0, run.flat.size)] if run.layout.n_groups else run.slices.wire_bounds


def pushes_during_backward(run, policy, striped: bool, slotted: bool) -> bool:
    """Whether a worker pushes each piece of its gradient as backward produces it (in hpcps's own loop,
    :mod:`hpcps.runtime.backward`): its push goes in pieces (striped slices), from a copy, unencoded,
    unclipped, from a CPU worker's flat buffer, without local steps (a round's push follows its last step), under a paradigm that waits for its grant (and whose
    learning rate is known before the pass)."""
    cfg = run.cfg
    return (striped and slotted and cfg.inner_steps is None and run.codec.identity_push and cfg.clip_norm is None
            and run.flat.transfer == "shared" and policy.worker_blocks and not policy.serial_transfers
            and not policy.eager_pull and not policy.extra_gradients
            and (cfg.lr_staleness or policy.default_lr_staleness) == "none")


def send_pieces(run, codec, *, wire_order: bool = False) -> list[list[tuple[int, int]]]:
    """Per central shard, the ranges of a push to it, one message each, in the order they are sent
    (:meth:`hpcps.cluster.slices.Slices.send_order`): in the shard's own slice, or (``wire_order``) in
    a client's push buffer. An encoded push (``--compress``) goes whole."""
    wire_bounds = codec.push_bounds(run.slices.wire_bounds)
    out = []
    for s, (w, end) in enumerate(wire_bounds):
        base = w if wire_order else 0
        order = run.slices.send_order(s, run.flat.n_params)
        out.append([(base + at, base + at + hi - lo) for at, lo, hi in order]
                   if codec.identity_push else [(base, base + end - w)])
    return out


def stager(run, codec, grads: torch.Tensor, bounds: list[tuple[int, int]], *,
            striped: bool) -> Callable[[Any, bool], None]:
    """``stage(out, keep)``: put the flat-order gradient ``grads`` into push buffer ``out`` (cut at
    ``bounds``) as the wire carries it: in the central shards' wire order where their slices are
    striped, encoded under ``--compress`` (``keep``: the gradient is to be applied, see
    hpcps.transport.compress)."""
    if codec.identity_push:
        return lambda out, keep: run.slices.gather(grads, out)
    if not striped:
        return lambda out, keep: codec.encode(grads, out, bounds, keep=keep)
    ordered = torch.empty_like(grads)

    def stage(out, keep: bool) -> None:
        run.slices.gather(grads, ordered)
        codec.encode(ordered, out, bounds, keep=keep)
    return stage


def wire_record(run) -> dict:
    """What one push and one pull move (payload bytes, all shards together), for the run file."""
    codec = run.codec
    push = codec.push_bounds(push_slices(run))[-1][1] * codec.push_dtype.itemsize
    return {**codec.describe(), "push_bytes": push, "pull_bytes": run.flat.size * codec.pull_dtype.itemsize,
            "fp32_bytes": 4 * run.flat.size}


def timeline(run, recorder) -> Timeline | NullTimeline:
    """Where this rank's phases go: ``/timeline`` under ``--timeline``, nowhere otherwise."""
    return Timeline(run.topo.rank, recorder.add, run.clock) if run.cfg.timeline else NullTimeline()


def free_worker(run, worker: Worker) -> None:
    """After the worker left: note the gradients it pushed, free its transfers."""
    run.final_clock = worker.clock_count
    worker.close()
    for transfer in run._transfers:
        transfer.free()
