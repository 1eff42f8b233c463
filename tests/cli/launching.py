"""Helpers: launch real MPI jobs from plain pytest, always bounded by a timeout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def find_mpiexec() -> str | None:
    """The mpiexec of this Python environment (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


MPIEXEC = find_mpiexec()
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install '.[mpich]' or load your MPI)")


def launch(n: int, *args: str, timeout: float, cwd: str | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n N ARGS`` in a clean environment; on timeout kill the whole job and fail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_"))}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([MPIEXEC, "-n", str(n), *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec -n {n} {' '.join(args)} did not finish in {timeout} s (deadlock?)\n"
                    f"{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
