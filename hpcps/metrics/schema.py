"""HDF5 metrics schema, version 3 (pure numpy; no MPI, no h5py).

Times are seconds since the run's start on rank 0's clock (hpcps.transport.clocksync).
Ranks are ranks of the run's communicator (``COMM_WORLD`` for the CLI).
"""

from __future__ import annotations

import numpy as np

SCHEMA_VERSION = 10  # 2: workers/iterations.lag, servers/transfers; 3: eval_metrics, ranks, saved_model, dataset_kind;
#                     4: workers/scalars, optimizer; 5: timeline; 6: servers/updates.lr, reason 3;
#                     7: servers/hypers; 8: servers/updates.momentum; 9: servers/lost, gradients_lost, workers_lost;
#                     10: servers/joins, workers_joined

#: ``/workers/iterations``: one row per worker iteration (= one gradient pushed).
#: ``version``: version the gradient was computed on (smallest over shards);
#: ``staleness``: server version at apply minus ``version`` (largest over
#: shards; -1 if the gradient was dropped); ``lr_staleness``: the staleness
#: the worker knew of when it pushed (newest version seen minus ``version``),
#: from which its rate was scaled; ``lr``: the learning rate applied to the
#: gradient: the optimizer's own rate x the schedule at the version it was
#: applied to x the worker's staleness factor (NaN if it was dropped); ``wait_s``: blocked on the paradigm's grant;
#: ``push_s``: in push calls and waiting for a push to leave; ``pull_s``: the
#: pull's own duration; ``pull_wait_s``: the part of it the worker waited for
#: (equal to ``pull_s`` unless the pull overlapped compute, as in eager, where it is
#: the wait for a fresh enough snapshot plus taking it into the model: a pointer swap on the CPU, a copy on a GPU;
#: with ``--partition-mb`` both also count the pass's waits for its pull's partitions, which ``compute_s`` does not);
#: ``lag``: when computing started, the newest version the worker knew of
#: minus ``version`` (largest over shards; eager's ``--staleness`` bounds it).
ITERATION = np.dtype([
    ("rank", "i4"), ("step", "i8"), ("t_start", "f8"), ("t_end", "f8"),
    ("compute_s", "f8"), ("push_s", "f8"), ("pull_s", "f8"), ("wait_s", "f8"),
    ("version", "i8"), ("staleness", "i8"), ("lr", "f8"), ("loss", "f8"),
    ("pull_wait_s", "f8"), ("lr_staleness", "i8"), ("lag", "i8"),
])

#: ``/servers/updates``: one row per gradient per shard, applied or dropped.
#: ``worker`` is the pushing worker's rank; ``worker_clock`` its clock after the
#: push (1 for its first gradient); ``version`` the shard version the
#: gradient was applied to; ``threshold`` the staleness bound in force (-1:
#: none); ``applied`` 1 or 0, and then ``reason`` says why (see REASONS); ``lr`` the learning
#: rate the update was applied at: the optimizer's own rate (its first param group's) x the
#: schedule at ``version`` x the update's factor (``--lr-scaling``, staleness, the paradigm's
#: weight, and ``--stale-momentum``'s rate factor); a group server's rows: ``--lr`` x the factor, before the
#: central schedule (NaN: dropped); ``momentum`` the momentum the update was applied with (its first param
#: group's, after ``--stale-momentum auto`` lowered it by what staleness adds: hpcps.training.momentum; NaN:
#: dropped, an optimizer without momentum, a group server's row).
UPDATE = np.dtype([
    ("rank", "i4"), ("shard", "i4"), ("t", "f8"), ("worker", "i4"), ("worker_clock", "i8"),
    ("version", "i8"), ("staleness", "i8"), ("threshold", "i8"), ("applied", "i1"), ("reason", "i1"),
    ("lr", "f8"), ("momentum", "f8"),
])

#: ``/servers/transfers`` (hsp): one row per gradient streamed into a shard under serial
#: transfers: the shard's rank and index, the worker's rank, when the shard told the worker to
#: send (``t_begin``) and when the gradient had arrived (``t_end``), on the shard's clock.
TRANSFER = np.dtype([("rank", "i4"), ("shard", "i4"), ("worker", "i4"), ("t_begin", "f8"), ("t_end", "f8")])

#: ``/servers/lost`` (run-through on ULFM: docs/running.md): a worker that died, one row per shard with
#: ``reason`` 0 (``worker_clock``: the last of its gradients the shard received), then one row per gradient of
#: it the shard will never apply (``worker_clock``: that gradient's clock), ``reason`` saying why (LOST_REASONS).
LOST = np.dtype([("rank", "i4"), ("shard", "i4"), ("t", "f8"), ("worker", "i4"), ("worker_clock", "i8"),
                 ("reason", "i1")])
LOST_REASONS = {0: "the worker died", 1: "its worker died while pushing it",
                2: "received by another shard: its worker died between the two"}
#: ``reason`` codes of ``/servers/updates``
REASONS = {0: "applied", 1: "non-finite gradient", 2: "skipped by its worker", 3: "dropped by the paradigm"}

#: ``/eval``: one row per evaluation of the global parameters on the held-out set.
#: ``/servers/joins`` (``--spare-workers``): a spare that took a dead worker's place, one row per shard:
#: ``worker`` the dead worker's rank, ``spare`` the spare's, ``worker_clock`` the dead worker's gradients
#: that shard had received whole when the spare joined (shard 0's: the spare pushes from the next on).
JOIN = np.dtype([("rank", "i4"), ("shard", "i4"), ("t", "f8"), ("worker", "i4"), ("spare", "i4"),
                 ("worker_clock", "i8")])

EVAL = np.dtype([("t", "f8"), ("version", "i8"), ("loss", "f8"), ("accuracy", "f8")])

#: ``/eval_metrics``: the named metrics of an evaluation other than loss and accuracy (a user's
#: evaluation function may return any), one row per metric per evaluation.
EVAL_METRIC = np.dtype([("t", "f8"), ("version", "i8"), ("name", "S32"), ("value", "f8")])

#: ``/workers/scalars``: the numbers a training loop logs itself (``ps.log(name=value)``, the step
#: API): the worker's rank, the step it was computing, the run's clock, the name and the value.
SCALAR = np.dtype([("rank", "i4"), ("step", "i8"), ("t", "f8"), ("name", "S32"), ("value", "f8")])

#: ``/servers/hypers``: a hyperparameter of the shard's optimizer as a loop's ``ps.optimizer`` edit set it
#: (hpcps.training.hyper), from the update at ``version`` on: one row per changed value per group per
#: shard (``worker``: the rank whose edit it is; ``lr`` the group's base rate; a tuple's element i
#: is named ``name[i]``, as Adam's ``betas[0]``)
HYPER = np.dtype([("rank", "i4"), ("shard", "i4"), ("t", "f8"), ("worker", "i4"), ("version", "i8"),
                  ("group", "i4"), ("name", "S32"), ("value", "f8")])

#: ``/ranks``: one row per rank, written at the end of the run: its role (server, group, worker),
#: host name, peak resident memory (``getrusage``), and the training or held-out samples it read
#: from a streamed data set (-1 where the data are not counted: in memory, or not streamed), and its
#: clock's offset to rank 0's with the offset's uncertainty (both 0 on rank 0's node, whose ranks
#: share its clock; see hpcps.transport.clocksync), and the device its tensors live on (``cpu``,
#: ``cuda:0``; server ranks are always ``cpu``).
RANK = np.dtype([("rank", "i4"), ("role", "S8"), ("host", "S64"), ("peak_rss_bytes", "i8"),
                 ("samples_read", "i8"), ("clock_offset_s", "f8"), ("clock_uncertainty_s", "f8"),
                 ("device", "S16")])

#: ``/timeline`` (``--timeline``): each rank's time as contiguous phase spans (hpcps.metrics.timeline):
#: the rank, the phase's code (``PHASES`` there), the step it belongs to (a shard's version, a
#: worker's step), and the span's begin and end on the run's clock.
TIMELINE = np.dtype([("rank", "i4"), ("phase", "i1"), ("step", "i8"), ("t_begin", "f8"), ("t_end", "f8")])

#: ``/groups/updates`` (grouped paradigm): the central shards' rows, one per group update
#: applied (``worker`` is the group server's rank, ``worker_clock`` its round); the rows of
#: ``/servers/updates`` are then the group servers', one per worker gradient.
TABLES = {
    "workers/iterations": ITERATION,
    "servers/updates": UPDATE,
    "groups/updates": UPDATE,
    "servers/transfers": TRANSFER,
    "servers/lost": LOST,
    "servers/joins": JOIN,
    "eval": EVAL,
    "eval_metrics": EVAL_METRIC,
    "workers/scalars": SCALAR,
    "servers/hypers": HYPER,
    "ranks": RANK,
    "timeline": TIMELINE,
}

ROOT_ATTRS = ("schema_version", "hpcps_version", "config", "paradigm", "world_size",
              "n_workers", "n_servers", "n_groups", "mpi_library", "start_time")

SUMMARY_ATTRS = ("wall_s", "gradients_pushed", "gradients_applied", "gradients_dropped", "gradients_lost",
                 "workers_lost", "workers_joined",
                 "final_accuracy", "final_loss", "time_to_target_s")


def summarize(iterations: np.ndarray, updates: np.ndarray, evals: np.ndarray, *,
              wall_s: float, target=None, eval_metrics: np.ndarray | None = None,
              lost: np.ndarray | None = None, joins: np.ndarray | None = None) -> dict[str, float | int]:
    """The ``/summary`` attributes, derived from the tables so they always agree.

    Every gradient is recorded once per shard; counts use shard 0's rows. A worker that died (``lost``,
    run-through) recorded its pushes in rows that partly died with it: its pushes are counted from the
    shards' side, what shard 0 applied, dropped and lost of them. ``target`` is a
    :class:`hpcps.options.targets.Target` (or a number: an accuracy to reach), read from ``/eval``
    for loss and accuracy and from ``eval_metrics`` for the evaluation's other names.
    """
    from hpcps.options.targets import Target

    first_shard = updates[updates["shard"] == 0]
    applied = int(first_shard["applied"].sum())
    lost = lost[lost["shard"] == 0] if lost is not None else np.zeros(0, LOST)
    dead = set(lost["worker"][lost["reason"] == 0].tolist())
    n_lost = int((lost["reason"] != 0).sum())
    pushed = len(iterations)
    if dead:  # the living's rows, and what shard 0 applied, dropped and lost of the dead's
        pushed = (int((~np.isin(iterations["rank"], list(dead))).sum()) +
                  int(np.isin(first_shard["worker"], list(dead)).sum()) + n_lost)
    if isinstance(target, (int, float)):
        target = Target("accuracy", ">=", float(target))
    if target is None:
        reached = float("nan")
    elif target.name in ("loss", "accuracy"):
        reached = target.first_time(evals["t"], evals[target.name])
    else:
        rows = eval_metrics[eval_metrics["name"] == target.name.encode()[:32]] if eval_metrics is not None else []
        reached = target.first_time(rows["t"], rows["value"]) if len(rows) else float("nan")
    return {
        "wall_s": float(wall_s),
        "gradients_pushed": int(pushed),
        "gradients_applied": applied,
        "gradients_dropped": int(len(first_shard) - applied),
        "gradients_lost": n_lost,
        "workers_lost": len(dead),
        "workers_joined": int((joins["shard"] == 0).sum()) if joins is not None else 0,
        "final_accuracy": float(evals["accuracy"][-1]) if len(evals) else float("nan"),
        "final_loss": float(evals["loss"][-1]) if len(evals) else float("nan"),
        "time_to_target_s": reached,
    }
