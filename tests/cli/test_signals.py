"""Ctrl-C under mpiexec: one line, no traceback, the run's metrics and a checkpoint written (bounded by timeouts)."""

import os
import signal
import subprocess
import sys
import time

import h5py

from hpcps.cluster.launcher import clean_environ
from launching import MPIEXEC, needs_mpiexec

pytestmark = needs_mpiexec


def test_ctrl_c_under_mpiexec_ends_every_rank_cleanly_with_summary_and_checkpoint(tmp_path):
    out = tmp_path / "dssp.h5"
    proc = subprocess.Popen([MPIEXEC, "-n", "5", sys.executable, "-m", "hpcps", "train", "--paradigm", "dssp",
                             "--steps", "100000", "--compute-time", "0.005", "--out", str(out)],
                            env=clean_environ(PYTHONUNBUFFERED="1"), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(2.0)  # training is under way
        proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends mpiexec
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the job did not end after Ctrl-C\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "Error" not in stderr, stderr[-3000:]
    assert stderr.count("hpcps: SIGINT received: stopping after the current step") == 1  # one line, rank 0's
    with h5py.File(out) as f:
        s = f["summary"].attrs
        assert s["interrupted"] and s["stopped_by"] == "SIGINT"
        assert 0 < s["gradients_pushed"] < 4 * 100000
        assert s["gradients_applied"] + s["gradients_dropped"] == s["gradients_pushed"] == len(f["workers/iterations"])
        assert len(f["eval"]) > 0
        checkpoint = s["checkpoint"]
    assert checkpoint.startswith(str(tmp_path / "dssp-checkpoints")) and os.path.exists(checkpoint)
    assert f"--resume {checkpoint}" in stderr
