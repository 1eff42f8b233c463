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
from hpcps.runtime import assembly, checkpointing
from hpcps.transport.mpilib import library_version

log = logging.getLogger("hpcps")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def rank_row(run) -> tuple:
    """This rank's ``/ranks`` row: role, host, peak resident memory, samples read from a streamed set,
    clock offset, device."""
    read = getattr(run.source, "samples_read", -1) if run.source is not None else 0
    return (run.topo.rank, run.topo.role.value.encode(), node_label(socket.gethostname()).encode()[:64],
            peak_rss_bytes(), read, run.run_clock.offset, run.run_clock.uncertainty,
            str(run.flat.device).encode()[:16])


def save_path(run, path: str) -> str:
    """``--save``, or the metrics file's name with ``.pt``."""
    return run.cfg.save or os.path.splitext(path)[0] + ".pt"


def note_restart(run, runfile: RunFile) -> None:
    """Rank 0, at the run's start (every rank set up, the clocks agreed): what the launch that failed after the
    checkpoint this run resumes lost, from its progress note (:func:`hpcps.runtime.checkpointing.restart_cost`),
    into the run file's ``restart`` attribute and the log. Taken here rather than when the file opens, so that
    its ``restart_s`` holds the whole start-up (windows, optimizers, the start barrier), not only the relaunch."""
    if run.ckpt is None:
        return
    written = run.ckpt.written_clocks if run.ckpt.redealt else run.ckpt.worker_clocks
    restart = checkpointing.restart_cost(run.cfg.resume, written, time.time())
    if restart:
        log.info("the launch before this one lost %d gradient(s) past the checkpoint and %.1f s after it, and "
                 "%.1f s went to the relaunch and this start-up", restart["gradients_repeated"],
                 restart["training_lost_s"], restart["restart_s"])
        runfile.set_attrs(restart=json.dumps(restart))


def open_runfile(run, path: str) -> RunFile:
    save = save_path(run, path)
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
            "restart": "{}",  # note_restart(), once every rank is set up
            "config": json.dumps(run.cfg.as_json_dict(), sort_keys=True),
            "paradigm": run.cfg.paradigm,
            "world_size": run.layout.world_size,
            "n_workers": run.layout.n_workers,
            "n_servers": run.layout.n_servers,
            "n_groups": run.layout.n_groups,
            "steps_per_worker": run.steps,
            "groups": json.dumps({run.layout.group_server_rank(g): members
                                  for g, members in enumerate(run.layout.group_members())}),
            "resumed_from": run.cfg.resume or "",
            "start_version": run.ckpt.version if run.ckpt else 0,
            "resumed_shape": run.ckpt.describe_shape() if run.ckpt else "",
            "mpi_library": library_version(),
            "devices": json.dumps(run.devices),
            "placement": json.dumps({"mode": run.cfg.placement, "world_rank_of": run.world_ranks}),
            "cluster": json.dumps(cluster_record() or {"emulated": False}),
            "dataset_kind": run.facts["kind"],
            "compress": json.dumps(assembly.wire_record(run)),
            "pull": "send" if assembly.sends_pulls(run) else "get",
            "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        })
    except OSError as exc:
        raise UserError(f"--out {path}: cannot create the metrics file ({exc})") from None
