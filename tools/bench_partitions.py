#!/usr/bin/env python3
"""Partitioned, prioritised pulls against whole pulls, on the same workload and ranks, in one invocation.

Two variants per seed: ``whole`` (``--partition-mb 0``) and ``partitioned`` (``--partition-mb MB``). The
iteration time is each worker's time from its first step's start to its last step's end over its steps
(the median worker), so the waits inside the pass count, wherever they fall. The ratio partitioned /
whole is printed last, seed by seed.

The workload should give the pull something to overlap: a model of several layers of like size
(``--model tools/bench_partitions.py:deep_mlp``, below) and part of the emulated compute time in the
forward pass (``--compute-forward``), over links slow enough that the pull takes as long as the pass
(and, for the pushes during backward that partitions bring to bsp and the other paradigms that wait for
their grant, the rest in the backward pass: ``--compute-backward``):

    python tools/bench_partitions.py --seeds 0 1 2 --emulate "--nodes {np} --link 1gbit" -- \\
        --paradigm asp --model tools/bench_partitions.py:deep_mlp --hidden 512 --dataset mnist1d \\
        --compute-time 0.1 --compute-forward 0.33 --steps 40
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch


def deep_mlp(in_shape: tuple[int, ...], n_classes: int, hidden: int = 512, depth: int = 8) -> torch.nn.Module:
    """``depth`` hidden layers of ``hidden`` units each (``depth x hidden^2`` parameters, spread evenly), so
    that each layer's parameters and its share of the compute come in like sizes."""
    n_in = int(np.prod(in_shape))
    layers: list[torch.nn.Module] = [torch.nn.Flatten(), torch.nn.Linear(n_in, hidden), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, n_classes))


def iteration_ms(it: np.ndarray) -> float:
    """The median worker's run time over its steps (ms per step)."""
    per_worker = [(it["t_end"][it["rank"] == r].max() - it["t_start"][it["rank"] == r].min()) / (it["rank"] == r).sum()
                  for r in np.unique(it["rank"])]
    return float(np.median(per_worker) * 1e3)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchlib import fmt, parser, train, train_options

    p = parser(__doc__, seeds=[0, 1, 2])
    p.add_argument("--np", type=int, default=5, help="MPI ranks (default 5: 1 server + 4 workers)")
    p.add_argument("--partition-mb", type=float, default=0.5, help="the partitioned variant's size (default 0.5)")
    a = p.parse_args()
    extra = train_options(a)
    variants = {"whole": ["--partition-mb", "0"], "partitioned": ["--partition-mb", str(a.partition_mb)]}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for s in a.seeds:  # the variants alternate, so a drift of the machine hits both alike
            for name, options in variants.items():
                r = train(a.np, Path(tmp) / f"{name}-{s}.h5", [*options, "--seed", str(s), *extra], emulate=a.emulate)
                it = r["it"]
                results[name].append({"iter_ms": iteration_ms(it), "pull_wait_ms": float(it["pull_wait_s"].mean() * 1e3),
                                      "compute_ms": float(it["compute_s"].mean() * 1e3),
                                      "acc": float(r["summary"]["final_accuracy"])})
                print(f"  seed {s} {name}: {results[name][-1]['iter_ms']:.1f} ms", file=sys.stderr)
    print(f"{a.np} ranks, seeds {a.seeds}, partitions of {a.partition_mb} MB, options: {' '.join(extra)}"
          f"{', box: ' + a.emulate if a.emulate else ''}\n")
    print("| variant | iteration ms | pull wait ms | compute ms | final accuracy |")
    print("|---|---|---|---|---|")
    for name, ms in results.items():
        col = {k: [m[k] for m in ms] for k in ms[0]}
        print(f"| {name} | {fmt(col['iter_ms'], 1)} | {fmt(col['pull_wait_ms'], 1)} | {fmt(col['compute_ms'], 1)} | "
              f"{fmt(col['acc'], 3)} |")
    ratios = [q["iter_ms"] / w["iter_ms"] for q, w in zip(results["partitioned"], results["whole"])]
    print(f"\npartitioned / whole iteration time: {np.mean(ratios):.3f} "
          f"(seed by seed: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
