"""``hpcps supervise`` around a real job: a worker SIGKILLed mid-run, the job launched again by itself,
resuming with ``--resume auto`` from its newest complete checkpoint (subprocess, bounded by a timeout).

Each supervised job starts twice (30-45 s here), so CI runs bsp (a round's checkpoint) and a soak the
other paradigms (the consistent cuts of asp, ssp, dssp, eager; hsp; grouped): ``HPCPS_SOAK_SUPERVISE=1
python -m pytest tests/cli/test_supervise.py``. (Under Open MPI's ULFM, test_runthrough.py supervises hsp.)
"""

import json
import os
import subprocess
import sys

import h5py
import pytest
import torch

from launching import MPIEXEC, OVERSUBSCRIBE, failure, launch, needs_mpiexec, run_bounded

pytestmark = needs_mpiexec


def supervise(*train: str, restarts: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """``hpcps supervise -- mpiexec -n 5 hpcps train TRAIN``."""
    return run_bounded([sys.executable, "-m", "hpcps", "supervise", "--delay", "0", "--restarts", str(restarts),
                        "--", MPIEXEC, "-n", "5", sys.executable, "-m", "hpcps", "train", *train],
                       timeout=timeout, env=OVERSUBSCRIBE)


def test_a_bsp_job_whose_worker_is_killed_finishes_by_itself_as_the_job_nobody_killed(tmp_path):
    """SIGKILL at step 38, checkpoints every 10 steps: the job is launched again, resumes at step 30, pushes
    exactly the 30 steps the checkpoint lacks, and saves the very model of the uninterrupted job. The run file
    says what the restart cost: the gradients pushed past the checkpoint (at most steps 30 to 38 of each of the 4
    workers: the killed one's last was computed, never pushed) and the seconds, the training lost under one
    checkpoint interval."""
    common = ["--paradigm", "bsp", "--steps", "60", "--compute-time", "0.05", "--checkpoint-every", "10",
              "--seed", "3", "--no-progress"]
    full = launch(5, sys.executable, "-m", "hpcps", "train", *common, "--out", str(tmp_path / "full.h5"),
                  timeout=180)
    assert full.returncode == 0, failure(full.stderr)
    out = tmp_path / "sup.h5"
    proc = supervise(*common, "--out", str(out), "--resume", "auto", "--fault", "kill@2:38")
    assert proc.returncode == 0, failure(proc.stderr)
    assert "--resume auto: no complete checkpoint" in proc.stderr  # the first launch started afresh
    assert "hpcps supervise: launch 1 ended with" in proc.stderr
    assert f"--resume auto: resuming from {tmp_path / 'sup-checkpoints' / 'step-000030.h5'}" in proc.stderr
    assert "finished after 2 launch(es)" in proc.stderr
    with h5py.File(out) as f:
        pushed, applied = f["summary"].attrs["gradients_pushed"], f["summary"].attrs["gradients_applied"]
        restart = json.loads(f.attrs["restart"])
    assert pushed == applied == 4 * (60 - 30)
    assert 0 <= restart["gradients_repeated"] <= 4 * 9 and restart["attempt"] == 2, restart
    assert restart["restart_s"] > 0, restart
    # the time lost is under one checkpoint interval plus the restart: from the checkpoint to the last note
    # (the training past it, the launcher's ending of the job) at most the spacing of the checkpoints before
    # (10 steps; the kill came 8 steps after the last), with one note period (0.25 s) for the steps' jitter
    ck = tmp_path / "sup-checkpoints"
    interval = os.path.getmtime(ck / "step-000030.h5") - os.path.getmtime(ck / "step-000020.h5")
    assert 0 <= restart["training_lost_s"] <= interval + 0.25, (restart, interval)
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "sup.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_input_is_not_launched_again(tmp_path):
    proc = supervise("--paradigm", "nope", "--out", str(tmp_path / "x.h5"), "--resume", "auto", timeout=120)
    assert proc.returncode == 2
    assert "launch 1 ended" not in proc.stderr and "bad input" in proc.stderr


SOAK = os.environ.get("HPCPS_SOAK_SUPERVISE", "") not in ("", "0")


@pytest.mark.parametrize("paradigm", [pytest.param(p, marks=pytest.mark.skipif(
    not SOAK, reason="soak only: HPCPS_SOAK_SUPERVISE=1")) for p in ("asp", "ssp", "dssp", "eager", "hsp", "grouped")])
def test_every_paradigm_finishes_by_itself_with_the_accounting_exact_from_the_checkpoint(tmp_path, paradigm):
    """A worker SIGKILLed at step 45 of 60, checkpoints every 0.2 s (hsp: every 40 versions): the second launch
    resumes from the newest complete one, loses nothing and pushes exactly what it lacks of every worker's 60
    (asp's, ssp's, dssp's and eager's a consistent cut, each worker at its own clock)."""
    out = tmp_path / f"{paradigm}.h5"
    extra = ["--groups", "2"] if paradigm == "grouped" else ["--staleness", "2"] if paradigm != "hsp" else []
    proc = supervise("--paradigm", paradigm, *extra, "--steps", "60", "--compute-time", "0.02",
                     "--checkpoint-interval", "0.2", "--checkpoint-every", "40", "--seed", "1", "--no-progress",
                     "--out", str(out), "--resume", "auto", "--fault", "kill@4:45")
    assert proc.returncode == 0, failure(proc.stderr)
    assert "finished after 2 launch(es)" in proc.stderr
    with h5py.File(out) as f:
        resumed, workers = f.attrs["resumed_from"], int(f.attrs["n_workers"])
        s = f["summary"].attrs
        pushed, handled = int(s["gradients_pushed"]), int(s["gradients_applied"] + s["gradients_dropped"])
    with h5py.File(resumed) as f:
        cut = int(f.attrs["worker_clocks"].sum())
    assert 0 < cut < workers * 60
    assert pushed == handled and pushed + cut == workers * 60, (pushed, cut)
