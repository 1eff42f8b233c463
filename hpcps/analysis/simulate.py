"""``hpcps simulate``: a discrete-event model of a parameter-server job, driving the real policy objects.

No MPI, no torch: the same :class:`hpcps.policies.Policy` a shard server
consults decides here which gradients are applied and which workers are
released, so a paradigm's waiting and staleness come from its actual rule.
What is modelled (every time in seconds):

* a worker's **compute** per iteration: ``compute_time`` times its slowdown,
  varied by the jitter distribution exactly as :class:`hpcps.cluster.emulation.ComputeTime`
  draws it;
* a **transfer** of ``nbytes`` (a push, or a pull): ``latency + nbytes / bandwidth``; or, with
  per-node :class:`Links` (the cluster ``hpcps emulate`` builds, or yours), a flow on the
  server's link in its direction, shared max-min fairly with the transfers in flight there and
  capped by the worker's own link, then ``latency``;
* the **server**: one queue, served in arrival order; handling a push costs
  ``server_s`` (header, bookkeeping) and applying an update ``update_s +
  nbytes / apply_rate`` per gradient in it (``update_s``: what the server
  does per gradient when an update closes: its row, its receipt, its grant).

One iteration of worker w: pull (transfer), compute, push (transfer); the
push joins the server's queue when it has arrived. A worker of a blocking
paradigm then waits for its grant; otherwise it begins its next pull as it
begins its push (the two go opposite ways), and eager's pull costs nothing
(it hides behind the computation); such a worker pushes once the server has
handled its gradient of two pushes ago (:data:`~hpcps.policies.base.UNAPPLIED_AT_MOST`),
as the runtime's does. Versions,
staleness and waits are counted as the runtime records them.

Local steps (``local_steps`` H, the local-SGD family): a worker's
iteration is a round of H computations (each drawn as above; the last round
shorter where H does not divide ``steps``) between its pull and its push, so
the links carry one push and one pull per H batches; ``steps`` still counts
batches, and the throughput is batches per second. The paradigm's rule runs
over the rounds, as the runtime's does. With ``overlap_steps`` T a worker
computes its next round's first T batches as soon as it has pushed, while
its pull goes as before (with the push, or at its grant), and the rest of
the round once both are done, as the runtime's ``--overlap-steps`` does.

Grouped (``groups`` G): each group server runs BSP over its block of
workers (contiguous, as ``--group-by rank``) as the server above does;
when a round closes, its update travels to the central server (a
transfer), which handles it in arrival order among the groups (the grouped
policy: asynchronous over them); the receipt (``latency``) and the pull of
the fresh central parameters (a transfer) come back before the group's
workers are granted, and the group server handles nothing meanwhile, as
:class:`hpcps.runtime.groupserver.GroupServer` waits. hsp is not modelled.

It does not
model contention for cores or the network: workers are independent
machines and the server one core, as on a real cluster. A shard on every
node beside its workers (``hpcps simulate --nodes``, the layout the defaults
pick across nodes) is :mod:`hpcps.analysis.simulate_shards`'s.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hpcps.cluster.emulation import ComputeTime
from hpcps.analysis.events import Events
from hpcps.analysis.fairshare import FairNetwork
from hpcps.cluster.layout import shard_bounds
from hpcps.policies import make_policy
from hpcps.policies.base import UNAPPLIED_AT_MOST


@dataclass(frozen=True)
class Machine:
    """The cost model (see the module docstring)."""

    latency: float = 50e-6
    bandwidth: float = 10e9
    server_s: float = 20e-6
    apply_rate: float = 5e9
    update_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("bandwidth", "apply_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"simulate: --{name.replace('_', '-')} must be above 0 (bytes/s); "
                                 f"got {getattr(self, name):g}")
        for name in ("latency", "server_s", "update_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"simulate: --{name.replace('_', '-')} must be 0 or more (seconds); "
                                 f"got {getattr(self, name):g}")

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


@dataclass(frozen=True)
class Links:
    """Per-node link rates in bytes/s, each direction: the server's, and each worker's (index 0..N-1).

    Built from the words ``hpcps emulate`` takes (:meth:`from_words`): node 0 is the server, node
    k the worker of index k-1, one rank per node.
    """

    server: float
    workers: tuple[float, ...]

    @classmethod
    def from_words(cls, words: list[str], n_workers: int) -> "Links":
        """``["1gbit", "0=4gbit", "4=250mbit"]`` for a job of ``n_workers`` workers (raises ValueError)."""
        from hpcps.box.spec import make_cluster

        cluster = make_cluster(n_workers + 1, list(words), buffer="1mb")
        rates = [node.rate_bps / 8 for node in cluster.nodes]
        return cls(rates[0], tuple(rates[1:]))


def check_job(steps: int, compute_time: float, nbytes: int, slowdown: dict[int, float] | None) -> None:
    """ValueError, naming the option, where these settings cannot describe a job (every model's checks)."""
    if steps < 1:
        raise ValueError(f"simulate: --steps must be 1 or more; got {steps}")
    if not compute_time > 0:
        raise ValueError(f"simulate: --compute-time must be above 0 seconds; got {compute_time:g}")
    if nbytes < 0:
        raise ValueError(f"simulate: --params must be 0 or more; got {nbytes // 4}")
    if any(not f >= 1 for f in (slowdown or {}).values()):
        raise ValueError(f"simulate: --straggler must be 1 or more (times slower); got {max((slowdown or {}).values())}")


def simulate(paradigm: str, n_workers: int, *, steps: int, nbytes: int, compute_time: float,
             slowdown: dict[int, float] | None = None, jitter: str = "none", jitter_cv: float = 0.1,
             machine: Machine = Machine(), staleness: int = 2, staleness_max: int | None = None,
             seed: int = 0, groups: int = 2, links: Links | None = None,
             options: dict | None = None, local_steps: int | None = None, overlap_steps: int = 0) -> Prediction:
    """Run ``steps`` iterations of ``n_workers`` workers (indices 0..N-1) under ``paradigm``.

    ``paradigm``: a built-in name or your own (``file.py:Class``, ``pkg.mod:Class``), whose
    ``options`` are ``--paradigm-option``'s; one with extra gradients or serial transfers
    (hsp's mechanisms) is refused, as the model has neither.
    ``groups``: group servers, for the paradigms that have them (ignored by the others).
    ``links``: per-node link rates (a cluster in a box, or a real one); every transfer is then a flow
    on the server's link, shared max-min fairly with the others in its direction
    (:class:`hpcps.analysis.fairshare.FairNetwork`, one link) and capped by its worker's link; without, a transfer takes
    ``machine.transfer(nbytes)`` whatever else moves.
    ``local_steps``: H computations per push (None: 1; 8 under localsgd and diloco, as ``hpcps train``);
    ``overlap_steps``: of them, those a round computes before its pull (``--overlap-steps``; less than H).
    """
    if n_workers < 1:
        raise ValueError(f"simulate: --workers must be 1 or more; got {n_workers}")
    check_job(steps, compute_time, nbytes, slowdown)
    from hpcps.options.config import local_steps_of, outer_rounds

    every = local_steps_of(paradigm, local_steps)
    every = 1 if every is None else every
    if every < 1:
        raise ValueError(f"simulate: --local-steps must be 1 or more; got {every}")
    if overlap_steps and not 0 <= overlap_steps < every:
        raise ValueError(f"simulate: --overlap-steps must be less than --local-steps ({every}); got {overlap_steps}")
    policy = make_policy(paradigm, n_workers, options, staleness=staleness, staleness_max=staleness_max)
    if every > 1 and (policy.uses_groups or policy.eager_pull):
        raise ValueError(f"simulate: paradigm {paradigm!r} takes no local steps (as hpcps train refuses them)")
    unmodelled = [what for what, has in (("extra gradients", policy.extra_gradients),
                                         ("serial transfers", policy.serial_transfers)) if has]
    if unmodelled:
        raise ValueError(f"simulate: paradigm {paradigm!r} is not modelled: the simulator has no "
                         f"{' and no '.join(unmodelled)}")
    slowdown = slowdown or {}
    clocks = [ComputeTime(compute_time, slowdown.get(w, 1.0), jitter, jitter_cv) for w in range(n_workers)]
    rngs = [np.random.default_rng([seed, w, 7]) for w in range(n_workers)]
    if policy.uses_groups:
        if links is not None:
            raise ValueError("simulate: grouped is not modelled with per-node links (its group servers' "
                             "links are not described); leave --link out")
        return _simulate_grouped(paradigm, n_workers, groups, steps=steps, nbytes=nbytes, clocks=clocks, rngs=rngs,
                                 machine=machine)
    if links is not None and len(links.workers) != n_workers:
        raise ValueError(f"simulate: links for {len(links.workers)} workers, not {n_workers}")
    # one link per direction of the server's: pulls go up, pushes come down (each a network of its own: a
    # transfer on one never changes the other's rates)
    up, down = (FairNetwork({"link": links.server if links else math.inf}) for _ in range(2))
    cap = list(links.workers) if links else [machine.bandwidth] * n_workers
    apply_s = machine.update_s + nbytes / machine.apply_rate
    batches, steps = steps, outer_rounds(steps, every)  # a worker's pushes: one per round of ``every`` batches

    def draw(w: int, n: int) -> float:
        """``n`` computations of worker ``w``: a draw per batch."""
        return sum(clocks[w].sleep_after(0.0, rngs[w]) for _ in range(n))

    def compute(w: int) -> float:
        """The computation of worker ``w``'s next round after its pull: a draw per batch in it (under
        overlap, those the round did not compute before the pull)."""
        if w in rest:
            return draw(w, rest.pop(w))
        return draw(w, min(every, batches - every * (started[w])))

    events = Events(first=("grant", "leave"))  # (time, kind, worker or link, link generation)

    def at(t: float, kind: str, who, generation: int = 0) -> None:
        events.at(t, kind, who, generation)

    def transfer(link: FairNetwork, t: float, key: tuple) -> None:
        link.add(t, key, nbytes, ("link",), cap[key[1]])
        done = link.next_done()
        at(done[0], "link", link, link.generation)

    version = 0
    published: list[float] = []  # when each version came out (its update applied)
    computed_on = [0] * n_workers  # version each worker's current gradient is computed on
    pushed_on = [deque() for _ in range(n_workers)]  # versions each worker's pushes in flight were computed on
    applied: list[list[float]] = [[] for _ in range(n_workers)]  # when each of a worker's gradients was handled
    held: dict[int, int] = {}  # a worker that never blocks, waiting to push: the version its gradient is on
    pending: dict[int, int] = {}  # worker -> version its pending gradient was computed on
    clock, started = [0] * n_workers, [0] * n_workers  # pushes arrived, pushes begun
    blocked_since: dict[int, float] = {}
    waits, stale, finished = [], [], [0.0] * n_workers
    server_free = 0.0
    gone: set[int] = set()
    head_done: dict[int, float] = {}  # overlap: when a worker's next round's first batches are computed
    rest: dict[int, int] = {}  # overlap: the batches of its round left for after its pull

    def start_iteration(w: int, t: float) -> None:
        if started[w] >= steps:
            finished[w] = t
            gone.add(w)
            at(t, "leave", w)
            return
        computed_on[w] = bisect.bisect_right(published, t)  # the pull reads the version out when it starts
        if policy.eager_pull:  # eager's pull hides behind the computation
            at(t + compute(w), "computed", w)
        else:
            transfer(up, t, ("pull", w))

    def needed(w: int) -> int:
        """How many of its gradients the server must have handled before a worker that never blocks pushes
        its next: all but the last :data:`UNAPPLIED_AT_MOST` - 1 (as the runtime's worker waits)."""
        return started[w] - UNAPPLIED_AT_MOST

    def paced(w: int) -> float | None:
        """When a worker that never blocks may push its next gradient (:func:`needed`); None: not yet
        known (that gradient has not reached the server)."""
        need = needed(w)
        return 0.0 if need < 1 else applied[w][need - 1] if len(applied[w]) >= need else None

    def computed(w: int, t: float) -> None:
        started[w] += 1
        if overlap_steps and started[w] < steps:  # the next round's first batches go on at once
            n = min(every, batches - every * started[w])
            head = min(overlap_steps, n)
            head_done[w], rest[w] = t + draw(w, head), n - head
        if policy.worker_blocks:
            push(w, t, computed_on[w])
            return
        held[w] = computed_on[w]
        ready = paced(w)
        if ready is not None:
            at(max(t, ready), "paced", w)

    def push(w: int, t: float, on: int) -> None:
        pushed_on[w].append(on)
        if not policy.worker_blocks:  # its next pull begins with the push (and goes the other way)
            start_iteration(w, t)
        transfer(down, t, ("push", w))

    for w in range(n_workers):
        start_iteration(w, 0.0)

    while events:
        t, kind, who, generation = events.pop()
        if kind == "link":
            if generation != who.generation:
                continue  # the transfers on that link changed since: a newer event stands
            _, (what, w) = who.next_done()
            who.finish(t, (what, w))
            done = who.next_done()
            if done is not None:
                at(done[0], "link", who, who.generation)
            if what == "pull":  # (under overlap the rest of the round follows its first batches too)
                at(max(t + machine.latency, head_done.pop(w, 0.0)) + compute(w), "computed", w)
            else:
                at(t + machine.latency, "arrive", w)
            continue
        if kind == "computed":
            computed(who, t)
            continue
        if kind == "paced":
            push(who, t, held.pop(who))
            continue
        if kind == "grant":
            waits.append(max(0.0, t - blocked_since.pop(who)))
            start_iteration(who, t)
            continue
        w = who
        begin = max(t, server_free)
        if kind == "leave":
            decision = policy.on_leave(w, begin)
            cost = machine.server_s
        else:
            clock[w] += 1
            pending[w] = pushed_on[w].popleft()
            if policy.worker_blocks:  # (under overlap, from when its round's first batches are done)
                blocked_since[w] = max(t, head_done.get(w, t))
            decision = policy.on_push(w, clock[w], pending[w], begin)
            cost = machine.server_s
        handled = []
        for group in decision.updates:
            cost += apply_s * len(group)
            for g in group:
                stale.append(version - pending.pop(g))
            version += 1
            handled += group
        for g in decision.drops:  # discarded by the paradigm: no update, no staleness
            pending.pop(g)
        server_free = begin + cost
        published.extend([server_free] * len(decision.updates))  # (the updates come out once applied)
        for g in handled + list(decision.drops):
            applied[g].append(server_free)
            if g in held and len(applied[g]) == needed(g):  # what its push waited for
                at(server_free, "paced", g)
        for g in decision.grants:
            if g in blocked_since and g not in gone:
                at(server_free, "grant", g)  # (as an event: a pull begun now, at a time to come, would
                # move the link's clock past transfers that end before it)
    return _prediction(paradigm, batches, finished, waits, stale, pushes=steps)


def _prediction(paradigm: str, steps: int, finished: list[float], waits: list[float],
                stale: list[int], pushes: int | None = None) -> Prediction:
    """The :class:`Prediction` of a simulated job from when each worker finished, its waits and staleness
    (``steps``: batches per worker; ``pushes``: gradients per worker, where local steps make them fewer)."""
    rates = {w: steps / t for w, t in enumerate(finished) if t > 0}
    return Prediction(paradigm, len(finished), len(finished) * (steps if pushes is None else pushes), max(finished),
                      float(np.mean(waits)) if waits else 0.0, float(np.mean(stale)) if stale else 0.0, rates)


def _simulate_grouped(paradigm: str, n_workers: int, groups: int, *, steps: int, nbytes: int,
                      clocks: list[ComputeTime], rngs: list[np.random.Generator], machine: Machine) -> Prediction:
    """Grouped servers (see the module docstring); mean staleness is the central server's, per group update."""
    if not 1 <= groups <= n_workers:
        raise ValueError(f"simulate: --groups {groups} with {n_workers} workers (1 to {n_workers} groups)")
    blocks = [list(range(lo, hi)) for lo, hi in shard_bounds(n_workers, groups)]
    group_of = {w: g for g, ws in enumerate(blocks) for w in ws}
    local = {w: i for ws in blocks for i, w in enumerate(ws)}
    central = make_policy(paradigm, groups)
    inner = [make_policy(central.group_policy, len(ws)) for ws in blocks]
    transfer = machine.transfer(nbytes)
    close_s = machine.update_s + nbytes / machine.apply_rate  # per gradient of a closing update

    events = Events()  # (time, kind, worker or group)
    at = events.at

    version, clock, finished = 0, [0] * n_workers, [0.0] * n_workers
    rounds, pulled = [0] * groups, [0] * groups  # per group: updates sent; central version it last pulled
    group_free, central_free = [0.0] * groups, 0.0
    held: list[list[int]] = [[] for _ in range(groups)]  # grants a group gives once the central round trip is over
    deferred: list[list[tuple[str, int]]] = [[] for _ in range(groups)]
    blocked_since: dict[int, float] = {}
    waits, stale = [], []

    def release(g: int, t: float) -> None:
        for i in held[g]:
            w = blocks[g][i]
            waits.append(t - blocked_since.pop(w))
            start_iteration(w, t)
        held[g] = []

    def start_iteration(w: int, t: float) -> None:
        if clock[w] >= steps:
            finished[w] = t
            at(t, "leave", w)
        else:
            at(t + transfer + clocks[w].sleep_after(0.0, rngs[w]) + transfer, "arrive", w)

    for w in range(n_workers):
        start_iteration(w, 0.0)
    while events:
        t, kind, who = events.pop()
        if kind == "central":  # group ``who``'s update reaches the central server
            begin = max(t, central_free)
            decision = central.on_push(who, rounds[who], pulled[who], begin)
            central_free = begin + machine.server_s + close_s * sum(len(u) for u in decision.updates)
            for _ in decision.updates:
                stale.append(version - pulled[who])
                version += 1
            pulled[who] = version
            at(central_free + machine.latency + transfer, "granted", who)  # receipt, then the pull
            continue
        if kind == "granted":
            group_free[who] = t
            release(who, t)
            for kind_, w in deferred[who]:  # what reached the group server during the round trip
                at(t, kind_, w)
            deferred[who] = []
            continue
        g = group_of[who]
        if group_free[g] == math.inf:
            deferred[g].append((kind, who))
            continue
        begin = max(t, group_free[g])
        if kind == "leave":
            decision = inner[g].on_leave(local[who], begin)
        else:
            clock[who] += 1
            blocked_since[who] = t
            decision = inner[g].on_push(local[who], clock[who], rounds[g], begin)
        done = begin + machine.server_s + close_s * sum(len(u) for u in decision.updates)
        held[g] += [i for i in decision.grants if blocks[g][i] in blocked_since]
        if decision.updates:  # busy with the central round trip until "granted"
            rounds[g] += 1
            group_free[g] = math.inf
            at(done + transfer, "central", g)
        else:
            group_free[g] = done
            release(g, done)
    return _prediction(paradigm, steps, finished, waits, stale)


def sweep(paradigms: list[str], workers: list[int], *, straggler: float = 1.0, progress: bool = False,
          links: list[str] | None = None, **options) -> list[Prediction]:
    """Every paradigm at every worker count; with ``straggler`` > 1 the last worker is that much slower;
    ``links``: ``hpcps emulate``'s ``--link`` words (node 0 the server, node k worker k-1)."""
    from tqdm import tqdm

    if not straggler >= 1:
        raise ValueError(f"simulate: --straggler must be 1 or more (times slower); got {straggler:g}")
    cases = [(p, n) for p in paradigms for n in workers]
    return [simulate(p, n, slowdown={n - 1: straggler} if straggler > 1 else None,
                     links=Links.from_words(links, n) if links else None, **options)
            for p, n in tqdm(cases, desc="simulate", unit="case", disable=not progress, file=sys.stderr)]


def write_outputs(predictions: list[Prediction], out, settings: str = "") -> list:
    """``simulate.csv`` and ``simulated_throughput.png`` (iterations/s against workers, per paradigm:
    a marker and line style each, so lines that coincide stay apart; ``settings`` in the title)."""
    import csv
    from pathlib import Path

    from matplotlib.ticker import NullLocator, ScalarFormatter

    from hpcps.analysis.report import _figure, _save

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "simulate.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["paradigm", "workers", "iterations_per_s", "mean_wait_ms", "mean_staleness"])
        for r in predictions:
            w.writerow([r.paradigm, r.workers, f"{r.throughput:.4g}", f"{r.mean_wait_s * 1e3:.4g}",
                        f"{r.mean_staleness:.4g}"])
    plt, fig, ax = _figure(figsize=(7.5, 5))
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--"), ("X", "-.")]
    for k, name in enumerate(dict.fromkeys(r.paradigm for r in predictions)):
        mine = [r for r in predictions if r.paradigm == name]
        marker, line = styles[k % len(styles)]
        ax.plot([r.workers for r in mine], [r.throughput for r in mine], marker=marker, linestyle=line,
                markersize=7 - k % 3, markerfacecolor="none" if k % 2 else None, label=name)
    counts = sorted({r.workers for r in predictions})
    ax.set(xscale="log", yscale="log", xlabel="workers", ylabel="iterations/s (all workers)",
           title="predicted throughput (hpcps simulate)" + (f"\n{settings}" if settings else ""))
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.xaxis.set_minor_locator(NullLocator())  # the worker counts, and only they, on the x axis
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return [out / "simulate.csv", _save(plt, fig, out / "simulated_throughput.png")]

