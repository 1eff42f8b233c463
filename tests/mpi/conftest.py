"""Hooks and fixtures of the MPI tests (run: mpiexec -n 5 python -m pytest --with-mpi tests/mpi).

Every test is collective. Facts are computed on rank 0 from the run's HDF5
file and broadcast (helpers in ``mpitest.py``), so every rank asserts the
same thing and a failure cannot leave some ranks waiting in a collective.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from mpi4py import MPI


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Give every rank its own pytest basetemp.

    Otherwise the ranks share one and prune each other's old directories
    (a race that fails at random); files the ranks share live under rank 0's
    ``tmp_path``, which pytest-mpi's ``mpi_tmp_path`` broadcasts.
    """
    if config.option.basetemp is None:
        base = os.path.join(tempfile.gettempdir(), f"hpcps-mpi-tests-{os.getuid()}")
        os.makedirs(base, exist_ok=True)
        config.option.basetemp = os.path.join(base, f"rank{MPI.COMM_WORLD.rank}")


@pytest.fixture
def world():
    comm = MPI.COMM_WORLD
    if comm.size < 5:
        pytest.skip("needs mpiexec -n 5")
    return comm
