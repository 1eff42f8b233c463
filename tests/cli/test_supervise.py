"""``hpcps supervise`` around a real job: a worker SIGKILLed mid-run, the job launched again by itself,
resuming with ``--resume auto`` from its newest complete checkpoint (subprocess, bounded by a timeout)."""

import json
import os
import signal
import subprocess
import sys

import h5py
import pytest
import torch

from hpcps.cluster.launcher import clean_environ
from launching import MPIEXEC, OVERSUBSCRIBE, launch, needs_mpiexec

pytestmark = needs_mpiexec


def supervise(*train: str, restarts: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """``hpcps supervise -- mpiexec -n 5 hpcps train TRAIN``."""
    command = [sys.executable, "-m", "hpcps", "supervise", "--delay", "0", "--restarts", str(restarts), "--",
               MPIEXEC, "-n", "5", sys.executable, "-m", "hpcps", "train", *train]
    proc = subprocess.Popen(command, env=clean_environ(PYTHONUNBUFFERED="1", **OVERSUBSCRIBE), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hpcps supervise did not finish in {timeout} s\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_a_bsp_job_whose_worker_is_killed_finishes_by_itself_as_the_job_nobody_killed(tmp_path):
    """SIGKILL at step 38, checkpoints every 10 steps: the job is launched again, resumes at step 30, pushes
    exactly the 30 steps the checkpoint lacks, and saves the very model of the uninterrupted job. The run file
    says what the restart cost: the gradients pushed past the checkpoint (at most steps 30 to 38 of each of the 4
    workers: the killed one's last was computed, never pushed) and the seconds."""
    common = ["--paradigm", "bsp", "--steps", "60", "--compute-time", "0.05", "--checkpoint-every", "10",
              "--seed", "3", "--no-progress"]
    full = launch(5, sys.executable, "-m", "hpcps", "train", *common, "--out", str(tmp_path / "full.h5"),
                  timeout=180)
    assert full.returncode == 0, full.stderr[-3000:]
    out = tmp_path / "sup.h5"
    proc = supervise(*common, "--out", str(out), "--resume", "auto", "--fault", "kill@2:38")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--resume auto: no complete checkpoint" in proc.stderr  # the first launch started afresh
    assert "hpcps supervise: launch 1 ended with" in proc.stderr
    assert f"--resume auto: resuming from {tmp_path / 'sup-checkpoints' / 'step-000030.h5'}" in proc.stderr
    assert "finished after 2 launch(es)" in proc.stderr
    with h5py.File(out) as f:
        pushed, applied = f["summary"].attrs["gradients_pushed"], f["summary"].attrs["gradients_applied"]
        restart = json.loads(f.attrs["restart"])
    assert pushed == applied == 4 * (60 - 30)
    assert 0 <= restart["gradients_repeated"] <= 4 * 9 and restart["attempt"] == 2, restart
    assert restart["training_lost_s"] >= 0 and restart["restart_s"] > 0, restart
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "sup.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_asp_job_whose_worker_is_killed_finishes_its_planned_gradients_from_the_cut(tmp_path):
    """asp's periodic checkpoint is a consistent cut: each worker resumes at its own clock there, and the
    resumed launch pushes exactly what the cut lacks of the planned 4 x 80."""
    out = tmp_path / "asp.h5"
    proc = supervise("--paradigm", "asp", "--steps", "80", "--compute-time", "0.03", "--checkpoint-every", "60",
                     "--seed", "1", "--no-progress", "--out", str(out), "--resume", "auto", "--fault", "kill@3:55")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished after 2 launch(es)" in proc.stderr
    with h5py.File(out) as f:
        resumed = f.attrs["resumed_from"]
        pushed, applied = f["summary"].attrs["gradients_pushed"], f["summary"].attrs["gradients_applied"]
    with h5py.File(resumed) as f:
        cut = int(f.attrs["worker_clocks"].sum())
    assert 0 < cut < 4 * 80
    assert pushed == applied == 4 * 80 - cut


def test_bad_input_is_not_launched_again(tmp_path):
    proc = supervise("--paradigm", "nope", "--out", str(tmp_path / "x.h5"), "--resume", "auto", timeout=120)
    assert proc.returncode == 2
    assert "launch 1 ended" not in proc.stderr and "bad input" in proc.stderr


@pytest.mark.parametrize("paradigm", ["ssp", "dssp", "eager", "hsp", "grouped"])
def test_every_paradigm_finishes_by_itself_with_the_accounting_exact_from_the_checkpoint(tmp_path, paradigm):
    """A worker SIGKILLed at step 55 of 80, checkpoints every 0.4 s: the second launch resumes from the newest
    complete one, loses nothing and pushes exactly what it lacks of every worker's 80."""
    out = tmp_path / f"{paradigm}.h5"
    extra = ["--groups", "2"] if paradigm == "grouped" else ["--staleness", "2"] if paradigm != "hsp" else []
    proc = supervise("--paradigm", paradigm, *extra, "--steps", "80", "--compute-time", "0.03",
                     "--checkpoint-interval", "0.4", "--checkpoint-every", "40", "--seed", "1", "--no-progress",
                     "--out", str(out), "--resume", "auto", "--fault", "kill@4:55")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished after 2 launch(es)" in proc.stderr
    with h5py.File(out) as f:
        resumed, workers = f.attrs["resumed_from"], int(f.attrs["n_workers"])
        s = f["summary"].attrs
        pushed, handled = int(s["gradients_pushed"]), int(s["gradients_applied"] + s["gradients_dropped"])
    with h5py.File(resumed) as f:
        cut = int(f.attrs["worker_clocks"].sum())
    assert 0 < cut < workers * 80
    assert pushed == handled and pushed + cut == workers * 80, (pushed, cut)
