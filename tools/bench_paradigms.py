#!/usr/bin/env python3
"""Run the same job under several paradigms, scenarios and seeds; print comparison tables.

Each run is a real ``mpiexec -n NP hpcps train`` job; results are read back
from the HDF5 files (h5py only). Scenarios: ``homogeneous`` (as given) and
``heterogeneous`` (the last worker ``--straggler`` times slower). Ratios are
against BSP in the same scenario and invocation, because absolute times on a
shared machine are noise.

    python tools/bench_paradigms.py --paradigms bsp asp ssp dssp --seeds 0 1 2 \
        --scenarios homogeneous heterogeneous -- --compute-time 0.01 --eval-interval 0.05
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from benchlib import fmt, parser, train, train_options
from hpcps.report import time_to, worker_rates


def run(np_: int, paradigm: str, seed: int, out: Path, extra: list[str], target: float) -> dict:
    r = train(np_, out, ["--paradigm", paradigm, "--seed", str(seed), *extra])
    it, s = r["it"], r["summary"]
    per_worker = list(worker_rates(it).values())
    return {"acc": float(s["final_accuracy"]), "wall": float(s["wall_s"]), "ttt": time_to(r["ev"], target),
            "its": float(np.mean(per_worker)), "wait": float(it["wait_s"].mean() * 1e3),
            "stale": float(it["staleness"].mean())}


def main() -> None:
    p = parser(__doc__, seeds=[0, 1, 2])
    p.add_argument("--paradigms", nargs="+", default=["bsp", "asp", "ssp"])
    p.add_argument("--np", type=int, default=5, help="MPI ranks (default 5: 1 server + 4 workers)")
    p.add_argument("--scenarios", nargs="+", default=["heterogeneous"], choices=["homogeneous", "heterogeneous"])
    p.add_argument("--straggler", type=float, default=3.0, help="slowdown of the last worker when heterogeneous")
    p.add_argument("--target", type=float, default=0.9,
                   help="accuracy whose first evaluation counts as time-to-target (runs are not stopped there)")
    a = p.parse_args()
    extra = train_options(a)
    for scenario in a.scenarios:
        options = extra + (["--slowdown", f"{a.np - 1}={a.straggler:g}"] if scenario == "heterogeneous" else [])
        rows = {}
        with tempfile.TemporaryDirectory() as tmp:
            for paradigm in a.paradigms:
                rows[paradigm] = [run(a.np, paradigm, s, Path(tmp) / f"{paradigm}-{s}.h5", options, a.target)
                                  for s in a.seeds]
                print(f"  {scenario} {paradigm}: done", file=sys.stderr)
        table(scenario, rows, a, options)


def table(scenario: str, rows: dict, a, options: list[str]) -> None:
    base = np.nanmean([r["ttt"] for r in rows["bsp"]]) if "bsp" in rows else float("nan")
    print(f"\n{scenario}: {a.np} ranks, seeds {a.seeds}, options: {' '.join(options)}\n")
    print("| paradigm | final accuracy | wall s | time to {:.0%} s | vs BSP | iterations/s per worker | "
          "mean wait ms | mean staleness |".format(a.target))
    print("|---|---|---|---|---|---|---|---|")
    for paradigm, rs in rows.items():
        ttt = np.nanmean([r["ttt"] for r in rs])
        print(f"| {paradigm} | {fmt([r['acc'] for r in rs], 3)} | {fmt([r['wall'] for r in rs], 2)} | "
              f"{fmt([r['ttt'] for r in rs], 2)} | {ttt / base:.2f} | {fmt([r['its'] for r in rs], 0)} | "
              f"{fmt([r['wait'] for r in rs], 2)} | {fmt([r['stale'] for r in rs], 2)} |", flush=True)


if __name__ == "__main__":
    main()
