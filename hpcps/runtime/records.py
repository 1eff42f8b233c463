"""What a run writes of itself in its run file: the file and its attributes, each rank's ``/ranks`` row."""

from __future__ import annotations

import datetime
import json
import logging
import os
import resource
import socket
import sys
import time

import hpcps
from hpcps.box import cluster_record, node_label
from hpcps.errors import UserError
from hpcps.metrics.runfile import RunFile
from hpcps.runtime import assembly
from hpcps.runtime.checkpoints import schedule as checkpointing
from hpcps.transport.mpilib import library_version

from hpcps.runtime.plan import RunPlan, RunState

log = logging.getLogger("hpcps")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def rank_row(plan: RunPlan, state: RunState) -> tuple:
    """This rank's ``/ranks`` row: role, host, peak resident memory, samples read from a streamed set,
    clock offset, device."""
    read = getattr(state.source, "samples_read", -1) if state.source is not None else 0
    return (state.topo.rank, state.topo.role.value.encode(), node_label(socket.gethostname()).encode()[:64],
            peak_rss_bytes(), read, state.run_clock.offset, state.run_clock.uncertainty,
            str(state.flat.device).encode()[:16])


def save_path(plan: RunPlan, path: str) -> str:
    """``--save``, or the metrics file's name with ``.pt``."""
    return plan.cfg.save or os.path.splitext(path)[0] + ".pt"


def note_restart(plan: RunPlan, runfile: RunFile) -> None:
    """Rank 0, at the run's start (every rank set up, the clocks agreed): what the launch that failed after the
    checkpoint this run resumes lost, from its progress note (:func:`hpcps.runtime.checkpoints.schedule.restart_cost`),
    into the run file's ``restart`` attribute and the log. Taken here rather than when the file opens, so that
    its ``restart_s`` holds the whole start-up (windows, optimizers, the start barrier), not only the relaunch."""
    if plan.ckpt is None:
        return
    written = plan.ckpt.written_clocks if plan.ckpt.redealt else plan.ckpt.worker_clocks
    restart = checkpointing.restart_cost(plan.cfg.resume, written, time.time())
    if restart:
        log.info("the launch before this one lost %d gradient(s) past the checkpoint and %.1f s after it, and "
                 "%.1f s went to the relaunch and this start-up", restart["gradients_repeated"],
                 restart["training_lost_s"], restart["restart_s"])
        runfile.set_attrs(restart=json.dumps(restart))


def keep_earlier(path: str) -> str | None:
    """Where a file already at ``path`` is kept (renamed to ``<stem>.<n><ext>``, the first ``n`` free), or
    None where there was none: a run never writes over an earlier run's metrics, and says where they went."""
    if not os.path.exists(path):
        return None
    stem, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(f"{stem}.{n}{ext}"):
        n += 1
    os.replace(path, f"{stem}.{n}{ext}")
    return f"{stem}.{n}{ext}"


def open_runfile(plan: RunPlan, state: RunState, path: str) -> RunFile:
    save = save_path(plan, path)
    save_dir = os.path.dirname(os.path.abspath(save))
    try:  # refuse at the start, not after hours of training
        os.makedirs(save_dir, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--save {save}: cannot create its directory ({exc})") from None
    if not os.access(save_dir, os.W_OK):
        raise UserError(f"--save {save}: directory {save_dir} is not writable")
    kept = keep_earlier(path)
    if kept:
        log.info("--out %s held an earlier run's metrics: kept as %s (a run file is never overwritten)", path, kept)
    try:
        return RunFile(path, {
            "hpcps_version": hpcps.__version__,
            "restart": "{}",  # note_restart(), once every rank is set up
            "config": json.dumps(plan.cfg.as_json_dict(), sort_keys=True),
            "paradigm": plan.cfg.paradigm,
            "world_size": plan.layout.world_size,
            "n_workers": plan.layout.n_workers,
            "n_servers": plan.layout.n_servers,
            "n_groups": plan.layout.n_groups,
            "steps_per_worker": plan.steps,
            "groups": json.dumps({plan.layout.group_server_rank(g): members
                                  for g, members in enumerate(plan.layout.group_members())}),
            "resumed_from": plan.cfg.resume or "",
            "start_version": plan.ckpt.version if plan.ckpt else plan.shard_start(0),
            "start_iteration": plan.start_iteration,
            "resumed_shape": plan.ckpt.describe_shape() if plan.ckpt else "",
            "mpi_library": library_version(),
            "devices": json.dumps(plan.devices),
            "placement": json.dumps({"mode": plan.cfg.placement, "world_rank_of": plan.world_ranks}),
            "cluster": json.dumps(cluster_record() or {"emulated": False}),
            "dataset_kind": plan.facts["kind"],
            "compress": json.dumps(assembly.wire_record(plan)),
            "pull": "send" if assembly.sends_pulls(plan, state) else "get",
            "release": "pieces" if assembly.releases_pieces(plan, state) else "whole",
            "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        })
    except OSError as exc:
        raise UserError(f"--out {path}: cannot create the metrics file ({exc})") from None
