"""hpcps on a real Slurm: render the template, sbatch --wait, check the run file; a mis-wired srun.

Starts a single-node cluster on this host with tools/slurm_local_cluster.sh
(root, Debian's slurm-wlm and munge; .ci/run installs them). Skips, saying
why, only where Slurm is not installed or cannot run here.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from hpcps.launcher import clean_environ

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
    """The job must find this Python environment's hpcps and mpiexec."""
    return clean_environ(PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")


def test_rendered_slurm_job_runs_and_writes_a_valid_run_file(cluster, tmp_path):
    render = subprocess.run([sys.executable, "-m", "hpcps", "jobs", "render", "slurm", "--nodes", "1",
                             "--ntasks-per-node", "5", "--time", "00:10:00", "--", "--paradigm", "bsp",
                             "--steps", "40", "--out", "X.h5"], capture_output=True, text=True, check=True)
    (tmp_path / "job.sbatch").write_text(render.stdout)
    job = subprocess.run(["sbatch", "--wait", "job.sbatch"], cwd=tmp_path, env=_env(), capture_output=True,
                         text=True, timeout=600)
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
