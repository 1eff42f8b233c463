"""A run's rows as TensorBoard scalars: live from rank 0 (``--tensorboard DIR``) and from finished run files
(``hpcps report RUN.h5 ... --tensorboard DIR``).

Every peer's users watch training in TensorBoard (and W&B and MLflow read the same event files). The
tags, one chart each, by the rank that made the row (``rank3``: a worker's rank in the run)::

    loss/rank3, lr/rank3, staleness/rank3            each worker iteration, at its step
    time/step_s/rank3, time/compute_s/rank3,         the iteration's wall time and its phases
    time/push_s/rank3, time/pull_s/rank3, time/wait_s/rank3
    eval/loss, eval/accuracy, eval/<name>            each evaluation, at the servers' version
    log/<name>/rank3                                 the loop's ps.log(...) values, at its step

A row's wall time is the run's start plus its time in the run (rank 0's clock), so live and exported
events of one run line up. :func:`scalars` is the pure mapping; :class:`Board` writes through
``torch.utils.tensorboard`` (the ``tensorboard`` package: ``pip install "hpcps[tensorboard]"``).
"""

from __future__ import annotations

import math
import os
from typing import Iterator

import numpy as np

from hpcps.errors import UserError

#: the run file's tables a board shows
TABLES = ("workers/iterations", "eval", "eval_metrics", "scalars")
_PHASES = ("compute_s", "push_s", "pull_s", "wait_s")


def scalars(table: str, rows: np.ndarray) -> Iterator[tuple[str, float, int, float]]:
    """``(tag, value, step, seconds into the run)`` for each value of ``rows`` (of run-file table ``table``)
    worth a chart; NaN values (a step without a known loss) are left out."""
    for row in rows:
        for tag, value, step, t in _row(table, row):
            if not math.isnan(value):
                yield tag, value, step, t


def _row(table: str, row) -> list[tuple[str, float, int, float]]:
    if table == "workers/iterations":
        who, step, t = f"rank{int(row['rank'])}", int(row["step"]), float(row["t_end"])
        out = [(f"loss/{who}", float(row["loss"]), step, t), (f"lr/{who}", float(row["lr"]), step, t),
               (f"staleness/{who}", float(row["staleness"]), step, t),
               (f"time/step_s/{who}", float(row["t_end"] - row["t_start"]), step, t)]
        return out + [(f"time/{phase}/{who}", float(row[phase]), step, t) for phase in _PHASES]
    if table == "eval":
        version, t = int(row["version"]), float(row["t"])
        return [("eval/loss", float(row["loss"]), version, t), ("eval/accuracy", float(row["accuracy"]), version, t)]
    if table == "eval_metrics":
        return [(f"eval/{_name(row['name'])}", float(row["value"]), int(row["version"]), float(row["t"]))]
    if table == "scalars":
        return [(f"log/{_name(row['name'])}/rank{int(row['rank'])}", float(row["value"]), int(row["step"]),
                 float(row["t"]))]
    return []


def _name(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def check_installed() -> None:
    """One clear error where the tensorboard package is not installed (at the start, not mid-run)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise UserError("--tensorboard: the tensorboard package is not installed "
                        "(pip install tensorboard, or hpcps[tensorboard])") from None


def summary_writer(logdir: str, flush_secs: int):
    """torch's ``SummaryWriter`` over ``logdir``."""
    check_installed()
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=logdir, flush_secs=flush_secs)


class Board:
    """One run's event files in ``logdir``: :meth:`write` a table's rows as they come; ``start`` is the run's
    start in Unix seconds (rows carry seconds into the run)."""

    def __init__(self, logdir: str, start: float, *, flush_secs: int = 5) -> None:
        os.makedirs(logdir, exist_ok=True)
        self.logdir, self.start = logdir, start
        self.writer = summary_writer(logdir, flush_secs)

    def write(self, table: str, rows: np.ndarray) -> None:
        for tag, value, step, t in scalars(table, rows):
            self.writer.add_scalar(tag, value, global_step=step, walltime=self.start + t)

    def watcher(self, table: str):
        """A callable that writes ``table``'s rows (a recorder's watcher, :mod:`hpcps.metrics.recorder`)."""
        return lambda rows: self.write(table, rows)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def run_logdir(base: str, run_path: str) -> str:
    """Where a run's events go under ``base``: a folder named after its run file, so that the runs of one
    ``--tensorboard`` folder show side by side."""
    return os.path.join(base, os.path.splitext(os.path.basename(run_path))[0])


def export(paths: list[str], base: str) -> list[str]:
    """Finished run files as event files, each in its own folder of ``base`` (:func:`run_logdir`); return the
    folders."""
    import datetime

    import h5py

    folders = []
    for path in paths:
        with h5py.File(path, "r") as f:
            started = f.attrs.get("start_time", "")
            start = datetime.datetime.fromisoformat(started).timestamp() if started else 0.0
            board = Board(run_logdir(base, path), start)
            try:
                for table in TABLES:
                    if table in f:
                        board.write(table, f[table][()])
            finally:
                board.close()
        folders.append(board.logdir)
    return folders
