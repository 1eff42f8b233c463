"""A DDP user's habit: a script of hpcps.init started by torchrun says, once, which command to use instead."""

from __future__ import annotations

import shutil

import pytest

from launching import failure, run_bounded

SCRIPT = "import torch, hpcps\nps = hpcps.init(lambda: torch.nn.Linear(4, 2), steps=4, lr=0.1)\n"


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torch's torchrun is not on PATH")
def test_a_script_started_by_torchrun_ends_with_one_line_naming_mpiexec(tmp_path):
    script = tmp_path / "ddp_habit.py"
    script.write_text(SCRIPT)
    proc = run_bounded([shutil.which("torchrun"), "--standalone", "--nproc-per-node", "2", str(script)], timeout=120,
                       cwd=str(tmp_path))
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("hpcps: error:")]
    assert errors == ["hpcps: error: torchrun started 2 processes, each an MPI world of 1: hpcps runs over MPI, not "
                      "torch's launcher. Launch the same script with mpiexec -n 3 python ddp_habit.py (or srun -n 3 "
                      "python ddp_habit.py): 2 workers and a server shard (hpcps.init needs no init_process_group)"], \
        failure(proc.stderr)
