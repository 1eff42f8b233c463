"""``hpcps simulate``: a discrete-event model of a parameter-server job, driving the real policy objects.

No MPI, no torch: the same :class:`hpcps.policies.Policy` a shard server
consults decides here which gradients are applied and which workers are
released, so a paradigm's waiting and staleness come from its actual rule.
What is modelled (every time in seconds):

* a worker's **compute** per iteration: ``compute_time`` times its slowdown,
  varied by the jitter distribution exactly as :class:`hpcps.emulation.ComputeTime`
  draws it;
* a **transfer** of ``nbytes`` (a push, or a pull): ``latency + nbytes / bandwidth``;
* the **server**: one queue, served in arrival order; handling a push costs
  ``server_s`` (header, bookkeeping) and applying an update ``nbytes /
  apply_rate`` per gradient in it.

One iteration of worker w: pull (transfer), compute, push (transfer); the
push joins the server's queue when it has arrived. A worker of a blocking
paradigm then waits for its grant; otherwise it pulls as soon as its push
has started (the two overlap), and eager's pull costs nothing (it hides
behind the computation). Versions,
staleness and waits are counted as the runtime records them. It does not
model contention for cores or the network: workers are independent
machines and the server one core, as on a real cluster.
"""

from __future__ import annotations

import heapq
import math
import sys
from dataclasses import dataclass, field

import numpy as np

from hpcps.emulation import ComputeTime
from hpcps.policies import make_policy


@dataclass(frozen=True)
class Machine:
    """The cost model (see the module docstring)."""

    latency: float = 50e-6
    bandwidth: float = 10e9
    server_s: float = 20e-6
    apply_rate: float = 5e9

    def transfer(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass
class Prediction:
    paradigm: str
    workers: int
    gradients: int
    wall_s: float
    mean_wait_s: float
    mean_staleness: float
    per_worker_rate: dict[int, float] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Iterations per second, summed over workers, each over its own active time (as the report counts)."""
        return float(sum(self.per_worker_rate.values())) if self.per_worker_rate else math.nan


def simulate(paradigm: str, n_workers: int, *, steps: int, nbytes: int, compute_time: float,
             slowdown: dict[int, float] | None = None, jitter: str = "none", jitter_cv: float = 0.1,
             machine: Machine = Machine(), staleness: int = 2, staleness_max: int | None = None,
             seed: int = 0) -> Prediction:
    """Run ``steps`` iterations of ``n_workers`` workers (indices 0..N-1) under ``paradigm``."""
    policy = make_policy(paradigm, n_workers, staleness=staleness, staleness_max=staleness_max)
    if policy.uses_groups or policy.extra_gradients:
        raise ValueError(f"simulate: paradigm {paradigm!r} is not modelled (group servers, extra gradients)")
    slowdown = slowdown or {}
    clocks = [ComputeTime(compute_time, slowdown.get(w, 1.0), jitter, jitter_cv) for w in range(n_workers)]
    rngs = [np.random.default_rng([seed, w, 7]) for w in range(n_workers)]
    transfer = machine.transfer(nbytes)
    pull = 0.0 if policy.eager_pull else transfer  # eager's pull hides behind the computation
    apply_s = nbytes / machine.apply_rate

    events: list[tuple[float, int, str, int]] = []  # (time, tie-break, kind, worker)
    counter = 0

    def at(t: float, kind: str, w: int) -> None:
        nonlocal counter
        heapq.heappush(events, (t, counter, kind, w))
        counter += 1

    version = 0
    computed_on = [0] * n_workers  # version each worker's current gradient is computed on
    pending: dict[int, int] = {}  # worker -> version its pending gradient was computed on
    clock = [0] * n_workers
    blocked_since: dict[int, float] = {}
    waits, stale, finished = [], [], [0.0] * n_workers
    server_free = 0.0
    gone: set[int] = set()

    def start_iteration(w: int, t: float) -> None:
        if clock[w] >= steps:
            finished[w] = t
            gone.add(w)
            at(t, "leave", w)
            return
        computed_on[w] = version  # the pull reads the version published when it starts
        busy = clocks[w].sleep_after(0.0, rngs[w])
        at(t + pull + busy + transfer, "arrive", w)

    for w in range(n_workers):
        start_iteration(w, 0.0)

    while events:
        t, _, kind, w = heapq.heappop(events)
        begin = max(t, server_free)
        if kind == "leave":
            decision = policy.on_leave(w, begin)
            cost = machine.server_s
        else:
            clock[w] += 1
            pending[w] = computed_on[w]
            if policy.worker_blocks:
                blocked_since[w] = t
            else:
                start_iteration(w, t - transfer)  # it pulled as soon as the push had started
            decision = policy.on_push(w, clock[w], computed_on[w], begin)
            cost = machine.server_s
        for group in decision.updates:
            cost += apply_s * len(group)
            for g in group:
                stale.append(version - pending.pop(g))
            version += 1
        server_free = begin + cost
        for g in decision.grants:
            if g in blocked_since and g not in gone:
                waits.append(server_free - blocked_since.pop(g))
                start_iteration(g, server_free)
    wall = max(finished)
    rates = {w: steps / finished[w] for w in range(n_workers) if finished[w] > 0}
    return Prediction(paradigm, n_workers, n_workers * steps, wall,
                      float(np.mean(waits)) if waits else 0.0, float(np.mean(stale)) if stale else 0.0, rates)


def sweep(paradigms: list[str], workers: list[int], *, straggler: float = 1.0, progress: bool = False,
          **options) -> list[Prediction]:
    """Every paradigm at every worker count; with ``straggler`` > 1 the last worker is that much slower."""
    from tqdm import tqdm

    cases = [(p, n) for p in paradigms for n in workers]
    return [simulate(p, n, slowdown={n - 1: straggler} if straggler > 1 else None, **options)
            for p, n in tqdm(cases, desc="simulate", unit="case", disable=not progress, file=sys.stderr)]


def write_outputs(predictions: list[Prediction], out) -> list:
    """``simulate.csv`` and ``simulated_throughput.png`` (iterations/s against workers, per paradigm)."""
    import csv
    from pathlib import Path

    from hpcps.report import _figure, _save

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "simulate.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["paradigm", "workers", "iterations_per_s", "mean_wait_ms", "mean_staleness"])
        for r in predictions:
            w.writerow([r.paradigm, r.workers, f"{r.throughput:.4g}", f"{r.mean_wait_s * 1e3:.4g}",
                        f"{r.mean_staleness:.4g}"])
    plt, fig, ax = _figure(figsize=(7, 4.5))
    for name in dict.fromkeys(r.paradigm for r in predictions):
        mine = [r for r in predictions if r.paradigm == name]
        ax.plot([r.workers for r in mine], [r.throughput for r in mine], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="workers", ylabel="iterations/s (all workers)",
           title="predicted throughput (hpcps simulate)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return [out / "simulate.csv", _save(plt, fig, out / "simulated_throughput.png")]

