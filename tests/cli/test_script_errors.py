"""A script's own error after ``hpcps.init``, outside ``with ps:``, ends the job in seconds (hpcps.runtime.guard).

Before the guard, an exception raised between ``init`` and ``with ps:`` printed its traceback and the job
waited for ever: the servers for the worker's leave, the other workers for its share of the rounds.
"""

from __future__ import annotations

import sys
import textwrap

import h5py
import pytest

from launching import launch, needs_mpiexec

pytestmark = [needs_mpiexec, pytest.mark.slow]

SCRIPT = textwrap.dedent("""
    import sys, torch, hpcps
    how, out = sys.argv[1], sys.argv[2]
    ps = hpcps.init(lambda: torch.nn.Linear(4, 2), optimizer="sgd", lr=0.1, paradigm=sys.argv[3], steps=8,
                    progress=False, out=out)
    if ps.is_worker and ps.worker_index == 1 and how == "raise":
        open("/nonexistent/train.bin")  # the loop's data, before the `with`
    while ps.running:
        ps.model(torch.randn(8, 4)).pow(2).mean().backward()
        ps.step()
        if how == "exit" and ps.is_worker and ps.worker_index == 0 and ps.iteration == 3:
            sys.exit(3)
    if how == "close":
        ps.close()
    print("rank", ps.rank, "done", flush=True)
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
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "rank 2 failed: FileNotFoundError" in errors[0] and "/nonexistent/train.bin" in errors[0]
    assert "done" not in proc.stdout


def test_a_worker_that_exits_mid_run_ends_the_job_saying_its_session_was_open(tmp_path):
    proc, _ = _run(tmp_path, "exit")
    assert proc.returncode != 0
    errors = _errors(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "rank 1: the script ended with its hpcps session open (worker 0, step 3)" in errors[0]


def test_a_loop_that_runs_out_without_close_is_closed_at_exit_and_its_run_is_whole(tmp_path):
    proc, out = _run(tmp_path, "noclose")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not _errors(proc.stderr)
    assert sorted(line.split()[1] for line in proc.stdout.splitlines() if line.endswith("done")) == ["0", "1", "2", "3"]
    with h5py.File(out, "r") as f:
        assert f["summary"].attrs["gradients_applied"] == 3 * 8
