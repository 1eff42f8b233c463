"""Every benchmark in tools/ starts and explains itself (``--help``), so a broken import shows in CI."""

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.parametrize("script", sorted(p.name for p in TOOLS.glob("bench_*.py")))
def test_benchmark_help(script):
    proc = subprocess.run([sys.executable, str(TOOLS / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=TOOLS)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_the_policy_benchmark_runs_every_paradigm_to_the_end():
    """Small sizes: every simulated worker pushes all its gradients (a policy that never granted would
    leave the loop with events missing and the push count short), and the table has every row."""
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_policies
    finally:
        sys.path.remove(str(TOOLS))
    for paradigm in bench_policies.PARADIGMS:
        assert bench_policies.cost_per_push(paradigm, 8, 3) > 0
    proc = subprocess.run([sys.executable, str(TOOLS / "bench_policies.py"), "--workers", "4", "16", "--pushes", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ")][1:] == \
        list(bench_policies.PARADIGMS)


def test_the_bound_of_a_step_is_compute_plus_what_cannot_overlap_it():
    """bench_allreduce's bounds, closed form: 4 nodes at 1 Gbit/s, a 4 MB model: each phase carries 3/4 of it,
    24 ms at the line rate; 60 ms of compute, 20 in the forward pass and 30 in backward, 10 before them."""
    sys.path.insert(0, str(TOOLS))
    try:
        from bench_allreduce import step_bounds
    finally:
        sys.path.remove(str(TOOLS))
    b = step_bounds(0.060, 1 / 3, 0.5, 4_000_000, 4, 1e9)
    assert b["bsp"] == pytest.approx(0.010 + 0.030 + 0.024)  # the push hides in backward; the pull 20 of 24 ms
    assert b["allreduce"] == pytest.approx(0.030 + 0.048)  # 48 ms of reduction after backward began
    # compute-bound: nothing left to overlap
    assert step_bounds(1.0, 0.3, 0.6, 4_000_000, 4, 1e9)["bsp"] == pytest.approx(1.0)
