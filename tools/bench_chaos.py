#!/usr/bin/env python3
"""Chaos in the box: the same run with and without a dead node, under each paradigm, side by side.

Per paradigm, one invocation runs ``hpcps supervise -- hpcps emulate --nodes N ... -- hpcps train
--resume auto`` twice on the same box: once clean, once with a worker's node killed (every process of it
SIGKILLed: ``--chaos kill:NODE@SECONDS``) ``--kill-at`` seconds after the launch. The supervisor launches
the job again and it resumes from its newest periodic checkpoint (``--checkpoint-interval``, or bsp's
``--checkpoint-every``). It prints, per paradigm, both wall times (the supervisor's, launches and start-ups
included), the time the kill cost, what the resumed run file's ``restart`` record says (the gradients
shard 0 had received past the checkpoint, the seconds between the checkpoint and its last note, the
seconds from that note to the resumed run's start, every rank set up), the seconds from that start until
every worker's first step is done (connections, first pulls: the rest of the restart), the launches, and both
final accuracies. Last, the bound on the time lost: one checkpoint interval (the median spacing of the clean
run's checkpoints, in seconds) plus the measured restart (relaunch and first step), against the cost. A kill
before the first checkpoint was complete starts afresh ("fresh": no record).

    python tools/bench_chaos.py --paradigms bsp asp ssp dssp eager hsp --kill-at 16

Needs root (the box). Run it on an idle machine: the wall times are what it measures.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np


def run(args, paradigm: str, out: str, kill: bool) -> dict:
    train = ["--paradigm", paradigm, "--steps", str(args.steps), "--compute-time", str(args.compute_time),
             "--hidden", str(args.hidden), "--progress-every", "600", "--out", out, "--resume", "auto",
             "--seed", str(args.seed)]
    train += ["--checkpoint-every", str(args.checkpoint_every)] if paradigm in ("bsp", "hsp") else \
        ["--checkpoint-interval", str(args.checkpoint_interval)]
    if paradigm in ("ssp", "dssp", "eager"):
        train += ["--staleness", "2"]
    box = ["--nodes", str(args.nodes), "--link", args.link]
    if kill:
        box += ["--chaos", f"kill:{args.node}@{args.kill_at:g}"]
    command = [sys.executable, "-m", "hpcps", "supervise", "--delay", "0", "--restarts", "2", "--",
               sys.executable, "-m", "hpcps", "emulate", *box, "--", sys.executable, "-m", "hpcps", "train", *train]
    began = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"{paradigm} ({'kill' if kill else 'clean'}) failed:\n{proc.stderr[-3000:]}")
    with h5py.File(out) as f:
        s = f["summary"].attrs
        restart = json.loads(f.attrs["restart"]) if "restart" in f.attrs else {}
        it = f["workers/iterations"][()]
        first_step = max(float(it["t_end"][it["rank"] == r].min()) for r in set(it["rank"].tolist()))
        result = {"wall": wall, "accuracy": float(s["final_accuracy"]), "restart": restart,
                  "launches": 1 + proc.stderr.count("hpcps supervise: launch "),
                  "resumed": bool(f.attrs["resumed_from"]), "first_step": first_step}
    written = sorted(os.path.getmtime(p) for p in glob.glob(os.path.splitext(out)[0] + "-checkpoints/step-*.h5"))
    result["interval"] = float(np.median(np.diff(written))) if len(written) > 1 else float("nan")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paradigms", nargs="+", default=["bsp", "asp", "ssp", "dssp", "eager", "hsp"])
    p.add_argument("--nodes", type=int, default=5, help="nodes, one rank each: a shard on node 0 (default 5)")
    p.add_argument("--link", default="1gbit")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--compute-time", type=float, default=0.05, dest="compute_time")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--checkpoint-interval", type=float, default=2.0, dest="checkpoint_interval",
                   help="seconds between the asynchronous paradigms' checkpoints (default 2)")
    p.add_argument("--checkpoint-every", type=int, default=40, dest="checkpoint_every",
                   help="versions between bsp's and hsp's checkpoints (default 40)")
    p.add_argument("--kill-at", type=float, default=16.0, dest="kill_at",
                   help="seconds after the first launch (start-up included) at which the node dies (default 16)")
    p.add_argument("--node", type=int, default=3, help="the node that dies (default 3, a worker's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpcps-chaos-") as tmp:
        for paradigm in args.paradigms:
            clean = run(args, paradigm, os.path.join(tmp, f"{paradigm}-clean.h5"), kill=False)
            hit = run(args, paradigm, os.path.join(tmp, f"{paradigm}-kill.h5"), kill=True)
            rows.append((paradigm, clean, hit))
            print(f"{paradigm}: clean {clean['wall']:.1f} s, killed {hit['wall']:.1f} s", file=sys.stderr, flush=True)
    print(f"\n{args.nodes} nodes at {args.link}, {args.steps} steps per worker, {args.compute_time * 1e3:g} ms compute, "
          f"node {args.node} killed at {args.kill_at:g} s; checkpoints every {args.checkpoint_interval:g} s "
          f"(bsp, hsp: every {args.checkpoint_every} versions)\n")
    print("| paradigm | clean s | node killed s | cost s | launches | gradients repeated | s after the checkpoint "
          "| relaunch s | first step s | interval s | interval + restart s | accuracy clean | accuracy killed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for paradigm, clean, hit in rows:
        r = hit["restart"]
        if r:
            restart = [r["gradients_repeated"], r["training_lost_s"], r["restart_s"], f"{hit['first_step']:.2f}",
                       f"{clean['interval']:.2f}", f"{clean['interval'] + r['restart_s'] + hit['first_step']:.1f}"]
        else:  # no record: a fresh start (the kill came before a checkpoint was complete), or no note
            restart = ["fresh" if not hit["resumed"] else "?"] * 3 + [f"{hit['first_step']:.2f}",
                                                                      f"{clean['interval']:.2f}", "-"]
        print(f"| {paradigm} | {clean['wall']:.1f} | {hit['wall']:.1f} | {hit['wall'] - clean['wall']:.1f} | "
              f"{hit['launches']} | {' | '.join(map(str, restart))} | {clean['accuracy']:.4f} | "
              f"{hit['accuracy']:.4f} |")

if __name__ == "__main__":
    main()
