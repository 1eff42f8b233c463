#!/usr/bin/env python3
"""Push latency to shard 0 while rank 0 evaluates a ResNet-18, against the same run without evaluation.

Three runs of the same ASP job, in one invocation:

* ``none``: evaluation only at the end (``--eval-interval 1e9``);
* ``background``: evaluation back to back (``--eval-interval 0.01``), in rank 0's helper thread
  (the default where the window protocol is pinned and MPI gives THREAD_MULTIPLE);
* ``in-loop``: the same, but inside shard 0's loop (``HPCPS_EVAL_BACKGROUND=0``), as before.

A gradient's push latency is the time from the end of its computation (its push starts then) to its
application on shard 0, both on rank 0's clock. With back-to-back evaluation nearly every push
meets an evaluation in progress. The workers' emulated compute time (``--compute-time``) leaves the
cores to the servers, as on a machine with a core per rank. Printed: median and 90th percentile
latency per variant, evaluations done, and ``ratio background/none: X.XX`` (target: 1.2 or less).

    python tools/bench_eval_latency.py
    python tools/bench_eval_latency.py --steps 30 -- --batch-size 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import train  # noqa: E402

VARIANTS = {"none": (["--eval-interval", "1e9"], {}),
            "background": (["--eval-interval", "0.01"], {}),
            "in-loop": (["--eval-interval", "0.01"], {"HPCPS_EVAL_BACKGROUND": "0"})}


def push_latencies(run: dict) -> np.ndarray:
    """Seconds from each gradient's push start (compute end) to its application on shard 0."""
    it, up = run["it"], run["up"]
    pushed = {(int(r["rank"]), int(r["step"]) + 1): float(r["t_start"] + r["compute_s"]) for r in it}
    first = up[up["shard"] == 0]
    return np.array([float(u["t"]) - pushed[(int(u["worker"]), int(u["worker_clock"]))] for u in first
                     if (int(u["worker"]), int(u["worker_clock"])) in pushed])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="iterations per worker (default 20)")
    p.add_argument("--samples", type=int, default=2500,
                   help="synthetic CIFAR-shaped samples; 20%% are held out and evaluated (default 2500)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: more hpcps train options")
    a = p.parse_args()
    common = ["--paradigm", "asp", "--model", "resnet18", "--dataset", f"synthetic:3x32x32:10:{a.samples}",
              "--steps", str(a.steps), "--batch-size", "4", "--compute-time", "0.4", "--lr", "0.01",
              *[x for x in a.train_args if x != "--"]]
    medians = {}
    print(f"ASP, ResNet-18 (synthetic 3x32x32, {a.samples // 5} held out), 4 workers, {a.steps} steps each\n")
    print("| evaluation | pushes | median push latency ms | p90 ms | evaluations |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (options, env) in VARIANTS.items():
            run = train(5, Path(tmp) / f"{name}.h5", common + options, env=env)
            lat = push_latencies(run)
            medians[name] = float(np.median(lat))
            print(f"| {name} | {len(lat)} | {medians[name] * 1e3:.1f} | {np.percentile(lat, 90) * 1e3:.1f} | "
                  f"{len(run['ev'])} |", flush=True)
    print(f"\nratio background/none: {medians['background'] / medians['none']:.2f}")
    print(f"ratio in-loop/none: {medians['in-loop'] / medians['none']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
