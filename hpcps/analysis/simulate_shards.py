"""The model of a job whose server is sharded over its nodes: a shard beside the workers on every node.

This is the layout ``--servers auto`` picks when a job spans nodes (:mod:`hpcps.options.defaults`), which
:func:`hpcps.analysis.simulate.simulate` (one server) cannot describe. The same policy objects decide, one
per shard, as each shard's server consults its own. What is modelled (every time in seconds):

* **nodes** ``0..N-1``, each with one shard and ``workers_per_node`` workers (worker ``w`` on node
  ``w // workers_per_node``); each shard holds ``1/N`` of the model's ``nbytes``;
* a **transfer** between two nodes crosses the sender's link up and the receiver's link down, each of
  the node's rate, shared max-min fairly with every transfer in flight on the network
  (:class:`hpcps.analysis.fairshare.FairNetwork`), then ``latency``; within a node it runs at
  ``machine.bandwidth``; without node rates every transfer does;
* a worker's **compute** per step as :func:`~hpcps.analysis.simulate.simulate` draws it; of it
  ``forward`` is spent in the forward pass and ``backward`` in the backward pass, the rest between them
  (where the emulation spends it when pushes begin in backward);
* the **push** leaves during backward, as hpcps's own loop sends each piece once backward has made it:
  each shard's part is fed at most as fast as backward makes it (its bytes over the backward pass),
  then at whatever the network gives; it reaches its shard no earlier than backward's end;
* each **shard** is a queue served in arrival order, costing ``server_s`` per push and ``update_s +
  (nbytes/N) / apply_rate`` per gradient of an update, and grants by its own policy;
* the **pull** (``pull``): ``"get"``, the worker reads every shard once all have granted it; ``"send"``,
  each shard sends its part as it grants. With ``partitioned`` pulls the forward pass runs as the
  partitions come, so it ends at the later of the pull's start plus the forward pass and the pull's
  end (the last partition's own compute is left out); otherwise it starts when the pull has ended.

Only paradigms whose worker waits for its grant, with no local steps, no eager pull, no extra gradients,
serial transfers nor group servers: the shape of a step in the layout the defaults pick. No contention
for cores, no losses: workers and shards have a core each, and the links are fluid.
"""

from __future__ import annotations

import bisect
import math
import sys

import numpy as np

from hpcps.analysis.events import Events
from hpcps.analysis.fairshare import FairNetwork
from hpcps.analysis.simulate import Machine, Prediction, _prediction, check_job
from hpcps.cluster.emulation import ComputeTime
from hpcps.policies import make_policy

PULLS = ("get", "send")


def node_rates(words: list[str], nodes: int) -> tuple[float, ...]:
    """Each node's link rate in bytes/s from ``hpcps emulate``'s ``--link`` words (raises ValueError)."""
    from hpcps.box.spec import make_cluster

    return tuple(node.rate_bps / 8 for node in make_cluster(nodes, list(words), buffer="1mb").nodes)


def _refuse(paradigm: str, policy) -> None:
    """ValueError naming what of ``paradigm`` the model of a shard per node lacks, if anything."""
    from hpcps.options.config import local_steps_of

    why = [what for what, has in (("its worker does not wait for its grant", not policy.worker_blocks),
                                  ("it pulls eagerly", policy.eager_pull),
                                  ("it computes extra gradients", policy.extra_gradients),
                                  ("its transfers go in turns", policy.serial_transfers),
                                  ("it has group servers", policy.uses_groups),
                                  ("it takes local steps", local_steps_of(paradigm, None) is not None))
           if has]
    if why:
        raise ValueError(f"simulate: paradigm {paradigm!r} is not modelled with a shard per node: {'; '.join(why)}")


def simulate_shards(paradigm: str, nodes: int, workers_per_node: int = 1, *, steps: int, nbytes: int,
                    compute_time: float, forward: float = 0.0, backward: float = 0.0, partitioned: bool = False,
                    pull: str = "get", rates: tuple[float, ...] | None = None,
                    slowdown: dict[int, float] | None = None, jitter: str = "none", jitter_cv: float = 0.1,
                    machine: Machine = Machine(), staleness: int = 2, staleness_max: int | None = None,
                    seed: int = 0, options: dict | None = None) -> Prediction:
    """``steps`` steps of each of ``nodes * workers_per_node`` workers under ``paradigm``, a shard on every node
    (see the module docstring). ``rates``: each node's link in bytes/s each way (:func:`node_rates`)."""
    if nodes < 1 or workers_per_node < 1:
        raise ValueError(f"simulate: --nodes and workers per node must be 1 or more; got {nodes} and "
                         f"{workers_per_node}")
    check_job(steps, compute_time, nbytes, slowdown)
    if not (0 <= forward and 0 <= backward and forward + backward <= 1):
        raise ValueError(f"simulate: --compute-forward and --compute-backward are shares of the compute, "
                         f"0 or more and together at most 1; got {forward:g} and {backward:g}")
    if pull not in PULLS:
        raise ValueError(f"simulate: --pull must be one of {', '.join(PULLS)}; got {pull!r}")
    if rates is not None and len(rates) != nodes:
        raise ValueError(f"simulate: link rates for {len(rates)} nodes, not {nodes}")
    slowdown = slowdown or {}
    n_workers, shards = nodes * workers_per_node, nodes
    policies = [make_policy(paradigm, n_workers, options, staleness=staleness, staleness_max=staleness_max)
                for _ in range(shards)]
    _refuse(paradigm, policies[0])
    if pull == "send" and not type(policies[0]).releases_rounds():
        raise ValueError(f"simulate: --pull send: paradigm {paradigm!r} does not release every worker at a round's "
                         f"close (as hpcps train refuses it); the shards send a round's parameters under bsp")
    clocks = [ComputeTime(compute_time, slowdown.get(w, 1.0), jitter, jitter_cv) for w in range(n_workers)]
    rngs = [np.random.default_rng([seed, w, 7]) for w in range(n_workers)]
    part = nbytes / shards
    apply_s = machine.update_s + part / machine.apply_rate
    net = FairNetwork({} if rates is None else {(way, n): r for n, r in enumerate(rates) for way in ("up", "down")})

    def node(w: int) -> int:
        return w // workers_per_node

    def route(src: int, dst: int) -> tuple[tuple, float]:
        """A transfer's path and cap: within a node, or without node links, at the machine's bandwidth."""
        if src == dst or rates is None:
            return (), machine.bandwidth
        return (("up", src), ("down", dst)), math.inf

    # a shard's grants and a worker's leave come out of a decision that ended at t: before what arrives then
    events = Events(first=("grant", "leave"))
    at = events.at

    def send(t: float, key: tuple, src: int, dst: int, cap: float = math.inf) -> None:
        path, most = route(src, dst)
        net.add(t, key, part, path, min(cap, most))
        at(net.next_done()[0], "net", net.generation)

    version = [0] * shards  # each shard's updates so far
    published: list[list[float]] = [[] for _ in range(shards)]  # each shard: when each of its versions came out

    def version_at(s: int, t: float) -> int:
        """Shard ``s``'s version a read at ``t`` finds (an update comes out when the shard has applied it)."""
        return bisect.bisect_right(published[s], t)

    computed_on = [[0] * shards for _ in range(n_workers)]  # each shard's version the worker's pull read
    pushes = [[0] * n_workers for _ in range(shards)]  # each shard: pushes arrived from each worker
    waiting: list[set[int]] = [set() for _ in range(shards)]  # each shard: workers it has not granted yet
    granted: list[set[int]] = [set() for _ in range(n_workers)]  # each worker: shards that granted its round
    pieces, released = [0] * n_workers, [False] * n_workers  # this round's pull: parts arrived; all granted
    pull_began, backward_s, backward_end = [0.0] * n_workers, [0.0] * n_workers, [0.0] * n_workers
    arrived = [0.0] * n_workers  # when the worker's push reached the last of its shards
    started, finished = [0] * n_workers, [0.0] * n_workers
    server_free = [0.0] * shards
    waits, stale = [], []

    def start_step(w: int, t: float) -> None:
        """Worker ``w`` has every grant (or begins): its pull, or its end."""
        if started[w] >= steps:
            finished[w] = t
            for s in range(shards):
                at(t, "leave", (w, s))
            return
        pull_began[w], released[w] = t, True
        if pull == "get" or started[w] == 0:  # (the first pull reads the shards whatever --pull says)
            for s in range(shards):
                computed_on[w][s] = version_at(s, t)
                send(t, ("pull", w, s), s, node(w))
        elif pieces[w] == shards:  # every shard's part came with its grant
            compute(w, t)

    def compute(w: int, t: float) -> None:
        """Its pull has ended at ``t``: the passes, and the push that goes during backward."""
        pieces[w], released[w] = 0, False
        started[w] += 1
        c = clocks[w].sleep_after(0.0, rngs[w])
        f, b = forward * c, backward * c
        backward_s[w] = b
        forward_end = max(pull_began[w] + f, t) if partitioned else t + f
        at(forward_end + (c - f - b), "backward", w)

    def grant(w: int, s: int, t: float) -> None:
        waiting[s].discard(w)
        granted[w].add(s)
        if pull == "send" and started[w] < steps:
            computed_on[w][s] = version_at(s, t)
            send(t, ("pull", w, s), s, node(w))
        if len(granted[w]) == shards:
            granted[w] = set()
            waits.append(t - arrived[w])
            start_step(w, t)

    for w in range(n_workers):
        start_step(w, 0.0)
    while events:
        t, kind, who = events.pop()
        if kind == "net":
            if who != net.generation:
                continue  # the transfers in flight changed since: a newer event stands
            _, key = net.next_done()
            net.finish(t, key)
            done = net.next_done()
            if done is not None:
                at(done[0], "net", net.generation)
            what, w, s = key
            if what == "pull":
                at(t + machine.latency, "piece", w)
            else:
                at(max(t, backward_end[w]) + machine.latency, "arrive", (w, s))
        elif kind == "piece":
            pieces[who] += 1
            if pieces[who] == shards and released[who]:
                compute(who, t)
        elif kind == "backward":  # each shard's part fed as backward makes it
            b = backward_s[who]
            backward_end[who] = t + b
            for s in range(shards):
                send(t, ("push", who, s), node(who), s, part / b if b > 0 else math.inf)
            if b > 0:
                at(t + b, "backward_end", who)
        elif kind == "backward_end":  # what is left of the push goes at the network's rate
            for s in range(shards):
                if ("push", who, s) in net.flows:
                    net.set_cap(t, ("push", who, s), route(node(who), s)[1])
                    at(net.next_done()[0], "net", net.generation)
        elif kind == "grant":
            grant(*who, t)
        else:
            w, s = who
            begin = max(t, server_free[s])
            if kind == "leave":
                decision = policies[s].on_leave(w, begin)
            else:
                pushes[s][w] += 1
                waiting[s].add(w)
                arrived[w] = t
                decision = policies[s].on_push(w, pushes[s][w], computed_on[w][s], begin)
            server_free[s] = begin + machine.server_s + apply_s * sum(len(group) for group in decision.updates)
            for group in decision.updates:
                stale.extend(version[s] - computed_on[g][s] for g in group)
                version[s] += 1
                published[s].append(server_free[s])
            for g in decision.grants:
                if g in waiting[s]:
                    at(server_free[s], "grant", (g, s))  # (a time to come: the network's clock is at t)
    return _prediction(paradigm, steps, finished, waits, stale)


def sweep_shards(paradigms: list[str], workers: list[int], nodes: int, *, straggler: float = 1.0,
                 progress: bool = False, links: list[str] | None = None, **options) -> list[Prediction]:
    """Every paradigm at every worker count (each a multiple of ``nodes``, spread evenly over them), a shard
    on every node; ``links``: ``hpcps emulate``'s ``--link`` words for the ``nodes`` nodes (none: every
    transfer at the machine's bandwidth); with ``straggler`` > 1 the last worker is that much slower."""
    from tqdm import tqdm

    if not straggler >= 1:
        raise ValueError(f"simulate: --straggler must be 1 or more (times slower); got {straggler:g}")
    if nodes < 1:
        raise ValueError(f"simulate: --nodes must be 1 or more; got {nodes}")
    odd = [n for n in workers if n < 1 or n % nodes]
    if odd:
        raise ValueError(f"simulate: --workers {odd[0]} is not a multiple of --nodes {nodes} (the workers are "
                         f"spread evenly over the nodes)")
    rates = node_rates(links, nodes) if links else None
    cases = [(p, n) for p in paradigms for n in workers]
    return [simulate_shards(p, nodes, n // nodes, slowdown={n - 1: straggler} if straggler > 1 else None,
                            rates=rates, **options)
            for p, n in tqdm(cases, desc="simulate", unit="case", disable=not progress, file=sys.stderr)]
