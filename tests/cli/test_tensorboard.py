"""A run watched in TensorBoard: rank 0 writes the rows live (--tensorboard), and hpcps report exports a
finished run file; tensorboard's own reader (EventAccumulator) reads back the run's loss and lr."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from launching import failure, launch, needs_mpiexec

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _read(folder) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _rows(path, rank: int, column: str) -> list[tuple[int, float]]:
    with h5py.File(path) as f:
        it = f["workers/iterations"][()]
    mine = np.sort(it[it["rank"] == rank], order="step")
    return [(int(r["step"]), float(np.float32(r[column]))) for r in mine]


@needs_mpiexec
def test_live_and_exported_events_hold_the_runs_loss_and_lr(tmp_path):
    out, live = tmp_path / "bsp.h5", tmp_path / "live"
    done = launch(3, sys.executable, "-m", "hpcps", "train", "--paradigm", "bsp", "--steps", "12", "--dataset",
                  "digits", "--model", "mlp", "--lr-schedule", "cosine", "--eval-interval", "0.2", "--out", str(out),
                  "--tensorboard", str(live), "--no-progress", timeout=120)
    assert done.returncode == 0, failure(done.stderr)
    assert f"TensorBoard: the run's scalars live in {live / 'bsp'}" in done.stderr
    exported = tmp_path / "exported"
    report = subprocess.run([sys.executable, "-m", "hpcps", "report", str(out), "--tensorboard", str(exported)],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    for folder in (live / "bsp", exported / "bsp"):
        scalars = _read(folder)
        for rank in (1, 2):  # the two workers: every step's loss and rate, as the run file has them
            assert scalars[f"loss/rank{rank}"] == _rows(out, rank, "loss")
            assert scalars[f"lr/rank{rank}"] == _rows(out, rank, "lr")
            assert len(scalars[f"time/compute_s/rank{rank}"]) == 12
        assert len(scalars["eval/accuracy"]) >= 1
        assert len({v for _, v in scalars["lr/rank1"]}) > 1  # the cosine schedule, step by step


def test_report_needs_somewhere_to_write(tmp_path):
    report = subprocess.run([sys.executable, "-m", "hpcps", "report", str(tmp_path / "x.h5")], capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 2 and "--out DIR" in report.stderr and "--tensorboard DIR" in report.stderr
