"""A run's checkpoints: periodic ones (bsp's at a round's close, from the publish hook; the others as a
consistent cut while the run goes on, :mod:`hpcps.runtime.checkpoints.cut`), the one a stop signal writes, and a
shard's optimizer state cut from a checkpoint of another shape."""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import time
from contextlib import suppress
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

from hpcps.cluster.slices import Slices
from hpcps.options.config import TrainConfig
from hpcps.policies import Policy
from hpcps.errors import UserError
from hpcps.runtime.faults import ATTEMPT_VAR
from hpcps.runtime.checkpoints.files import (SPANS_KEY, LoopState, checkpoint_path, newest_complete,
                                             optimizer_state_path, read_optimizer_state, write_checkpoint,
                                             write_optimizer_state, write_user_state)
from hpcps.runtime.checkpoints.cut import ClockCut, RoundCut, Snapshots
from hpcps.training.optim import ShardOptimizer
from hpcps.training.optstate import cut, from_shard, join, to_shard
from hpcps.training.paramgroups import group_breaks, shard_groups
from hpcps.transport.poll import Backoff, polite_barrier
from hpcps.transport.window import ParamWindow

from hpcps.runtime.plan import RunPlan, RunState, ran_config

log = logging.getLogger("hpcps")


def checkpoint_dir(cfg: TrainConfig, metrics_path: str) -> str:
    """``--checkpoint-dir``, else the run's own: ``$HPCPS_RUN_DIR/checkpoints`` in a job of ``hpcps jobs
    render``, else beside the metrics file (``runs/bsp-<time>-checkpoints``), never shared by two runs."""
    if cfg.checkpoint_dir:
        return cfg.checkpoint_dir
    if os.environ.get("HPCPS_RUN_DIR"):
        return os.path.join(os.environ["HPCPS_RUN_DIR"], "checkpoints")
    return os.path.splitext(metrics_path)[0] + "-checkpoints"


def resolve_resume(cfg: TrainConfig) -> TrainConfig:
    """``--resume auto``: ``cfg`` resuming the newest complete checkpoint of the run's checkpoint directory,
    or starting afresh (``resume`` None) where it holds none; the log says which. Other values unchanged.

    The directory must outlive the run for a relaunch to find it: ``--checkpoint-dir``, the one beside
    ``--out``, or a batch job's ``$HPCPS_RUN_DIR/checkpoints``; a default metrics file is named by the
    time, so each launch would look in a new, empty directory."""
    if cfg.resume != "auto":
        return cfg
    if not (cfg.checkpoint_dir or cfg.out or os.environ.get("HPCPS_RUN_DIR")):
        raise UserError("--resume auto needs a checkpoint directory that the next launch finds again: give "
                        "--checkpoint-dir DIR or --out FILE.h5 (checkpoints then go beside it), or run in a job "
                        "of hpcps jobs render")
    directory = checkpoint_dir(cfg, cfg.out or "")
    found = newest_complete(directory)
    if found is None:
        log.info("--resume auto: no complete checkpoint in %s: starting afresh", directory)
        return cfg.model_copy(update={"resume": None})
    path, clocks = found
    log.info("--resume auto: resuming from %s, the newest complete checkpoint (workers' clocks %s)", path,
             ", ".join(map(str, clocks.tolist())))
    stale = _newer_files(directory, path)
    for name in stale:  # parts of a checkpoint the failed launch did not finish: the run writes its own
        with suppress(FileNotFoundError):
            os.remove(name)
    if stale:
        log.info("--resume auto: removed %d file(s) of incomplete checkpoints newer than it", len(stale))
    return cfg.model_copy(update={"resume": path})


#: rank 0's note of the run's progress beside its checkpoints: what a restart repeats is measured from it
PROGRESS_NOTE = "progress.json"


def progress_note(plan: RunPlan, state: RunState, clocks: Callable[[], list[int]],
                  every: float = 0.25) -> Callable[[], None]:
    """A side task of shard 0 under periodic checkpoints: every ``every`` seconds, the workers' clocks (the
    gradients it has received from each) and the wall time, into ``<checkpoint dir>/progress.json``
    (atomically), so that a launch that resumes after a failure can say what the failure cost
    (:func:`restart_cost`)."""
    path = os.path.join(state.ckpt_dir, PROGRESS_NOTE)
    last = [-math.inf]

    def tick() -> None:
        now = time.monotonic()
        if now - last[0] < every:
            return
        last[0] = now
        os.makedirs(state.ckpt_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"clocks": [int(c) for c in clocks()], "time": time.time()}, f)
        os.replace(path + ".tmp", path)

    return tick


def restart_cost(resume: str, written_clocks, now: float) -> dict | None:
    """What the launch that ended after the checkpoint ``resume`` was written lost, from its progress note
    beside it: the gradients shard 0 had received past the checkpoint (their work is done again now), the
    seconds from the checkpoint to the last note (training, and waiting for a dead rank until the launcher ended
    the job), and the seconds from its last note to ``now`` (the failure's detection, the relaunch and this
    start-up; at most one note period, 0.25 s, of it training). A note no newer than the checkpoint (the launch
    ended within a note period of it, or a stop's own checkpoint) counts from the checkpoint: nothing repeated,
    no training lost. None where there is no note (no periodic checkpoints)."""
    note = os.path.join(os.path.dirname(os.path.abspath(resume)), PROGRESS_NOTE)
    try:
        with open(note) as f:
            last = json.load(f)
        written = os.path.getmtime(resume)
    except (OSError, ValueError):
        return None
    if last.get("time", 0) <= written:
        last = {"clocks": [int(c) for c in written_clocks], "time": written}
    return {"checkpoint": resume, "attempt": int(os.environ.get(ATTEMPT_VAR, "1")),
            "gradients_repeated": max(0, sum(last["clocks"]) - int(np.sum(written_clocks))),
            "training_lost_s": round(last["time"] - written, 3), "restart_s": round(now - last["time"], 3)}


def _newer_files(directory: str, path: str) -> list[str]:
    """The files of checkpoints in ``directory`` numbered after the checkpoint ``path`` (step-NNNNNN.*)."""
    def number(name: str) -> int | None:
        head = os.path.basename(name).split(".")[0]
        return int(head[5:]) if head.startswith("step-") and head[5:].isdigit() else None

    mine = number(path)
    return sorted(name for name in glob.glob(os.path.join(directory, "step-*"))
                  if os.path.isfile(name) and (number(name) or -1) > mine)


def pull_at(window: ParamWindow, buf: np.ndarray, versions: list[int]) -> None:
    """Pull every shard's fp32 parameters into ``buf`` as published at ``versions`` (one per shard), pulling
    again while a shard has not published its yet (its publish, or rank 0's own, may have been deferred
    for a lapped reader): for a checkpoint, taken while no shard steps past those versions."""
    got, _ = window.pull(buf, Backoff(), exact=True)
    while got.tolist() != list(versions):
        window.publish_held()
        got, _ = window.pull(buf, Backoff(), exact=True)


def checkpoint_at_stop(plan: RunPlan, state: RunState, comm: MPI.Comm, loop: LoopState | None) -> str:
    """Collective: the checkpoint of a run a signal stopped (every pushed gradient applied by now).

    Each shard writes its optimizer state and rank 0 the final parameters
    (which its final evaluation pulled), every shard's version and every
    worker's clock: the gradients it pushed, where its resumed run starts.
    A worker that died (run-through) has none to give: its clock is the
    gradients every shard received whole from it (the least over the
    shards), so the resumed run pushes again a gradient the death cut off.
    Returns the path (on every rank).
    """
    shard_versions = [v for v in comm.allgather(state.final_version) if v is not None]
    clocks = comm.gather((state.index, state.final_clock), root=0)  # by worker index (a spare's: its place's)
    received = [c for c in comm.gather(state.final_clocks, root=0) or []  # (grouped: the groups' clocks)
                if c is not None and len(c) == plan.layout.n_workers]
    path = checkpoint_path(state.ckpt_dir, shard_versions[0])
    if state.optimizer is not None:
        write_optimizer_state(path, state.topo.rank, state.optimizer.state_dict(),
                              state.policy.state_dict() if state.policy is not None else None,
                              spans=state.optimizer.spans)
    if loop:  # worker 0's loop: its fields, its optimizer's hyperparameters, its integer buffers
        write_user_state(path, loop)
    if comm.rank == 0:
        worker_clocks = np.min(received, axis=0).astype(np.int64) if received else \
            np.zeros(plan.layout.n_workers, np.int64)
        for index, clock in clocks:
            if clock is not None and index is not None:
                worker_clocks[index] = clock
        write_checkpoint(path, state.flat.params, version=shard_versions[0], worker_clocks=worker_clocks,
                         config=ran_config(plan, state), n_servers=plan.layout.n_servers,
                         shard_versions=shard_versions)
    polite_barrier(comm, state.backoff)  # every part is written before anyone says so
    return path


def resliced_optimizer_state(plan: RunPlan, state: RunState, optimizer: ShardOptimizer, shard: int) -> dict:
    """This shard's optimizer state, cut from a checkpoint written by shards sliced otherwise (another
    count, or another stripe): each written shard's state laid over the flat vector, then cut at this
    shard's chunks (:mod:`hpcps.training.optstate`)."""
    cfg, ckpt, n_params, size = plan.cfg, plan.ckpt, plan.n_params, plan.size
    written = Slices.plan(size, n_params, ckpt.written_servers, ckpt.written_stripe,
                          breaks=group_breaks(plan.groups), align=ckpt.written_align)
    parts = []
    for s in range(written.n_shards):
        n = written.trainable(s, n_params)
        state = read_optimizer_state(cfg.resume, s) if n else {}
        spans = state.pop(SPANS_KEY, None) or (ShardOptimizer(
            torch.zeros(n), plan.workload.optimizer_factory(cfg), lambda v: 1.0,
            groups=shard_groups(plan.groups, written.pieces[s])).uncut_spans if state else [])
        parts.append(from_shard(state, spans, written.length(s)))
    flat = join(parts, written.put, size)
    if optimizer.optimizer is None or not flat:
        return {}
    return to_shard(cut(flat, lambda v: plan.slices.take(shard, v)), optimizer.spans, optimizer.state_dict())


def snapshots(plan: RunPlan, state: RunState, window: ParamWindow, optimizer: ShardOptimizer, policy: Policy,
              cut: ClockCut | RoundCut) -> Snapshots:
    """This shard's side of the periodic checkpoints taken as a consistent cut (:mod:`hpcps.runtime.checkpoints.cut`):
    its part is its optimizer and paradigm state; shard 0 also reads every shard's parameters at the
    cut's versions and writes the checkpoint."""
    cfg, rank = plan.cfg, state.topo.rank

    def write_part(path: str) -> None:
        write_optimizer_state(path, rank, optimizer.state_dict(), policy.state_dict(), spans=optimizer.spans)

    def write_main(staging: str, cut_clocks: list[int], versions: list[int]) -> str:
        clocks = worker_clocks_at(plan, cut_clocks)
        buf = np.empty(plan.size, np.float32)
        pull_at(window, buf, versions)
        path = checkpoint_path(state.ckpt_dir, versions[0])
        for shard in range(plan.layout.n_servers):  # the parts beside it; the main file last, so a
            os.replace(optimizer_state_path(staging, shard), optimizer_state_path(path, shard))  # whole one
        write_checkpoint(path, buf, version=versions[0], worker_clocks=clocks, config=ran_config(plan, state),
                         n_servers=plan.layout.n_servers, shard_versions=versions)
        return path

    def discard(staging: str) -> None:
        for shard in range(plan.layout.n_servers):
            with suppress(FileNotFoundError):
                os.remove(optimizer_state_path(staging, shard))

    return Snapshots(state.topo.role_comm, every=cfg.checkpoint_every, interval=cfg.checkpoint_interval,
                     write_part=write_part, write_main=write_main, discard=discard, cut=cut,
                     path_for=lambda epoch: os.path.join(state.ckpt_dir, f"cut-{epoch:06d}.h5"))


def worker_clocks_at(plan: RunPlan, cut: list[int]) -> list[int]:
    """Each worker's clock at a cut of the central shards' clients' clocks: the workers' own, or
    (grouped) each group's rounds of this run after its members' clock at the start. A group's round in
    progress at the group server is not in the cut: its members push it again on resume."""
    layout = plan.layout
    if not layout.n_groups:
        return list(cut)
    clocks = [0] * layout.n_workers
    for g, members in enumerate(layout.group_members()):
        for rank in members:
            w = layout.worker_index(rank)
            clocks[w] = int(cut[g]) + plan.worker_start(w)
    return clocks


def checkpointer(plan: RunPlan, state: RunState, window: ParamWindow, optimizer: ShardOptimizer, policy: Policy,
                 clocks: Callable[[], list[int]]):
    """Every shard's ``on_published``: every ``--checkpoint-every`` versions, checkpoint.

    Each shard writes its optimizer state; rank 0 also snapshots all
    shards' parameters, and each worker's clock as its shard knows it
    (``clocks()``: the gradients it pushed; a worker that left early
    stays at its last). Called after the shard published version v and
    before it grants anyone, so under BSP every worker is blocked and
    every other shard is at v or about to be (its round-v pushes are in
    flight): rank 0 pulls until all are at v.
    """
    cfg, rank = plan.cfg, state.topo.rank
    buf = np.empty(plan.size, np.float32) if rank == 0 else None

    def on_published(version: int) -> None:
        if version % cfg.checkpoint_every:
            return
        path = checkpoint_path(state.ckpt_dir, version)  # (a plug-in built on bsp may keep state of its own)
        write_optimizer_state(path, rank, optimizer.state_dict(), policy.state_dict(), spans=optimizer.spans)
        if rank != 0:
            return
        pull_at(window, buf, [version] * plan.layout.n_servers)
        write_checkpoint(path, buf, version=version, worker_clocks=list(clocks()),
                         config=ran_config(plan, state), n_servers=plan.layout.n_servers,
                         loop_part=True)  # worker 0's loop writes its part at its next training pass
        log.info("checkpoint of version %d written to %s", version, path)

    return on_published
