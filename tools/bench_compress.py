#!/usr/bin/env python3
"""Compression on the wire (``--compress``) against fp32, on the same job and ranks, in one invocation.

For every variant (``none``, ``bf16``, ``fp16``, ``topk:RATIO``) and seed, one ``hpcps train``
run with the options after ``--``; printed per variant over the seeds: the bytes one push and one
pull move (the run file's ``compress``), the median iteration, the time to ``--target`` accuracy
and the final accuracy, with ratios against ``none``. The last line: time to target with the
first compressed variant over fp32's. Meant for a transfer-bound job in a cluster in a box:

    python tools/bench_compress.py --seeds 0 1 2 --target 0.5 --variants none bf16 \\
        --emulate "--nodes 5 --link 1gbit --link 0=4gbit" -- --paradigm bsp --dataset mnist1d \\
        --model mlp --hidden 32768 --optimizer sgd --momentum 0.9 --lr 0.05 --compute-time 0.066 \\
        --steps 150 --eval-interval 0.5
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

from benchlib import fmt, parser, train, train_options
from hpcps.analysis.report import time_to


def main() -> None:
    p = parser(__doc__, seeds=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=["none", "bf16"], metavar="CODEC",
                   help="--compress values to compare; none first (default: none bf16)")
    p.add_argument("--np", type=int, default=5, help="MPI ranks (default 5: 1 server + 4 workers)")
    p.add_argument("--target", type=float, default=0.9)
    a = p.parse_args()
    if a.variants[0] != "none":
        a.variants.insert(0, "none")
    extra = train_options(a)
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.variants:
            results[name] = []
            for s in a.seeds:
                out = Path(tmp) / f"{name.replace(':', '_')}-{s}.h5"
                r = train(a.np, out, ["--compress", name, "--seed", str(s), *extra], emulate=a.emulate)
                with h5py.File(out) as f:
                    wire = json.loads(f.attrs["compress"])
                results[name].append({
                    "push_mb": wire["push_bytes"] / 1e6, "pull_mb": wire["pull_bytes"] / 1e6,
                    "iter_ms": float(np.median(r["it"]["t_end"] - r["it"]["t_start"]) * 1e3),
                    "ttt": time_to(r["ev"], a.target), "acc": float(r["summary"]["final_accuracy"])})
            print(f"  {name}: done", file=sys.stderr)
    base = {k: np.nanmean([m[k] for m in results["none"]]) for k in ("iter_ms", "ttt")}
    print(f"{a.np} ranks, seeds {a.seeds}, options: {' '.join(extra)}"
          + (f", in a box ({a.emulate})" if a.emulate else "") + "\n")
    print(f"| compress | push MB | pull MB | median iteration ms | vs none | time to {a.target:.0%} s | vs none | "
          "final accuracy |")
    print("|---|---|---|---|---|---|---|---|")
    for name, ms in results.items():
        col = {k: [m[k] for m in ms] for k in ms[0]}
        print(f"| {name} | {col['push_mb'][0]:.3f} | {col['pull_mb'][0]:.3f} | {fmt(col['iter_ms'], 1)} | "
              f"{np.nanmean(col['iter_ms']) / base['iter_ms']:.2f} | {fmt(col['ttt'], 2)} | "
              f"{np.nanmean(col['ttt']) / base['ttt']:.2f} | {fmt(col['acc'], 3)} |")
    first = a.variants[1] if len(a.variants) > 1 else "none"
    print(f"\n{first} time to {a.target:.0%} / none: {np.nanmean([m['ttt'] for m in results[first]]) / base['ttt']:.2f}")


if __name__ == "__main__":
    main()
