"""hpcps on a real Slurm: render the template, submit it and wait for it, check the run file; a mis-wired srun.

Starts a single-node cluster on this host with tools/slurm_local_cluster.sh
(root, Debian's slurm-wlm and munge; .ci/run installs them). Skips, saying
why, only where Slurm is not installed or cannot run here. The job run into
its time limit (two minutes of Slurm's 30 s signal granularity) is a soak for
CI's time: ``HPCPS_SOAK_SLURM=1 python -m pytest tests/cli/test_slurm.py``
(the template's ``--signal`` line is tested in tests/unit/test_jobs.py, a
stop signal's checkpoint and resume in test_signals.py).
"""

import json
import os
import shutil
import re
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcps.cluster.launcher import clean_environ
from launching import FAMILY

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster():
    if shutil.which("sbatch") is None:
        pytest.skip("Slurm is not installed (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("the test cluster's slurmd and munged need root")
    proc = subprocess.run(["bash", str(ROOT / "tools" / "slurm_local_cluster.sh")], capture_output=True,
                          text=True, timeout=120)
    if proc.returncode == 3:
        pytest.skip(f"Slurm cannot run here: {proc.stderr.strip()}")
    assert proc.returncode == 0 and "ready" in proc.stdout, proc.stderr


def _env():
    """The job must find this Python environment's hpcps and mpiexec (Open MPI's mpirun may bind and map
    more ranks than the test cluster's CPUs: a real allocation has a core per task)."""
    loose = {"PRTE_MCA_hwloc_default_binding_policy": "none",
             "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"} if FAMILY == "openmpi" else {}
    return clean_environ(PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", **loose)


# states a job leaves by itself; any other (COMPLETED, FAILED, TIMEOUT, CANCELLED, NODE_FAIL, ...) is its end
RUNNING = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
           "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED"}


def submit_and_wait(script: str, cwd, timeout: float) -> subprocess.CompletedProcess:
    """``sbatch`` the script and poll its state every 0.5 s until it ends, as ``sbatch --wait`` would, but
    without its backoff (to 32 s between polls, while MinJobAge is Slurm's default 300 s: a 40-step job took
    42 s to be seen ending). Returns sbatch's output and the job's exit status (128 + the
    signal that ended it, if one did); on ``timeout`` the job is cancelled and TimeoutExpired raised."""
    submitted = subprocess.run(["sbatch", "--parsable", script], cwd=cwd, env=_env(), capture_output=True,
                               text=True, timeout=60)
    if submitted.returncode != 0:
        return submitted
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                               timeout=60).stdout
        state = re.search(r"\bJobState=(\S+)", shown)
        if state and state.group(1) not in RUNNING:
            code, signal = map(int, re.search(r"\bExitCode=(\d+):(\d+)", shown).groups())
            return subprocess.CompletedProcess(submitted.args, 128 + signal if signal else code,
                                               f"Submitted batch job {job_id}\n", submitted.stderr + shown)
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=60)
            raise subprocess.TimeoutExpired(submitted.args, timeout)
        time.sleep(0.5)


def test_rendered_slurm_job_runs_and_writes_a_valid_run_file(cluster, tmp_path):
    render = subprocess.run([sys.executable, "-m", "hpcps", "jobs", "render", "slurm", "--nodes", "1",
                             "--ntasks-per-node", "5", "--time", "00:10:00", "--", "--paradigm", "bsp",
                             "--steps", "40", "--out", "X.h5"], capture_output=True, text=True, check=True)
    (tmp_path / "job.sbatch").write_text(render.stdout)
    job = submit_and_wait("job.sbatch", tmp_path, timeout=600)
    logs = "\n".join(p.read_text() for p in tmp_path.glob("hpcps-*.out"))
    assert job.returncode == 0, job.stderr + logs
    with h5py.File(tmp_path / "X.h5") as f:
        s = f["summary"].attrs
        assert f.attrs["world_size"] == 5 and f.attrs["n_workers"] == 4
        assert s["gradients_pushed"] == s["gradients_applied"] == 4 * 40
    job_id = job.stdout.split()[-1]
    assert (tmp_path / "runs" / job_id).is_dir()  # the per-job run directory


def test_miswired_srun_fails_at_once_naming_the_fix(cluster, tmp_path):
    proc = subprocess.run(["srun", "--mpi=none", "-n", "3", sys.executable, "-m", "hpcps", "train", "--steps", "5",
                           "--out", str(tmp_path / "x.h5")], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpcps: error:")]
    assert len(errors) == 1 and "srun started 3 tasks but MPI sees a world of 1" in errors[0]
    assert "--mpi=pmi2" in errors[0]
    assert not (tmp_path / "x.h5").exists()


def _render_and_wait(tmp_path, name: str, options: list[str], train: list[str], timeout: float):
    render = subprocess.run([sys.executable, "-m", "hpcps", "jobs", "render", "slurm", "--nodes", "1",
                             "--ntasks-per-node", "5", "--name", name, *options, "--", *train],
                            capture_output=True, text=True, check=True)
    (tmp_path / f"{name}.sbatch").write_text(render.stdout)
    job = submit_and_wait(f"{name}.sbatch", tmp_path, timeout=timeout)
    logs = "\n".join(p.read_text() for p in tmp_path.glob(f"{name}-*.out"))
    return job, logs


@pytest.mark.skipif(os.environ.get("HPCPS_SOAK_SLURM", "") in ("", "0"), reason="soak only: HPCPS_SOAK_SLURM=1")
def test_a_job_run_into_its_time_limit_checkpoints_on_the_signal_and_a_new_job_resumes_it(cluster, tmp_path):
    """A 2-minute job that would train for hours: Slurm sends SIGUSR1 30 s before the limit (the
    template's --signal), hpcps stops and checkpoints into the job's run directory, the job ends cleanly
    inside its limit; a second job given --resume completes the run.

    Slurm checks warning signals every 30 s and sends one up to 30 s early, once, to the job steps that
    exist then: a margin near the whole time limit can fire before srun has started its tasks, and
    nobody gets it (seen here with 45 s of a 1-minute limit). 30 s of 2 minutes fires after 60-90 s.
    """
    train = ["--paradigm", "dssp", "--compute-time", "0.01"]
    first, logs = _render_and_wait(tmp_path, "first", ["--time", "00:02:00", "--stop-before", "30"],
                                   [*train, "--steps", "100000", "--out", "first.h5"], timeout=300)
    assert first.returncode == 0, first.stderr + logs  # ended by itself, not killed at the limit
    assert "hpcps: SIGUSR1 received" in logs and "Traceback" not in logs, logs[-3000:]
    with h5py.File(tmp_path / "first.h5") as f:
        s = f["summary"].attrs
        assert s["stopped_by"] == "SIGUSR1" and not s["interrupted"]
        assert s["gradients_applied"] + s["gradients_dropped"] == s["gradients_pushed"] < 4 * 100000
        ckpt = s["checkpoint"]
        first_steps = np.bincount(f["workers/iterations"]["rank"], minlength=5)[1:]
    job_id = first.stdout.split()[-1]
    assert Path(ckpt).parent == tmp_path / "runs" / job_id / "checkpoints"  # the job's own directory
    steps = int(first_steps.max()) + 30  # a short second job: every worker has some steps left
    second, logs = _render_and_wait(tmp_path, "second", ["--time", "00:05:00"],
                                    [*train, "--steps", str(steps), "--resume", ckpt, "--out", "second.h5"],
                                    timeout=300)
    assert second.returncode == 0, second.stderr + logs
    with h5py.File(tmp_path / "second.h5") as f:
        s = f["summary"].attrs
        assert s["stopped_by"] == "" and f.attrs["resumed_from"] == ckpt
        assert s["gradients_applied"] + s["gradients_dropped"] == s["gradients_pushed"]
        second_steps = np.bincount(f["workers/iterations"]["rank"], minlength=5)[1:]
    assert (first_steps + second_steps).tolist() == [steps] * 4  # every worker finished, nothing twice


def test_an_open_mpi_job_runs_on_slurm_through_mpirun_inside_the_allocation(cluster, tmp_path):
    """Under Open MPI (.ci/openmpi's environment) the rendered script launches with mpirun, which starts
    the ranks through Slurm; every gradient is applied. This test cluster gives 5 tasks 2 CPUs, which Open
    MPI's mpirun refuses to bind and map unless told (a real allocation has a core per task)."""
    if FAMILY != "openmpi":
        pytest.skip(f"the mpiexec beside this Python is {FAMILY}'s: .ci/openmpi runs this under Open MPI")
    job, logs = _render_and_wait(tmp_path, "ompi", ["--time", "00:10:00"],
                                 ["--paradigm", "bsp", "--steps", "40", "--out", "X.h5"], timeout=600)
    assert job.returncode == 0, job.stderr + logs
    script = (tmp_path / "ompi.sbatch").read_text()
    assert "\nmpirun -n 5 hpcps train --paradigm bsp" in script
    with h5py.File(tmp_path / "X.h5") as f:
        s = f["summary"].attrs
        assert f.attrs["mpi_library"].startswith("Open MPI") and f.attrs["world_size"] == 5
        assert s["gradients_pushed"] == s["gradients_applied"] == 4 * 40


def test_a_job_rendered_with_restarts_finishes_by_itself_after_a_rank_is_killed(cluster, tmp_path):
    """--restarts 1: the job step runs under hpcps supervise with --resume auto and #SBATCH --no-kill. A
    worker SIGKILLed at step 38 fails the step; it runs again on the allocation's nodes that sinfo says are
    alive (this one-node cluster's only node, so the same shape), resumes at step 30 and ends the run: the
    planned 60 steps, the 30 after the checkpoint pushed exactly once more."""
    train = ["--paradigm", "bsp", "--steps", "60", "--compute-time", "0.05", "--checkpoint-every", "10",
             "--fault", "kill@2:38", "--out", "killed.h5"]
    job, logs = _render_and_wait(tmp_path, "restart", ["--time", "00:05:00", "--restarts", "1"], train, timeout=300)
    assert job.returncode == 0, job.stderr + logs
    assert "hpcps supervise: launch 1 ended with" in logs and "launching on the 1 node(s) still alive" in logs, logs
    assert "--resume auto: resuming from" in logs and "step-000030.h5" in logs, logs[-3000:]
    with h5py.File(tmp_path / "killed.h5") as f:
        s = f["summary"].attrs
        assert s["gradients_pushed"] == s["gradients_applied"] == 4 * (60 - 30)
        assert json.loads(f.attrs["restart"])["attempt"] == 2
