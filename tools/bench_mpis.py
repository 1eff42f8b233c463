#!/usr/bin/env python3
"""The cluster in a box's figures under each MPI, side by side, from one invocation.

Each ``--python NAME=PYTHON`` is a Python whose mpi4py uses one MPI (a virtual environment per MPI, each
with hpcps installed or on its path); ``hpcps emulate`` then launches with the ``mpiexec`` beside it, so
the same benchmarks run, one MPI after the other, in the same boxes:

* ``bench_pull.py``: ASP on 5 nodes (the server's at 4 Gbit/s, the workers' at 1 Gbit/s, a 4.9 MB
  model, 50 ms of compute): the run's median pull against raw ``Get``s of the same bytes;
* ``bench_allreduce.py --placements colocated``: BSP with a shard beside each of 4 workers, on 4 nodes
  at 1 Gbit/s, against mpi4py's ``Allreduce`` of the same gradients;
* ``bench_transport.py`` on 2 nodes at 1 Gbit/s: push and pull against raw ``Send`` and ``Get``.

Each benchmark's own table is printed as it comes, then one table with a column per MPI.

    python tools/bench_mpis.py --python mpich=python openmpi=/path/to/openmpi-venv/bin/python
    python tools/bench_mpis.py --python mpich=python openmpi=... --seeds 0 1 2 --steps 60

As root, Open MPI's launcher needs ``OMPI_ALLOW_RUN_AS_ROOT``: set here when run as root.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from benchlib import openmpi_env

TOOLS = Path(__file__).resolve().parent
#: the 4.9 MB model and 50 ms of compute of results.md's box figures; these runs measure time, not accuracy
#: (asp at the default rate on this model can trip the divergence stop before its 60 steps)
MODEL = ["--hidden", "16384", "--compute-time", "0.05", "--divergence", "ignore"]


def _benchmarks(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(name, arguments after the Python) of each benchmark."""
    seeds = [str(s) for s in a.seeds]
    return [
        ("pull", [str(TOOLS / "bench_pull.py"), "--seeds", *seeds, "--emulate", "--nodes 5 --link 1gbit --link 0=4gbit",
                  "--", "--paradigm", "asp", *MODEL, "--steps", str(a.steps)]),
        ("allreduce", [str(TOOLS / "bench_allreduce.py"), "--workers", "4", "--steps", str(a.steps), "--seeds", *seeds,
                       "--link", "1gbit", "--placements", "colocated", "--", *MODEL]),
        ("transport", ["-m", "hpcps", "emulate", "--nodes", "2", "--link", "1gbit", "--", "{python}",
                       str(TOOLS / "bench_transport.py"), "--sizes", "1", "16", "64", "--reps", str(a.reps)]),
    ]


def _first_float(cell: str) -> float:
    return float(re.match(r"\s*([0-9.]+)", cell).group(1))


def _rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row in ``text`` but headers and rules."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells and not cells[0] in ("seed", "method", "MiB"):
                rows.append(cells)
    return rows


def figures(name: str, text: str) -> dict[str, float]:
    """The figures of one benchmark's output, by label (what the side-by-side table shows)."""
    rows = _rows(text)
    if name == "pull":
        pulls, gets = [_first_float(r[1]) for r in rows], [_first_float(r[2]) for r in rows]
        return {"pull: hpcps pull ms (mean over seeds)": sum(pulls) / len(pulls),
                "pull: raw Get ms": sum(gets) / len(gets),
                "pull: hpcps / raw Get": sum(pulls) / sum(gets)}
    if name == "allreduce":
        by = {r[0]: r for r in rows}
        ar = by["allreduce (mpi4py)"]
        bsp = next(r for k, r in by.items() if k.startswith("hpcps bsp colocated"))
        return {"allreduce: mpi4py Allreduce step ms": _first_float(ar[2]),
                "allreduce: bsp colocated step ms": _first_float(bsp[2]),
                "allreduce: bsp colocated / Allreduce": _first_float(bsp[3])}
    out = {}
    for r in rows:  # | MiB | push hpcps | push raw | push ratio | pull hpcps | pull raw | pull ratio | both |
        mib = r[0]
        out[f"transport {mib} MiB: push GB/s (raw)"] = f"{r[1]} ({r[2]})"
        out[f"transport {mib} MiB: pull GB/s (raw)"] = f"{r[4]} ({r[5]})"
    return out


def _library(python: str, env: dict[str, str]) -> str:
    code = ("from mpi4py import MPI; from hpcps.cluster.launcher import library_name; "
            "print(library_name(MPI.Get_library_version()))")
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", nargs="+", required=True, metavar="NAME=PYTHON",
                   help="a Python per MPI, e.g. mpich=python openmpi=venv/bin/python")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of the pull and allreduce runs")
    p.add_argument("--steps", type=int, default=60, help="steps of each training run (default 60)")
    p.add_argument("--reps", type=int, default=20, help="bench_transport's repetitions (default 20)")
    p.add_argument("--only", nargs="+", choices=["pull", "allreduce", "transport"], help="these benchmarks only")
    a = p.parse_args()
    env = openmpi_env(oversubscribe=False)
    pythons = dict(item.split("=", 1) for item in a.python)
    columns: dict[str, dict[str, object]] = {}
    for label, python in pythons.items():
        library = _library(python, env)
        columns[library] = {}
        for name, args in _benchmarks(a):
            if a.only and name not in a.only:
                continue
            argv = [python, *[python if x == "{python}" else x for x in args]]
            print(f"== {label} ({library}): {name}\n$ {' '.join(argv)}", flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
            print(proc.stdout.rstrip(), f"\n({time.perf_counter() - t0:.0f} s)\n", flush=True)
            if proc.returncode != 0:
                print(f"failed (exit {proc.returncode}): {proc.stderr[-1500:]}", flush=True)
                continue
            columns[library].update(figures(name, proc.stdout))
    labels = list(dict.fromkeys(k for c in columns.values() for k in c))
    print("| figure | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for key in labels:
        cells = [columns[lib].get(key, "") for lib in columns]
        print(f"| {key} | " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
