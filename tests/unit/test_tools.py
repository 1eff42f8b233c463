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
