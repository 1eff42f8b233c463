"""Run the MPI test suite (tests/mpi) under ``mpiexec -n 5`` from plain pytest.

So that one ``python -m pytest`` runs everything. Inside, every test has its
own pytest-timeout (thread method: a stuck rank dumps its stacks and exits,
and mpiexec ends the job); this outer test bounds the whole suite.
"""

import re
import sys
from pathlib import Path

import pytest

from launching import failure, launch, needs_mpiexec

TESTS = Path(__file__).resolve().parents[1]


@needs_mpiexec
@pytest.mark.timeout(900)
def test_mpi_suite_passes_on_five_ranks(capsys):
    # (without the slowest tests' list: five ranks' copies would crowd a failure's output out)
    proc = launch(5, sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                  str(TESTS / "mpi"), timeout=840, cwd=str(TESTS.parent))
    # each rank prints its own closing line; lines of different ranks may interleave
    passed = [int(n) for n in re.findall(r"(\d+) passed", proc.stdout)]
    with capsys.disabled():
        print(f"\n[mpiexec -n 5 pytest --with-mpi tests/mpi] passed per rank: {passed}")
    assert proc.returncode == 0, proc.stdout[-6000:] + failure(proc.stderr)
    assert len(passed) == 5 and len(set(passed)) == 1 and passed[0] > 0, proc.stdout[-3000:]
    assert not re.search(r"\d+ (failed|error)", proc.stdout), proc.stdout[-6000:]
