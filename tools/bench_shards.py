#!/usr/bin/env python3
"""Iteration throughput against the number of central server shards, for a model big enough
for the server to be the bottleneck (ASP: every gradient is an update the server applies and
publishes). Ratios are against one shard, measured in the same invocation.

    python tools/bench_shards.py --shards 1 2 4 --workers 4 -- --hidden 65536 --steps 40
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from benchlib import fmt, parser, train, train_options


def main() -> None:
    p = parser(__doc__, seeds=[0, 1])
    p.add_argument("--shards", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--paradigm", default="asp")
    a = p.parse_args()
    extra = train_options(a)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in a.shards:
            runs = [train(s + a.workers, Path(tmp) / f"s{s}-{seed}.h5",
                          ["--paradigm", a.paradigm, "--servers", str(s), "--seed", str(seed),
                           "--eval-interval", "1000", *extra]) for seed in a.seeds]
            rows[s] = [{"gps": r["summary"]["gradients_applied"] / r["summary"]["wall_s"],
                        "iter_ms": float(np.median(r["it"]["t_end"] - r["it"]["t_start"]) * 1e3),
                        "pull_ms": float(r["it"]["pull_s"].mean() * 1e3),
                        "push_ms": float(r["it"]["push_s"].mean() * 1e3)} for r in runs]
            print(f"  {s} shard(s): done", file=sys.stderr)
    base = np.mean([m["gps"] for m in rows[a.shards[0]]])
    print(f"{a.paradigm}, {a.workers} workers, seeds {a.seeds}, options: {' '.join(extra)}\n")
    print(f"| shards | ranks | gradients/s | vs {a.shards[0]} shard(s) | median iteration ms | pull ms | push ms |")
    print("|---|---|---|---|---|---|---|")
    for s, ms in rows.items():
        col = {k: [m[k] for m in ms] for k in ms[0]}
        print(f"| {s} | {s + a.workers} | {fmt(col['gps'], 0)} | {np.mean(col['gps']) / base:.2f} | "
              f"{fmt(col['iter_ms'], 1)} | {fmt(col['pull_ms'], 1)} | {fmt(col['push_ms'], 1)} |")


if __name__ == "__main__":
    main()
