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
