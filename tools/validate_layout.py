#!/usr/bin/env python3
"""Check the model of a shard on every node (:mod:`hpcps.analysis.simulate_shards`) against the job with no
layout flags in a cluster in a box.

One run of ``hpcps train --paradigm P`` with no layout, pull or partition flag on ``--nodes`` nodes of two
ranks (what ``auto`` chooses: a shard beside a worker on each node, :mod:`hpcps.options.defaults`), then the
model of the same job: the layout, the pull and the partitions the run file says it chose, the model's bytes
(its ``compress`` record), the box's link rate, ``--compute-forward`` and ``--compute-backward``, and each
worker's compute as the run measured it (the mean of ``compute_s`` after the warm-up: the emulated time and
what the passes overshoot; the slowest over the fastest as its slowdown). The model has no other input from
the run: its latency and the shards' costs are :class:`hpcps.analysis.simulate.Machine`'s defaults unless
given. Printed: the measured mean step (the slowest worker's wall time over its steps after the warm-up),
the predicted one, the error, the prediction with no overlap (the push after backward, the pull whole before
the forward pass: the model's other end), the bound of a step at the line rate (``tools/bench_allreduce.py``),
and the measured parts of a step (means of compute, push, wait, pull) beside the predicted wait.

    python tools/validate_layout.py --nodes 4 --link 1gbit --steps 60 -- \\
        --model tools/bench_partitions.py:deep_mlp --hidden 410 --dataset mnist1d --compute-time 0.05 \\
        --compute-forward 0.33 --compute-backward 0.67
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import h5py
import numpy as np

from bench_allreduce import step_bounds
from benchlib import train
from hpcps.analysis.report import compute_means, mean_step, timed_rows
from hpcps.analysis.simulate import Machine
from hpcps.analysis.simulate_shards import node_rates, simulate_shards

#: steps left out of the measured means at each worker's start (start-up, torch's first passes), at most a
#: quarter of them: the cut of :func:`hpcps.analysis.report.timed_rows`, the same for the step, the compute and
#: the phases
WARMUP = 5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4, help="nodes of two ranks, a shard and a worker (default 4)")
    p.add_argument("--link", default="1gbit", help="the box's link rate, every node (default 1gbit)")
    p.add_argument("--steps", type=int, default=60, help="steps per worker (default 60)")
    p.add_argument("--paradigm", default="bsp", help="a paradigm whose workers wait for their grant (default bsp)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency", type=float, default=Machine.latency, help="the model's seconds per transfer")
    p.add_argument("options", nargs="*", help="after --: hpcps train options (model, data, emulated compute)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.h5"
        run = train(2 * a.nodes, out, ["--paradigm", a.paradigm, "--steps", str(a.steps), "--eval-interval", "1e9",
                                       "--seed", str(a.seed), *a.options],
                    emulate=f"--nodes {a.nodes} --ranks-per-node 2 --link {a.link}")
        with h5py.File(out) as f:
            config, shards, pull = json.loads(f.attrs["config"]), int(f.attrs["n_servers"]), str(f.attrs["pull"])
            nbytes = int(json.loads(f.attrs["compress"])["fp32_bytes"])
    if shards != a.nodes:
        raise SystemExit(f"the run placed {shards} shards on {a.nodes} nodes: the model has one on each node")
    it = run["it"]
    compute = compute_means(it, WARMUP)
    fastest = min(compute.values())
    workers = sorted(compute)  # the workers' ranks, in node order (a shard and a worker per node)
    forward, backward = config.get("compute_forward") or 0.0, config.get("compute_backward") or 0.0
    partition = config.get("partition_mb") or 0.0
    measured = mean_step(it, WARMUP)
    timed = dict(timed_rows(it, WARMUP))  # each worker's rows that the means above time
    rows = np.concatenate(list(timed.values()))
    phases = " / ".join(f"{np.mean(rows[k]) * 1e3:.1f}" for k in ("compute_s", "push_s", "wait_s", "pull_s"))
    steps = min(len(mine) for mine in timed.values())  # the steps the model runs: those timed
    job = dict(steps=steps, nbytes=nbytes, compute_time=fastest, pull=pull, rates=node_rates([a.link], a.nodes),
               machine=Machine(latency=a.latency), slowdown={k: compute[r] / fastest for k, r in enumerate(workers)},
               seed=a.seed)
    model = simulate_shards(a.paradigm, a.nodes, forward=forward, backward=backward, partitioned=partition > 0, **job)
    predicted = model.wall_s / steps
    serial = simulate_shards(a.paradigm, a.nodes, **job).wall_s / steps  # no share of the compute in the passes
    bound = step_bounds(max(compute.values()), forward, backward, nbytes, a.nodes, job["rates"][0] * 8)
    print(f"{a.paradigm}, {a.nodes} nodes at {a.link}, {a.steps} steps (the first {a.steps - steps} left out), "
          f"options: {' '.join(a.options) or '(defaults)'}")
    print(f"chosen: {shards} shards, pull {pull}, " + (f"partitions of {partition:g} MB" if partition else "whole")
          + f"; the model {nbytes / 1e6:.2f} MB; compute measured {fastest * 1e3:.1f}-"
            f"{max(compute.values()) * 1e3:.1f} ms\n")
    print("| measured mean step ms | predicted ms | error | predicted with no overlap ms | its error | bound ms | "
          "measured / bound | measured compute / push / wait / pull ms (means) | predicted wait ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {measured * 1e3:.1f} | {predicted * 1e3:.1f} | {(predicted / measured - 1) * 100:+.1f}% | "
          f"{serial * 1e3:.1f} | {(serial / measured - 1) * 100:+.1f}% | {bound['bsp'] * 1e3:.1f} | "
          f"{measured / bound['bsp']:.2f} | {phases} | {model.mean_wait_s * 1e3:.1f} |")


if __name__ == "__main__":
    main()
