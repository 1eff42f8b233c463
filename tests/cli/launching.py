"""Helpers: launch real MPI jobs from plain pytest, always bounded by a timeout."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from hpcps.cluster.launcher import clean_environ, find_mpiexec, launcher_family, oversubscribing

MPIEXEC = find_mpiexec()
#: whose mpiexec it is (the suite runs under MPICH and Open MPI: .ci/run), and what lets it start 5 ranks on 2 cores
FAMILY = launcher_family(MPIEXEC) if MPIEXEC else None
OVERSUBSCRIBE = oversubscribing(FAMILY) if FAMILY else {}
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install '.[mpich]' or load your MPI)")


def failure(stderr: str) -> str:
    """A failed check's message: a job's stderr from the first rank that failed, and its end. A rank's
    failure can make others fail after it (under run-through, its death; elsewhere, the job's abort): the
    first traceback is the cause, the last is often only a consequence."""
    first = min((i for i in (stderr.find(" failed: "), stderr.find("Traceback")) if i >= 0), default=None)
    if first is None:
        return stderr[-8000:]
    start = stderr.rfind("\n", 0, first) + 1
    return stderr[start:start + 8000] + ("\n[...]\n" + stderr[-2000:] if len(stderr) > start + 8000 else "")


def launch(n: int, *args: str, timeout: float, cwd: str | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n N ARGS`` in a clean environment (plus ``env``); on timeout kill the whole job and fail."""
    environ = clean_environ(PYTHONUNBUFFERED="1", **{**OVERSUBSCRIBE, **(env or {})})
    for attempt in (1, 2):
        proc = subprocess.Popen([MPIEXEC, "-n", str(n), *args], env=environ,
                                cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"mpiexec -n {n} {' '.join(args)} did not finish in {timeout} s (deadlock?)\n"
                        f"{out[-3000:]}\n{err[-3000:]}")
        if attempt == 1 and proc.returncode and any(line in err for line in LAUNCHER_FAILED_TO_START):
            continue  # the launcher could not start the job at all (no rank ran): once more
        break
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


#: what a launcher says when it could not start a job at all, before any rank ran (not hpcps's doing): Open
#: MPI's, seen in CI on a machine whose /tmp held the session directories of many killed jobs
LAUNCHER_FAILED_TO_START = ("The PMIx server's listener thread failed to start",)


def run_bounded(argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
                cwd: str | None = None) -> subprocess.CompletedProcess:
    """``argv`` in a process group of its own and a clean environment (plus ``env``), output captured; on
    timeout kill the whole group and fail."""
    proc = subprocess.Popen(argv, env=clean_environ(PYTHONUNBUFFERED="1", **(env or {})), text=True, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv[:6])} ... did not finish in {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def box_missing() -> str | None:
    """Why no cluster in a box can be built here, or None: build a one-node box and take it down."""
    from hpcps.box import net
    from hpcps.box.spec import make_cluster

    try:
        net.check_host()
        if os.geteuid() != 0:
            return "hpcps emulate needs root (network namespaces, tc)"
        probe = make_cluster(1, ["1gbit"], buffer="64kb", prefix=f"hpcps{os.getpid()}-")
        with net.built(probe):
            pass
    except Exception as exc:  # BoxError says what is missing
        return str(exc)
    return None
