#!/usr/bin/env python3
"""Homogeneous BSP through the parameter server against data-parallel allreduce, same model and workers.

Measured in one invocation, the mean step of each run (its wall time over its steps, the slowest rank's:
what a user waits for), the median step beside it (which hides the tail of slow steps):

* ``hpcps bsp S=1``, ``S=2`` and ``S=N``: ``hpcps train --paradigm bsp``
  on S server shards + N workers (a step: compute, push, wait for the
  round, pull; the medians of each part are printed too);
* ``allreduce (mpi4py)``: N ranks, each computes its gradient on its own
  batch (the same batches as hpcps), ``Allreduce`` of the flat gradient,
  SGD step;
* ``DDP (gloo)``: the same with ``torch.nn.parallel.DistributedDataParallel``
  over gloo (its bucketed all-reduce overlaps the backward pass), the ranks
  and addresses taken from MPI, once per ``--bucket-mb`` (DDP's
  ``bucket_cap_mb``; default 25, torch's own).

Ratios are mean step time against mpi4py allreduce (1.00: as fast; above: slower), and the best hpcps
against the best DDP on the mean (and on the median, for the record). The hpcps runs
evaluate only at their start and end (``--eval-interval 1e9``), as the data-parallel ones never do.

With ``--link RATE`` every run goes into a cluster in a box (``hpcps emulate``, root or a user
namespace) whose links run at RATE: allreduce on N nodes of one rank; hpcps bsp *colocated*, a
shard beside the worker on each of the N nodes (S=N, as BytePS places them); the same with one
extra node holding only a shard (S=N+1, BytePS's spare server); and hpcps bsp with *dedicated*
server nodes, S=1 and S=2 extra nodes holding only a shard. DDP runs there too, over the
nodes' own links: gloo on the emulated interface, its rendezvous at node 0's address. Every
method emulates ``--compute-time`` the same way, ``--compute-forward`` and ``--compute-backward``
included: the shares spent layer by layer inside the passes by hpcps's own hooks
(:mod:`hpcps.cluster.emulation`), the rest as a sleep after the pass. ``--partitions MB [MB ...]``
runs the colocated hpcps placement once per partition size (0: whole transfers), in the same
invocation, and ``--pulls get send`` once per ``--pull`` (the shards send a round's parameters, or the
workers read them). ``--placements defaults`` runs ``hpcps train --paradigm bsp`` with none of these flags, on two
ranks per node: what ``auto`` places and chooses (:mod:`hpcps.options.defaults`). With ``--link`` the bench
ends with the bound of a step at the link's line rate (:func:`step_bounds`) and each method's mean step over it.

    python tools/bench_allreduce.py --workers 4 -- --hidden 1024
    python tools/bench_allreduce.py --workers 4 --steps 20 -- --model resnet18 \
        --dataset synthetic:3x32x32:10:2048 --batch-size 16
    python tools/bench_allreduce.py --workers 4 --steps 60 --link 1gbit -- --hidden 16384 --compute-time 0.05
    python tools/bench_allreduce.py --workers 4 --steps 60 --link 1gbit --placements colocated spare -- \
        --model tools/bench_partitions.py:deep_mlp --hidden 410 --dataset mnist1d --compute-time 0.05 \
        --compute-forward 0.33 --compute-backward 0.67 --partition-mb 0.25
    python tools/bench_allreduce.py --workers 4 --steps 60 --seeds 0 1 2 --link 1gbit --placements colocated \
        --bucket-mb 25 1 0.25 --partitions 0 0.25 -- --model tools/bench_partitions.py:deep_mlp --hidden 410 \
        --dataset mnist1d --compute-time 0.05 --compute-forward 0.33 --compute-backward 0.67

(The last: partitioned pulls during the forward pass and pushes during the backward pass, which the
emulated compute spends layer by layer; the all-reduce runs spend the same compute time, then reduce.)
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

from benchlib import config_of, data_parallel_replica, fmt, init_gloo, torchft_version, train
from hpcps.analysis.report import mean_step
from hpcps.box.spec import CONGESTION


#: hpcps evaluates only at the start and the end, as the data-parallel runs do not evaluate at all: rank 0's
#: evaluations in the background (every 0.1 s by default) slowed its shard's publishes in the box; and no
#: watch of the loss stops a run (a bench of step times: the 9-layer deep_mlp at the default lr does not
#: learn, and the flat-loss watch stopped a 400-step run at step 307). Later options in the command still win.
NO_EVAL = ["--eval-interval", "1e9", "--divergence", "ignore"]
#: the row of hpcps train --paradigm bsp with no layout, pull or partition flag (--placements defaults)
NO_FLAGS = "hpcps bsp, no flags (auto: S=N)"


def _inner(kind: str, steps: int, options: list[str], bucket_mb: float = 25.0) -> None:
    """Run under mpiexec -n N: data-parallel SGD with ``kind`` in {mpi, ddp, torchft}; rank 0 prints the mean step (the
    slowest rank's wall time over its steps) and the median step (the slowest rank's).

    The model, data and loss are those ``hpcps train`` would build from the same options (any
    ``--model`` and ``--dataset``), and so are each rank's batches and the emulated compute: the
    ``--compute-forward`` and ``--compute-backward`` shares layer by layer inside the passes (hpcps's
    own hooks), the rest of ``--compute-time`` after the pass, as an hpcps worker spends it.
    """
    import torch
    from mpi4py import MPI

    from hpcps.cluster.emulation import BackwardCompute, ComputeTime, forward_compute
    from hpcps.data.batches import to_device
    from hpcps.training.flat import FlatParameters

    comm = MPI.COMM_WORLD
    cfg = config_of(options, drop=("partition_mb",))  # (hpcps's; the data-parallel runs have nothing to partition)
    torch.set_num_threads(cfg.threads)
    workload, model, batches = data_parallel_replica(cfg, comm, steps)
    flat = FlatParameters(model)
    emulated = ComputeTime(cfg.compute_time, cfg.slowdown.get(comm.rank + 1, 1.0), cfg.jitter, cfg.jitter_cv)
    # the passes' shares, layer by layer, before DDP's hooks: a gradient is ready for its bucket once its
    # share of the emulated backward has passed, as for an hpcps worker's pushes during backward
    hooks = forward_compute(model, lambda: emulated.forward_seconds(cfg.compute_forward), time.sleep) \
        if cfg.compute_forward else []
    backward = BackwardCompute(model, lambda: emulated.forward_seconds(cfg.compute_backward), time.sleep) \
        if cfg.compute_backward else None
    ddp = None
    if kind == "ddp":
        init_gloo(comm)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
    manager = lighthouse = None
    if kind == "torchft":  # torchft's fault-tolerant DDP: a replica group of one process per rank
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
        from torchft import DistributedDataParallel as TorchftDDP
        from torchft_box import manager as torchft_manager, start_lighthouse

        lighthouse = start_lighthouse(comm)
        manager, _pg, _store = torchft_manager(comm, state_dict=lambda: {"model": model.state_dict()},
                                               load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
                                               timeout=60.0)
        ddp = TorchftDDP(manager, model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
    grads = torch.from_numpy(flat.grads[:flat.n_params])
    rng = np.random.default_rng([cfg.seed, comm.rank + 1, 7])
    times = []
    comm.Barrier()
    began = time.perf_counter()
    for step in range(steps):
        t = time.perf_counter()
        batch = to_device(batches.batch(step), flat.device)
        if manager is not None:
            manager.start_quorum()  # (what torchft's Optimizer.zero_grad does first; async: during the forward)
        flat.zero_grad()
        if backward is not None:
            backward.begin()
        loss = workload.loss(ddp or model, batch)
        loss.backward()
        pause = emulated.sleep_after(time.perf_counter() - t, rng)  # as an hpcps worker emulates its compute
        if pause > 0:
            time.sleep(pause)
        if kind == "mpi":
            comm.Allreduce(MPI.IN_PLACE, flat.grads[:flat.n_params], op=MPI.SUM)
            grads /= comm.size
        # (DDP averaged the gradients during backward already; torchft's too, over its quorum)
        if manager is not None and not manager.should_commit():  # (torchft's Optimizer.step: a vote)
            raise RuntimeError(f"torchft did not commit step {step}, with nothing killed")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-cfg.lr)
        times.append(time.perf_counter() - t)
    mean = comm.reduce((time.perf_counter() - began) / steps, op=MPI.MAX, root=0)
    median = comm.reduce(float(np.median(times)), op=MPI.MAX, root=0)
    if comm.rank == 0:
        print(f"MEAN_STEP_S {mean}")
        print(f"MEDIAN_STEP_S {median}")
        print(f"MODEL_BYTES {flat.size * flat.params.itemsize}")
    for handle in hooks:
        handle.remove()
    if kind == "ddp":
        import torch.distributed as dist
        dist.destroy_process_group()
    if manager is not None:
        from torchft_box import leave
        leave(comm, manager, lighthouse)


def _box(nodes: int, a, ranks_per_node: int = 1) -> str | None:
    """``hpcps emulate`` options for ``nodes`` nodes at ``--link``, or None without ``--link``."""
    if a.link is None:
        return None
    return (f"--nodes {nodes} --ranks-per-node {ranks_per_node} --link {a.link} --buffer {a.buffer} "
            f"--congestion {a.congestion}")


#: the model's size in bytes, as the data-parallel runs report it (for the bound of a step)
MODEL_BYTES: list[int] = []


def _run_inner(kind: str, n: int, steps: int, options: list[str], emulate: str | None = None,
               bucket_mb: float = 25.0) -> tuple[float, float]:
    from benchlib import launch_argv
    from hpcps.cluster.launcher import clean_environ
    cmd = launch_argv(n, [sys.executable, os.path.abspath(__file__), "--inner", kind, "--steps", str(steps),
                          "--bucket-mb", str(bucket_mb), "--", *options], emulate)
    proc = subprocess.run(cmd, env=clean_environ(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{proc.stderr[-2000:]}")
    said = {}
    for line in proc.stdout.splitlines():
        words = line.split()
        if len(words) == 2 and words[0] in ("MEAN_STEP_S", "MEDIAN_STEP_S", "MODEL_BYTES"):
            said[words[0]] = float(words[1])
    MODEL_BYTES.append(int(said["MODEL_BYTES"]))
    return said["MEAN_STEP_S"], said["MEDIAN_STEP_S"]


def step_bounds(compute_s: float, forward: float, backward: float, model_bytes: int, n: int,
                link_bps: float) -> dict[str, float]:
    """Lower bounds of a step, in seconds, at the link's line rate, for ``n`` nodes of one worker each.

    Per step, each node's link carries ``2 (n-1)/n`` of the model each way, under a ring all-reduce as under
    bsp with a shard on every node (a push phase, then a pull phase, each ``(n-1)/n`` of the model).

    * **bsp, colocated shards**: the push can overlap the backward pass only (its gradients appear there),
      and the pull the next forward pass only (it cannot start before the round closes):
      ``compute - F - B + max(B, T_push) + max(F, T_pull)``;
    * **all-reduce overlapping backward** (DDP): the reduction of the whole gradient can overlap the backward
      pass only (the step follows it, and the next forward needs the step):
      ``compute - B + max(B, T_allreduce)``, ``T_allreduce = T_push + T_pull``.

    ``forward`` and ``backward`` are the shares of ``compute_s`` spent in the passes
    (``--compute-forward``, ``--compute-backward``); the rest comes before the passes and overlaps nothing.
    """
    phase = (n - 1) / n * model_bytes * 8 / link_bps
    f, b = compute_s * forward, compute_s * backward
    return {"bsp": compute_s - f - b + max(b, phase) + max(f, phase),
            "allreduce": compute_s - b + max(b, 2 * phase)}


def median_step(it: np.ndarray) -> float:
    return float(np.median(it["t_end"] - it["t_start"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="N workers / data-parallel ranks (default 4)")
    p.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run of every method per seed (default 0)")
    p.add_argument("--inner", choices=["mpi", "ddp", "torchft"], help=argparse.SUPPRESS)
    p.add_argument("--torchft", action="store_true",
                   help="a row of torchft's fault-tolerant DDP per --bucket-mb too (pip install '.[peers]')")
    p.add_argument("--link", metavar="RATE", help="run everything in a cluster in a box with links of RATE "
                                                  "(e.g. 1gbit): colocated and dedicated server nodes")
    p.add_argument("--buffer", default="512kb", help="with --link: the switch's queue per port (default 512kb)")
    p.add_argument("--congestion", default=CONGESTION,
                   help=f"with --link: the nodes' TCP congestion control (hpcps emulate --congestion; default "
                        f"{CONGESTION}, host for the host's own)")
    p.add_argument("--placements", nargs="+", choices=["defaults", "former", "colocated", "spare", "dedicated"],
                   default=["colocated", "spare", "dedicated"],
                   help="with --link: which server placements to run (default colocated, spare, dedicated); "
                        "defaults: hpcps train --paradigm bsp with no layout, pull or partition flag, on two ranks "
                        "per node (what auto chooses); former: the same job under the defaults before auto (one "
                        "server beside 2N-1 workers, --pull get, whole transfers)")
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0], metavar="MB",
                   help="DDP's bucket_cap_mb: one DDP run per size (default 25, torch's own)")
    p.add_argument("--partitions", type=float, nargs="+", metavar="MB",
                   help="with --link: the colocated hpcps placement once per --partition-mb MB (0: whole "
                        "transfers), in this invocation")
    p.add_argument("--shards-at-once", dest="fanin", type=int, nargs="+", metavar="K",
                   help="with --link: the colocated hpcps placement once per --shards-at-once K (0: every shard at "
                        "once) and partition size, in this invocation")
    p.add_argument("--pulls", nargs="+", choices=["get", "send"],
                   help="with --link: the colocated hpcps placement once per --pull (get: workers read the window; "
                        "send: the shards send each round's parameters), in this invocation")
    p.add_argument("options", nargs="*", help="after --: hpcps train options shared by every run (model, batch)")
    a = p.parse_args()
    if a.inner:
        _inner(a.inner, a.steps, a.options, a.bucket_mb[0])
        return
    n = a.workers
    seeded = [[*a.options, "--seed", str(seed)] for seed in a.seeds]
    rows = {"allreduce (mpi4py)": (n, [_run_inner("mpi", n, a.steps, o, _box(n, a)) for o in seeded])}
    for mb in a.bucket_mb:
        rows[f"DDP (gloo), {mb:g} MB buckets"] = (n, [_run_inner("ddp", n, a.steps, o, _box(n, a), mb)
                                                     for o in seeded])
    if a.torchft:
        for mb in a.bucket_mb:
            rows[f"torchft {torchft_version()} DDP (gloo), {mb:g} MB buckets"] = (
                n, [_run_inner("torchft", n, a.steps, o, _box(n, a), mb) for o in seeded])
    # (name, shards (None: auto), ranks, emulate, --partition-mb, --shards-at-once, --pull): on one machine
    # S=1, 2, N; in a box, the defaults, the former ones, colocated and dedicated server nodes
    pair = _box(n, a, ranks_per_node=2) if a.link is not None else None  # a shard and a worker on each node
    runs = ([(f"hpcps bsp S={s}", s, s + n, None, None, None, None) for s in sorted({1, 2, n})] if a.link is None else
            [(NO_FLAGS, None, 2 * n, pair, None, None, None)] * ("defaults" in a.placements) +
            [(f"hpcps bsp, the former defaults (S=1, {2 * n - 1} workers)", 1, 2 * n, pair, 0.0, None, "get")]
            * ("former" in a.placements) +
            [(f"hpcps bsp colocated S={n}" + (f", --partition-mb {mb:g}" if a.partitions else "") +
              (f", --shards-at-once {k}" if a.fanin else "") + (f", --pull {pull}" if a.pulls else ""),
              n, 2 * n, pair, mb, k, pull)
             for mb in (a.partitions or [None]) for k in (a.fanin or [None]) for pull in (a.pulls or [None])]
            * ("colocated" in a.placements) +
            [(f"hpcps bsp colocated + 1 server node S={n + 1}", n + 1, 2 * n + 1,
              _box(n + 1, a, ranks_per_node=2) + f" --ranks {n}=1", None, None, None)] * ("spare" in a.placements) +
            [(f"hpcps bsp dedicated S={s}", s, s + n, _box(n + s, a), None, None, None)
             for s in (1, 2)] * ("dedicated" in a.placements))
    parts: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, s, ranks, box, mb, k, pull in runs:
            part = ([] if mb is None else ["--partition-mb", f"{mb:g}"]) + ([] if k is None else ["--shards-at-once", str(k)]) \
                + ([] if pull is None else ["--pull", pull])
            servers = [] if s is None else ["--servers", str(s)]  # None: the default (auto) places them
            its = [train(ranks, Path(tmp) / f"bsp{s}.h5",
                         ["--paradigm", "bsp", *servers, "--steps", str(a.steps), *NO_EVAL, *o, *part],
                         emulate=box)["it"]
                   for o in seeded]
            rows[name] = (ranks, [(mean_step(it), median_step(it)) for it in its])
            parts[name] = {k: float(np.mean([np.median(it[k]) for it in its]))
                           for k in ("compute_s", "push_s", "wait_s", "pull_s")}

    def mean(name: str, k: int = 0) -> float:  # over the seeds: k 0 the mean step, 1 the median step
        return float(np.mean([t[k] for t in rows[name][1]]))

    base = mean("allreduce (mpi4py)")
    where = f", in a box with {a.link} links (switch buffer {a.buffer}, TCP {a.congestion})" if a.link else ""
    print(f"{n} workers, {a.steps} steps{where}, seeds {a.seeds}, options: {' '.join(a.options) or '(defaults)'}\n")
    print("| method | ranks | mean step ms | median step ms | vs allreduce (mean) | median compute / push / wait / pull ms |")
    print("|---|---|---|---|---|---|")
    for name, (ranks, ts) in rows.items():
        where = " / ".join(f"{v * 1e3:.1f}" for v in parts[name].values()) if name in parts else ""
        print(f"| {name} | {ranks} | {fmt([t[0] * 1e3 for t in ts], 2)} | {fmt([t[1] * 1e3 for t in ts], 2)} | "
              f"{mean(name) / base:.2f} | {where} |")
    best = min((name for name in rows if name.startswith("hpcps")), key=mean)
    print(f"\nbest hpcps bsp ({best}) mean step / mpi4py allreduce: {mean(best) / base:.2f}")
    ddp = min((name for name in rows if name.startswith("DDP")), key=mean)
    print(f"best hpcps bsp / best DDP ({ddp}), by the mean step: {mean(best) / mean(ddp):.2f} "
          f"(by the median: {mean(best, 1) / mean(ddp, 1):.2f})")
    torchft = [name for name in rows if name.startswith("torchft")]
    if torchft:
        peer = min(torchft, key=mean)
        print(f"best hpcps bsp / best torchft DDP ({peer}), by the mean step: {mean(best) / mean(peer):.2f}")
        if NO_FLAGS in rows:
            print(f"hpcps bsp with no flags / best torchft DDP, by the mean step: {mean(NO_FLAGS) / mean(peer):.2f}")
    if NO_FLAGS in rows:
        print(f"hpcps bsp with no flags / best DDP, by the mean step: {mean(NO_FLAGS) / mean(ddp):.2f}")
    if a.link is not None:
        from hpcps.box.spec import parse_rate

        cfg = config_of(a.options)
        compute = parts[best]["compute_s"]  # measured: the emulated time and what the passes overshoot
        bounds = step_bounds(compute, cfg.compute_forward, cfg.compute_backward, MODEL_BYTES[0], n,
                             parse_rate(a.link))
        print(f"\nbound of a step at the line rate ({a.link}, {MODEL_BYTES[0] / 1e6:.2f} MB, measured compute "
              f"{compute * 1e3:.1f} ms): bsp colocated {bounds['bsp'] * 1e3:.1f} ms, all-reduce overlapping "
              f"backward {bounds['allreduce'] * 1e3:.1f} ms")
        print(f"by the mean step: best hpcps / bsp bound {mean(best) / bounds['bsp']:.2f}, best DDP / bsp bound "
              f"{mean(ddp) / bounds['bsp']:.2f}, best DDP / all-reduce bound {mean(ddp) / bounds['allreduce']:.2f}")


if __name__ == "__main__":
    main()
