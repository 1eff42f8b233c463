#!/usr/bin/env python3
"""Eager pull against blocking push-then-pull ASP and against BSP, on the same workload and ranks.

Variants: ``eager`` (learning rate lr/(1+staleness)), ``eager-const`` (eager
without learning-rate modulation), ``asp`` (push, its update, then a blocking pull) and
``bsp``. Printed per variant over the seeds: median iteration time, gradients
applied until the target accuracy was first seen, time to target, final
accuracy, and ratios against blocking ASP measured in the same invocation.

    python tools/bench_eager.py --seeds 0 1 2 -- --compute-time 0.01 --eval-interval 0.05
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from benchlib import fmt, parser, train, train_options
from hpcps.analysis.report import time_to

VARIANTS = {
    "eager": ["--paradigm", "eager", "--lr-staleness", "inverse"],
    "eager-const": ["--paradigm", "eager", "--lr-staleness", "none"],
    "asp": ["--paradigm", "asp"],
    "bsp": ["--paradigm", "bsp"],
}


def measure(r: dict, target: float) -> dict:
    it, ev = r["it"], r["ev"]
    hit = ev[ev["accuracy"] >= target]
    # a BSP version averages N gradients: N the run's workers (the layout's, not --np - 1: in a box
    # --servers auto puts a shard on every node)
    per_version = len(np.unique(it["rank"])) if r["paradigm"] == "bsp" else 1
    return {"iter_ms": float(np.median(it["t_end"] - it["t_start"]) * 1e3),
            "grads": float(hit["version"][0] * per_version) if len(hit) else float("nan"),
            "ttt": time_to(ev, target), "acc": float(r["summary"]["final_accuracy"]),
            "pull_wait_ms": float(it["pull_wait_s"].mean() * 1e3), "stale": float(it["staleness"].mean())}


def main() -> None:
    p = parser(__doc__, seeds=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--np", type=int, default=5, help="MPI ranks (default 5: 1 server + 4 workers)")
    p.add_argument("--target", type=float, default=0.9)
    a = p.parse_args()
    extra = train_options(a)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.variants:
            results[name] = [measure(train(a.np, Path(tmp) / f"{name}-{s}.h5",
                                           [*VARIANTS[name], "--seed", str(s), *extra], emulate=a.emulate),
                                     a.target)
                             for s in a.seeds]
            print(f"  {name}: done", file=sys.stderr)
    base = {k: np.nanmean([m[k] for m in results["asp"]]) for k in ("iter_ms", "ttt")} if "asp" in results else {}
    print(f"{a.np} ranks, seeds {a.seeds}, options: {' '.join(extra)}\n")
    print(f"| variant | median iteration ms | vs asp | pull wait ms | gradients to {a.target:.0%} | "
          f"time to {a.target:.0%} s | vs asp | final accuracy | mean staleness |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, ms in results.items():
        col = {k: [m[k] for m in ms] for k in ms[0]}
        ratio = {k: np.nanmean(col[k]) / base[k] if base else float("nan") for k in ("iter_ms", "ttt")}
        print(f"| {name} | {fmt(col['iter_ms'], 2)} | {ratio['iter_ms']:.2f} | {fmt(col['pull_wait_ms'], 2)} | "
              f"{fmt(col['grads'], 0)} | {fmt(col['ttt'], 2)} | {ratio['ttt']:.2f} | {fmt(col['acc'], 3)} | "
              f"{fmt(col['stale'], 2)} |")
    if "eager" in results and base:
        eager = np.nanmean([m["iter_ms"] for m in results["eager"]])
        seeds = ", ".join(f"{e['iter_ms'] / b['iter_ms']:.2f}" for e, b in zip(results["eager"], results["asp"]))
        print(f"\neager median iteration / blocking asp: {eager / base['iter_ms']:.2f} (seed by seed: {seeds})")


if __name__ == "__main__":
    main()
