#!/usr/bin/env python3
"""How bsp's round should close and reach the workers: a prototype outside the runtime, against DDP and
hpcps bsp in one invocation (what led to ``--pull send``).

hpcps bsp closes a round when every worker's whole gradient is in, and each worker then reads the new
parameters out of the shards' windows (one-sided ``Rget``s after its grant). Two changes were candidates
for the 4-node, 1 Gbit/s step against DDP: a round that closes *per partition*, so the first partitions'
parameters move while the last gradients are still pushed, and shards that *send* the parameters rather
than being read. Building the first into the runtime touches the gradient's verdict, the shards' round
sums and the window's claim/pin protocol, so this prototype measured both first, on the same workload, in
the same box:

* the flat vector in chunks of ``--chunk-mb`` (hpcps's ``--partition-mb``), dealt to the shards
  (``--assign``: striped, chunk ``c`` on shard ``c mod S``, as hpcps stripes them; or contiguous); one
  shard beside each worker (ranks ``2k`` and ``2k+1`` on node ``k``: the colocated placement);
* a worker pushes each chunk's gradient (``Isend``) as backward produces it, and its forward pass waits,
  module by module, for the chunks that hold the module's parameters: the emulated compute and the real
  passes are those of hpcps's hooks, as in ``tools/bench_allreduce.py``;
* a shard sums a chunk in worker order once every worker's copy is in and steps it (SGD). Then, by mode:
  ``get``, once every chunk of the round is in, it grants every worker, which reads the chunks out of its
  window in the pass's order (hpcps's bsp); ``round``, once every chunk is in, it sends them, first chunks
  first (hpcps's ``--pull send``); ``piece``, it sends each chunk as soon as that chunk is summed (the
  round per partition).

Waits poll with a backoff and the emulated sleeps keep the transfers moving, as hpcps's do. Every mode
ends on the same parameters bit for bit (the same sums in the same order); the run checks it. Nothing
here handles what the runtime must (a nonfinite gradient's verdict, stragglers, joins, faults): it
measures bounds, it is not a paradigm. The figures are in docs/results.md.

    python tools/bench_piecewise.py --workers 4 --steps 60 --seeds 0 1 2 --link 1gbit -- \\
        --model tools/bench_partitions.py:deep_mlp --hidden 410 --dataset mnist1d --compute-time 0.05 \\
        --compute-forward 0.33 --compute-backward 0.67
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_allreduce import NO_EVAL, _box, _run_inner
from benchlib import fmt, launch_argv, train


class Poller:
    """Outstanding requests, moved while a rank waits or emulates compute, as hpcps's waits do: polls with a
    backoff (:func:`hpcps.transport.poll.wait_until`) and sleeps that poke (:func:`hpcps.cluster.emulation.
    emulated_sleep`)."""

    def __init__(self) -> None:
        self.pending: list = []

    def poke(self) -> None:
        if self.pending:
            from mpi4py import MPI
            MPI.Request.Testsome(self.pending)
            self.pending = [r for r in self.pending if r]  # (a completed request turns into MPI.REQUEST_NULL)

    def drain(self) -> None:
        """Wait for every outstanding request."""
        self.until(lambda: self.poke() or not self.pending)

    def sleep(self, seconds: float) -> None:
        from hpcps.cluster.emulation import emulated_sleep
        emulated_sleep(seconds, self.poke)

    def wait(self, request) -> float:
        """Wait for ``request``, moving the others; return the seconds waited."""
        return self.until(lambda: request.Test() or self.poke())

    @staticmethod
    def until(test) -> float:
        from hpcps.transport.poll import Backoff, wait_until
        return wait_until(test, Backoff(first=5e-5))


#: the prototype's runs: how a round closes and how its parameters reach the workers
MODES = {"get": "round closes whole, workers read the window (Rget) after a grant",
         "round": "round closes whole, shards send the parameters",
         "piece": "round closes per chunk, shards send each chunk"}
GRANT = 1 << 20  # the tag of a shard's grant (``get``): its round's parameters may be read


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def _owners(n_chunks: int, shards: list[int], assign: str) -> list[int]:
    """Each chunk's shard: ``striped``, chunk c on shard c mod S; ``contiguous``, the S shards hold S runs of
    chunks in turn, as hpcps's shards hold ranges of the flat vector."""
    s = len(shards)
    return [shards[c % s] if assign == "striped" else shards[c * s // n_chunks] for c in range(n_chunks)]


def _worker(cfg, comm, shards: list[int], steps: int, chunk: int, mode: str,
            assign: str) -> tuple[list[float], np.ndarray]:
    """One worker's loop (module docstring); returns its step times and its final parameters."""
    from mpi4py import MPI

    from hpcps.cluster.emulation import BackwardCompute, ComputeTime, forward_compute
    from hpcps.data.batches import to_device
    from hpcps.training.flat import FlatParameters
    from benchlib import data_parallel_replica

    workers = comm.Split(0, comm.rank)
    workload, model, batches = data_parallel_replica(cfg, workers, steps)
    flat = FlatParameters(model)
    chunks = _chunks(flat.n_params, chunk)
    owner = _owners(len(chunks), shards, assign)
    poller = Poller()
    emulated = ComputeTime(cfg.compute_time)
    fwd = forward_compute(model, lambda: emulated.forward_seconds(cfg.compute_forward), poller.sleep)
    bwd = BackwardCompute(model, lambda: emulated.forward_seconds(cfg.compute_backward), poller.sleep)
    spans = {id(p): (o, o + n) for p, _m, _n, o, n in flat._spans if p is not None}
    # a chunk's gradient is ready once every parameter value in it is: count them down in backward
    members = {c: [id(p) for p in model.parameters() if spans[id(p)][0] < hi and spans[id(p)][1] > lo]
               for c, (lo, hi) in enumerate(chunks)}
    of_param: dict[int, list[int]] = {}
    for c, ids in members.items():
        for i in ids:
            of_param.setdefault(i, []).append(c)
    arrivals: list = [None] * len(chunks)  # this step's Irecv of each chunk's new parameters
    waited = [0.0]

    def needs(module) -> list[int]:
        return sorted({c for p in module.parameters(recurse=False) for c in of_param[id(p)]})

    def before(module, _args) -> None:
        for c in needs(module):
            if arrivals[c] is not None:
                waited[0] += poller.wait(arrivals[c])
                arrivals[c] = None

    hooks = [m.register_forward_pre_hook(before, prepend=True)
             for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    left: dict[int, int] = {}

    def ready(param) -> None:  # after BackwardCompute's hook (registered first) has slept its share
        for c in of_param[id(param)]:
            left[c] -= 1
            if left[c] == 0:
                lo, hi = chunks[c]
                poller.pending.append(comm.Isend(flat.grads[lo:hi], dest=owner[c], tag=c))

    grad_hooks = [p.register_post_accumulate_grad_hook(ready) for p in model.parameters()]
    win = MPI.Win.Create(np.empty(1, np.float32), disp_unit=4, comm=comm) if mode == "get" else None
    if win is not None:
        win.Lock_all(MPI.MODE_NOCHECK)  # shared, for the run (as hpcps's window)
    grant = np.empty(1, np.int64)
    times = []
    comm.Barrier()
    for step in range(steps):
        t = time.perf_counter()
        waited[0] = 0.0
        if win is not None and step:  # each shard's grant, then its chunks read in the forward pass's order
            grants = [comm.Irecv(grant, source=r, tag=GRANT) for r in shards]
            due = set(shards)

            def granted() -> bool:
                for r, g in zip(shards, grants):
                    if r in due and g.Test():
                        due.discard(r)
                        for c in (c for c in range(len(chunks)) if owner[c] == r):
                            lo, hi = chunks[c]
                            arrivals[c] = win.Rget(flat.params[lo:hi], r, (lo, hi - lo, MPI.FLOAT))
                poller.poke()
                return not due

            waited[0] += poller.until(granted)
        batch = to_device(batches.batch(step), flat.device)
        flat.zero_grad()
        bwd.begin()
        left.clear()
        left.update({c: len(ids) for c, ids in members.items()})
        loss = workload.loss(model, batch)
        if step + 1 < steps and win is None:  # the next step's parameters, as the shards send them
            for c, (lo, hi) in enumerate(chunks):
                arrivals[c] = comm.Irecv(flat.params[lo:hi], source=owner[c], tag=c)
        loss.backward()
        pause = emulated.sleep_after(time.perf_counter() - t - waited[0], np.random.default_rng(0))
        if pause > 0:
            poller.sleep(pause)
        poller.drain()  # the pushes are out before backward writes the buffer again
        times.append(time.perf_counter() - t)
    for h in [*hooks, *grad_hooks, *fwd]:
        h.remove()
    bwd.remove()
    if win is not None:
        win.Unlock_all()
        comm.Barrier()
        win.Free()
    return times, flat.params[:flat.n_params].copy()


def _shard(cfg, comm, shards: list[int], workers: list[int], steps: int, chunk: int, mode: str, assign: str) -> None:
    """One shard's rounds (module docstring), ``mode`` one of :data:`MODES`."""
    from mpi4py import MPI

    from hpcps.transport.poll import Backoff

    from benchlib import data_parallel_replica
    from hpcps.training.flat import FlatParameters

    alone = comm.Split(1, comm.rank)
    _w, model, _b = data_parallel_replica(cfg, alone, 1)  # the same initial parameters as every worker's
    flat = FlatParameters(model)
    params = flat.params
    chunks = _chunks(flat.n_params, chunk)
    owner = _owners(len(chunks), shards, assign)
    mine = [c for c in range(len(chunks)) if owner[c] == comm.rank]
    n = len(workers)
    inbox = {(w, c): np.empty(chunks[c][1] - chunks[c][0], np.float32) for w in range(n) for c in mine}
    poller = Poller()
    win = MPI.Win.Create(params, disp_unit=4, comm=comm) if mode == "get" else None
    if win is not None:
        win.Lock_all(MPI.MODE_NOCHECK)
    grant = np.zeros(1, np.int64)
    comm.Barrier()
    for step in range(steps):
        keys = [(w, c) for w in range(n) for c in mine]
        reqs = [comm.Irecv(inbox[k], source=workers[k[0]], tag=k[1]) for k in keys]
        have = dict.fromkeys(mine, 0)
        closed: list[int] = []
        backoff = Backoff(first=5e-5)
        while len(closed) < len(mine):
            idx = MPI.Request.Testsome(reqs)
            poller.poke()
            if not idx:
                backoff.pause()
                continue
            backoff.reset()
            for i in idx:
                c = keys[i][1]
                have[c] += 1
                if have[c] == n:
                    closed.append(c)
                    if mode == "piece":
                        _apply(params, inbox, chunks, c, n, cfg.lr)
                        if step + 1 < steps:
                            _send(comm, poller, params, chunks, c, workers)
        if mode in ("round", "get"):
            for c in sorted(mine):
                _apply(params, inbox, chunks, c, n, cfg.lr)
            if step + 1 < steps and mode == "round":
                for c in sorted(mine):
                    _send(comm, poller, params, chunks, c, workers)
            elif step + 1 < steps:  # the workers read it from the window (hpcps's pull)
                win.Sync()
                poller.pending.extend(comm.Isend(grant, dest=w, tag=GRANT) for w in workers)
        poller.drain()  # a chunk's sends are out before its next update
    if win is not None:  # (the workers' reads of the last round are done: they are in the barrier of the end)
        win.Unlock_all()
        comm.Barrier()
        win.Free()


def _apply(params, inbox, chunks, c, n, lr) -> None:
    lo, hi = chunks[c]
    total = inbox[(0, c)].copy()
    for w in range(1, n):
        total += inbox[(w, c)]
    params[lo:hi] -= np.float32(lr / n) * total


def _send(comm, poller, params, chunks, c, workers) -> None:
    lo, hi = chunks[c]
    poller.pending.extend(comm.Isend(params[lo:hi], dest=w, tag=c) for w in workers)


def _inner(mode: str, assign: str, steps: int, chunk_mb: float, options: list[str]) -> None:
    import torch
    from mpi4py import MPI

    from benchlib import config_of

    comm = MPI.COMM_WORLD
    cfg = config_of(options)
    torch.set_num_threads(cfg.threads)
    workers, shards = list(range(0, comm.size, 2)), list(range(1, comm.size, 2))
    chunk = max(1, int(chunk_mb * 2**20 / 4))
    if comm.rank in workers:
        times, final = _worker(cfg, comm, shards, steps, chunk, mode, assign)
        median = float(np.median(times))
    else:
        _shard(cfg, comm, shards, workers, steps, chunk, mode, assign)
        median, final = 0.0, None
    worst = comm.reduce(median, op=MPI.MAX, root=0)
    finals = comm.gather(final, root=0)
    if comm.rank == 0:
        finals = [f for f in finals if f is not None]
        same = all(np.array_equal(finals[0], f) for f in finals[1:])
        digest = float(np.sum(finals[0].astype(np.float64)))
        print(f"MEDIAN_STEP_S {worst}\nSAME {int(same)}\nDIGEST {digest!r}")


def _run(mode: str, assign: str, n: int, steps: int, chunk_mb: float, options: list[str],
         box: str) -> tuple[float, str]:
    from hpcps.cluster.launcher import clean_environ
    cmd = launch_argv(2 * n, [sys.executable, os.path.abspath(__file__), "--inner", mode, "--assign", assign,
                              "--steps", str(steps),
                              "--chunk-mb", str(chunk_mb), "--", *options], box)
    proc = subprocess.run(cmd, env=clean_environ(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    out = dict(line.split(maxsplit=1) for line in proc.stdout.splitlines() if line[:1].isupper() and " " in line)
    if out.get("SAME") != "1":
        raise SystemExit(f"{mode}: the workers ended on different parameters")
    return float(out["MEDIAN_STEP_S"]), out["DIGEST"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="N workers, one node each with its shard (default 4)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--link", default="1gbit", help="the box's link rate (default 1gbit)")
    p.add_argument("--buffer", default="512kb", help="the switch's queue per port (default 512kb)")
    p.add_argument("--chunk-mb", type=float, default=0.25, help="chunk size, and hpcps's --partition-mb (0.25)")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="DDP's bucket_cap_mb (default 1: its best here)")
    p.add_argument("--assign", nargs="+", choices=["striped", "contiguous"], default=["striped"],
                   help="how chunks go to shards: striped (chunk c on shard c mod S: hpcps's stripes under "
                        "--partition-mb), contiguous (S runs of chunks); each in this invocation (default striped)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="the prototype's runs, each in this invocation (default all)")
    p.add_argument("--inner", choices=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("options", nargs="*", help="after --: hpcps train options (model, data, emulated compute)")
    a = p.parse_args()
    if a.inner:
        _inner(a.inner, a.assign[0], a.steps, a.chunk_mb, a.options)
        return
    n = a.workers
    seeded = [[*a.options, "--seed", str(s)] for s in a.seeds]
    rows: dict[str, list[float]] = {}
    rows[f"DDP (gloo), {a.bucket_mb:g} MB buckets"] = [_run_inner("ddp", n, a.steps, o, _box(n, a), a.bucket_mb)
                                                      for o in seeded]
    for pull in ("get", "send"):
        with tempfile.TemporaryDirectory() as tmp:
            its = [train(2 * n, Path(tmp) / "bsp.h5",
                         ["--paradigm", "bsp", "--servers", str(n), "--steps", str(a.steps), *NO_EVAL, *o,
                          "--partition-mb", f"{a.chunk_mb:g}", "--pull", pull],
                         emulate=_box(n, a, ranks_per_node=2))["it"] for o in seeded]
        rows[f"hpcps bsp colocated, --partition-mb {a.chunk_mb:g}, --pull {pull}"] = \
            [float(np.median(it["t_end"] - it["t_start"])) for it in its]
    digests = {}
    for assign in a.assign:
        for mode in a.modes:
            got = [_run(mode, assign, n, a.steps, a.chunk_mb, o, _box(n, a, ranks_per_node=2)) for o in seeded]
            rows[f"prototype, {assign} chunks, {MODES[mode]}"] = [t for t, _ in got]
            digests[(assign, mode)] = [d for _, d in got]
    if len({tuple(d) for d in digests.values()}) != 1:
        raise SystemExit(f"the prototype's runs ended on different parameters: {digests}")
    ddp = float(np.mean(next(iter(rows.values()))))
    print(f"{n} workers, {a.steps} steps, box at {a.link}, seeds {a.seeds}, chunks {a.chunk_mb:g} MB, "
          f"options: {' '.join(a.options)}\n")
    print("| run | median step ms | vs DDP |\n|---|---|---|")
    for name, ts in rows.items():
        print(f"| {name} | {fmt([t * 1e3 for t in ts], 1)} | {np.mean(ts) / ddp:.2f} |")
    print("\nevery prototype run ended on the same parameters as the others of its seed (sums in worker order)")


if __name__ == "__main__":
    main()
