#!/usr/bin/env python3
"""Cost per push of each paradigm's server-side policy, from 4 to 4096 workers (no MPI, no model).

The policies are pure objects, so their bookkeeping can be timed alone. Each worker pushes
``--pushes`` gradients; its next push comes a random compute time after its grant (a worker of a
paradigm that does not block goes on at once), with one worker 3x slower, so the bounded paradigms
really hold workers back. Only the time inside ``on_push`` is counted (``time.perf_counter_ns``
around each call). Printed: microseconds per push per N, and per paradigm the ratio of the cost at
the largest N to the cost at the smallest (flat: about 1; logarithmic: a few; linear: hundreds).

    python tools/bench_policies.py
    python tools/bench_policies.py --workers 4 64 1024 --pushes 5
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time

import numpy as np

from hpcps.policies import make_policy, policy_class

PARADIGMS = ("bsp", "ssp", "dssp", "asp", "hsp")


def cost_per_push(paradigm: str, n: int, pushes: int, seed: int = 0) -> float:
    """Mean seconds inside ``on_push`` over ``n * pushes`` pushes of a simulated run."""
    rng = np.random.default_rng(seed)
    policy = make_policy(paradigm, n, staleness=2, staleness_max=6)
    blocks = policy_class(paradigm).worker_blocks
    speed = np.ones(n)
    speed[0] = 3.0
    clocks = [0] * n
    events = [(float(rng.exponential(speed[w])), w) for w in range(n)]  # (time of next push, worker)
    heapq.heapify(events)
    spent, calls = 0, 0
    while events:
        now, w = heapq.heappop(events)
        clocks[w] += 1
        t = time.perf_counter_ns()
        decision = policy.on_push(w, clocks[w], 0, now)
        spent += time.perf_counter_ns() - t
        calls += 1
        granted = decision.grants if blocks else (w,)
        for g in granted:
            if clocks[g] < pushes:
                heapq.heappush(events, (now + float(rng.exponential(speed[g])), g))
            else:
                policy.on_leave(g, now)
    if min(clocks) < pushes:  # a worker never granted again: the policy stalled the run
        raise RuntimeError(f"{paradigm} at N={n}: workers {[w for w in range(n) if clocks[w] < pushes][:8]} "
                           f"stopped short of {pushes} pushes")
    return spent / calls * 1e-9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", nargs="+", type=int, default=[4, 16, 64, 256, 1024, 4096])
    p.add_argument("--pushes", type=int, default=10, help="gradients per worker (default 10)")
    p.add_argument("--paradigms", nargs="+", default=list(PARADIGMS))
    a = p.parse_args()
    print(f"microseconds per push inside the policy ({a.pushes} pushes per worker, one worker 3x slower)\n")
    print("| paradigm | " + " | ".join(f"N={n}" for n in a.workers) + f" | N={a.workers[-1]} / N={a.workers[0]} |")
    print("|---|" + "---|" * (len(a.workers) + 1))
    worst = 0.0
    for paradigm in a.paradigms:
        costs = [cost_per_push(paradigm, n, a.pushes) for n in a.workers]
        ratio = costs[-1] / costs[0]
        worst = max(worst, ratio)
        print(f"| {paradigm} | " + " | ".join(f"{c * 1e6:.2f}" for c in costs) + f" | {ratio:.2f} |", flush=True)
    print(f"\nworst ratio N={a.workers[-1]} / N={a.workers[0]}: {worst:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
