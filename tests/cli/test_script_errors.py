"""A script's own error after ``hpcps.init``, outside ``with ps:``, ends the job in seconds (hpcps.runtime.guard).

Before the guard, an exception raised between ``init`` and ``with ps:`` printed its traceback and the job
waited for ever: the servers for the worker's leave, the other workers for its share of the rounds.
"""

from __future__ import annotations

import re
import sys
import textwrap

import h5py
import pytest

from launching import failure, launch, needs_mpiexec

pytestmark = [needs_mpiexec, pytest.mark.slow]

SCRIPT = textwrap.dedent("""
    import sys, torch, hpcps
    how, out = sys.argv[1], sys.argv[2]
    ps = hpcps.init(lambda: torch.nn.Linear(4, 2), optimizer="sgd", lr=0.1, paradigm=sys.argv[3], steps=8,
                    progress=False, out=out)
    if ps.is_worker and ps.worker_index == 1 and how == "raise":
        open("/nonexistent/train.bin")  # the loop's data, before the `with`
    while ps.running:
        if how == "device" and ps.is_worker and ps.worker_index == 1:
            torch.randn(8, 4, device="meta") + torch.randn(8, 4)  # a batch on a device the model is not on
        ps.model(torch.randn(8, 4).to(ps.device)).pow(2).mean().backward()
        ps.step()
        if how == "exit" and ps.is_worker and ps.worker_index == 0 and ps.iteration == 3:
            sys.exit(3)
    if how == "close":
        ps.close()
    sys.stdout.write(f"rank {ps.rank} done\\n"); sys.stdout.flush()  # one write: print() makes two
""")


def _run(tmp_path, how: str, paradigm: str = "bsp"):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{how}.h5"
    # a hang would run into the timeout and fail the test; the job ends in seconds
    return launch(4, sys.executable, str(script), how, str(out), paradigm, timeout=90), out


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hpcps: error:")]


@pytest.mark.parametrize("paradigm", ["bsp", "dssp"])
def test_an_exception_after_init_outside_the_with_block_ends_the_job_naming_the_rank(tmp_path, paradigm):
    proc, _ = _run(tmp_path, "raise", paradigm)
    assert proc.returncode != 0
    errors = _errors(proc.stderr)
    assert len(errors) == 1, failure(proc.stderr)
    assert "rank 2 failed: FileNotFoundError" in errors[0] and "/nonexistent/train.bin" in errors[0]
    assert "done" not in proc.stdout


def test_a_batch_on_another_device_than_the_model_ends_the_job_saying_where_the_model_is(tmp_path):
    """A loop written for the CPU, or for DDP's ``cuda:LOCAL_RANK``, on a model hpcps put on the worker's
    device: torch's error about two devices, and what to do (made here with the meta device, no GPU)."""
    proc, _ = _run(tmp_path, "device")
    assert proc.returncode != 0
    errors = _errors(proc.stderr)
    assert len(errors) == 1, failure(proc.stderr)
    assert "rank 2 failed: RuntimeError: Tensor on device cpu is not on the expected device meta!" in errors[0]
    assert "put each batch there, x.to(ps.device)" in errors[0]


def test_a_worker_that_exits_mid_run_ends_the_job_saying_its_session_was_open(tmp_path):
    proc, _ = _run(tmp_path, "exit")
    assert proc.returncode != 0
    errors = _errors(proc.stderr)
    assert len(errors) == 1, failure(proc.stderr)
    assert "rank 1: the script ended with its hpcps session open (worker 0, step 3)" in errors[0]


def test_a_loop_that_runs_out_without_close_is_closed_at_exit_and_its_run_is_whole(tmp_path):
    proc, out = _run(tmp_path, "noclose")
    assert proc.returncode == 0, failure(proc.stderr)
    assert not _errors(proc.stderr)
    # the workers' tails ran; the server's process ended in init once it had served
    assert sorted(re.findall(r"rank (\d) done", proc.stdout)) == ["1", "2", "3"]
    with h5py.File(out, "r") as f:
        assert f["summary"].attrs["gradients_applied"] == 3 * 8


EARLY = textwrap.dedent("""
    import os, sys, torch, hpcps
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if sys.argv[1] == "after-mpi":
        from mpi4py import MPI
    if rank == 2:
        raise RuntimeError("the data's path is wrong")  # before hpcps.init
    ps = hpcps.init(lambda: torch.nn.Linear(4, 2), optimizer="sgd", lr=0.1, paradigm="bsp", steps=4, progress=False,
                    out=sys.argv[2])
    with ps:
        while ps.running:
            ps.model(torch.randn(8, 4).to(ps.device)).pow(2).mean().backward()
            ps.step()
""")


@pytest.mark.parametrize("when", ["before-mpi", "after-mpi"])
def test_an_exception_before_init_ends_the_job_naming_the_rank(tmp_path, when):
    """Before: a rank that failed before MPI started left the others in MPI_Init for ever (MPICH's launcher does
    not end the job), and one that failed after left them in hpcps.init's first agreement."""
    script = tmp_path / "early.py"
    script.write_text(EARLY)
    proc = launch(3, sys.executable, str(script), when, str(tmp_path / "early.h5"), timeout=90)
    assert proc.returncode != 0
    errors = _errors(proc.stderr)
    assert len(errors) == 1 and "rank 2 failed: RuntimeError: the data's path is wrong" in errors[0], \
        failure(proc.stderr)
