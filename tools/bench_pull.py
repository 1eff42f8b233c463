#!/usr/bin/env python3
"""A training run's pulls against raw passive-target ``Get``s of the same bytes over the same links, in one run.

Two jobs on the same ranks (in a cluster in a box with ``--emulate``, or under mpiexec):

* ``hpcps``: ``hpcps train`` with the options after ``--`` (a paradigm whose workers pull while
  others push and the shard steps: asp, eager, ...); the median of its iterations' ``pull_s``;
* ``raw``: rank 0 exposes a plain window of the bytes one such pull moves (the run file's
  ``compress.pull_bytes``) and waits as a shard does, napping between polls; every other rank, as
  often as a worker pulls (``--compute-time`` apart), reads it with ``Lock(SHARED)`` / ``Get`` /
  ``Unlock``, all at once as the workers do; the median of those reads.

The last line is the ratio, hpcps's median pull over the raw ``Get``'s (1.00: as fast as MPI's own
passive-target read of the same bytes):

    python tools/bench_pull.py --emulate "--nodes 5 --link 1gbit --link 0=4gbit" -- \\
        --paradigm asp --hidden 16384 --compute-time 0.05 --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

from benchlib import launch_argv, train


def _inner(nbytes: int, reps: int, pause: float) -> None:
    """Under the launcher: rank 0 serves a window of ``nbytes``; the others Get it ``reps`` times."""
    from mpi4py import MPI

    from hpcps.transport.poll import Backoff, polite_barrier

    comm = MPI.COMM_WORLD
    win = MPI.Win.Allocate(nbytes if comm.rank == 0 else 0, 1, comm=comm)
    out = np.empty(nbytes, np.uint8)
    times = []
    comm.Barrier()
    if comm.rank != 0:
        for rep in range(reps + 1):
            time.sleep(pause)
            t = time.perf_counter()
            win.Lock(0, MPI.LOCK_SHARED)
            win.Get(out, 0)
            win.Unlock(0)
            if rep:  # the first connects
                times.append(time.perf_counter() - t)
    polite_barrier(comm, Backoff())  # rank 0 naps between polls meanwhile, as a shard's loop does
    medians = comm.gather(float(np.median(times)) if times else None, root=0)
    if comm.rank == 0:
        print(f"MEDIAN_GET_S {float(np.median([m for m in medians if m is not None]))}")
    win.Free()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=5, help="ranks: 1 server + NP-1 workers (default 5)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--emulate", metavar="OPTIONS", help="hpcps emulate's options, e.g. '--nodes {np} --link 1gbit'")
    p.add_argument("--inner", nargs=3, type=float, help=argparse.SUPPRESS)
    p.add_argument("options", nargs="*", help="after --: hpcps train options")
    a = p.parse_args()
    if a.inner:
        _inner(int(a.inner[0]), int(a.inner[1]), a.inner[2])
        return
    from hpcps.cluster.launcher import clean_environ

    options = [o for o in a.options if o != "--"]
    pulls, gets, nbytes = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            out = Path(tmp) / f"run{seed}.h5"
            # (pull times, not accuracy: asp at the default rate can trip the divergence stop on this model)
            run = train(a.np, out, ["--divergence", "ignore", *options, "--seed", str(seed)], emulate=a.emulate)
            with h5py.File(out) as f:
                nbytes = int(json.loads(f.attrs["compress"])["pull_bytes"])
                pause = float(json.loads(f.attrs["config"]).get("compute_time") or 0.0)
            pulls.append(float(np.median(run["it"]["pull_s"])))
            reps = int(np.median(np.unique(run["it"]["rank"], return_counts=True)[1]))
            cmd = launch_argv(a.np, [sys.executable, os.path.abspath(__file__), "--inner", str(nbytes),
                                     str(min(reps, 100)), str(pause)], a.emulate)
            proc = subprocess.run(cmd, env=clean_environ(), capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"raw Get job failed:\n{proc.stderr[-2000:]}")
            gets.append(float(next(x.split()[1] for x in proc.stdout.splitlines() if x.startswith("MEDIAN_GET_S"))))
    where = f"in a box ({a.emulate})" if a.emulate else "under mpiexec"
    print(f"{a.np} ranks {where}, {nbytes / 1e6:.2f} MB a pull, options: {' '.join(options)}\n")
    print("| seed | hpcps pull ms | raw Get ms | ratio |")
    print("|---|---|---|---|")
    for seed, pull, get in zip(a.seeds, pulls, gets):
        print(f"| {seed} | {pull * 1e3:.1f} | {get * 1e3:.1f} | {pull / get:.2f} |")
    print(f"\nhpcps pull / raw Get of the same bytes: {np.mean(pulls) / np.mean(gets):.2f}")


if __name__ == "__main__":
    main()
