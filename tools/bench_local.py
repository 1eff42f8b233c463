#!/usr/bin/env python3
"""The local-SGD family against bsp and DDP on a small language model, in a cluster in a box.

One invocation runs, per seed, every method on the same model, data and emulated compute, in a box of
``--nodes`` nodes (one worker each) whose links run at ``--link``, and prints each method's time to a
validation loss (``--target``) and its validation loss after a fixed wall time (``--loss-at``), with
the ratios against bsp and DDP of the same invocation:

* ``bsp`` with partitions (``--partition-mb``), a shard beside each worker (S = nodes), AdamW on the
  shards; and once more per ``--shards-at-once K`` given (method ``bsp-rotated``): pushes and pulls
  reaching K shards at once, in a rotation;
* ``DDP`` (torch's ``DistributedDataParallel`` over gloo on the box's links, ``--bucket-mb``), AdamW,
  the same emulated compute layer by layer (:mod:`hpcps.cluster.emulation`'s hooks), evaluated by rank 0
  every ``--eval-interval`` seconds with the clock stopped while it evaluates;
* ``diloco`` at each ``--local-steps H``: AdamW inside at the same rate, Nesterov sgd outside (0.7, 0.9);
* the free form, ``asp --local-steps H`` (the first H) with Delayed Nesterov outside
  (``--momentum-period`` = the worker count), and the bounded one, ``ssp --local-steps H --staleness 1``,
  likewise (with Nesterov applied on every arrival instead, the bounded form diverged here after 340 s
  at a loss of 3.1);
* with ``--overlap-steps T ...``, ``diloco`` at each H with the outer step hidden behind the next round's
  first T steps (``hpcps train --overlap-steps``);
* ``torchft-diloco`` (when named in ``--methods``; ``pip install '.[peers]'``): torchft's DiLoCo at each H,
  the same inner AdamW and outer Nesterov sgd, one replica group per node, its lighthouse on node 0
  (``tools/peers/torchft_diloco.py``).

The model is examples/nanogpt_style.py's GPT (3 layers, 96 wide, 48 characters of context, no dropout:
0.35M parameters, 1.4 MB); the text is Python's own standard library (argparse, inspect, typing and
dataclasses, 0.4M characters, read where this Python keeps them), 90% to train. ``--straggler F``
makes the last worker F times slower.

    python tools/bench_local.py --nodes 4 --link 100mbit --seeds 0 1 --target 2.5 --compute-time 0.05 --steps 3000
    python tools/bench_local.py --nodes 4 --link 100mbit --seeds 0 --target 2.5 --compute-time 0.15 --steps 3000 \
        --straggler 2

Also the plug-ins the runs use: ``--model tools/bench_local.py:gpt --dataset tools/bench_local.py:chars
--loss tools/bench_local.py:lm_loss``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from nanogpt_style import GPT  # noqa: E402

VOCAB, BLOCK = 128, 48
FILES = ("argparse.py", "inspect.py", "typing.py", "dataclasses.py")


def _text() -> torch.Tensor:
    """The standard library's sources as ASCII codes (anything else as 0), at most 400,000 characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((root / name).read_text(encoding="utf-8") for name in FILES)[:400_000]
    return torch.tensor([ord(c) if ord(c) < VOCAB else 0 for c in text], dtype=torch.long)


class Windows(torch.utils.data.Dataset):
    """Windows of ``BLOCK`` characters of ``data`` every ``stride``, each with the next character's targets."""

    def __init__(self, data: torch.Tensor, stride: int) -> None:
        self.data, self.starts = data, range(0, len(data) - BLOCK - 1, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        s = self.starts[i]
        return self.data[s:s + BLOCK], self.data[s + 1:s + 1 + BLOCK]


def chars():
    """The data set plug-in: (train, held-out) windows of the text, split 90/10."""
    data = _text()
    n = int(0.9 * len(data))
    return Windows(data[:n], BLOCK // 2), Windows(data[n:], 4 * BLOCK)


def gpt() -> torch.nn.Module:
    """The model plug-in: a 3-layer GPT, 96 wide (0.35M parameters), no dropout."""
    return GPT(VOCAB, BLOCK, n_layer=3, n_head=4, n_embd=96, dropout=0.0)


def lm_loss(model, batch) -> torch.Tensor:
    """The loss plug-in: the model's own (next-character cross-entropy)."""
    return model(*batch)


PLUGINS = ["--model", f"{__file__}:gpt", "--dataset", f"{__file__}:chars", "--loss", f"{__file__}:lm_loss"]


# -- DDP, under hpcps emulate: the same model, batches, optimizer and emulated compute -----------------------
def _ddp(options: list[str], bucket_mb: float, budget: float, target: float) -> None:
    """One rank of DDP; rank 0 prints ``EVALS`` (seconds, validation loss) as JSON."""
    import torch.distributed as dist
    from mpi4py import MPI

    from benchlib import Replica, init_gloo
    from hpcps.training.optim import builtin_optimizer

    comm = MPI.COMM_WORLD
    replica = Replica(options, comm, DROPPED, target=target, budget=budget)
    cfg, model = replica.cfg, replica.model
    init_gloo(comm)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    optimizer = builtin_optimizer(cfg.optimizer, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)(
        list(model.parameters()))
    stop = False
    comm.Barrier()
    replica.start()
    for step in range(cfg.steps):
        if comm.rank == 0:
            stop = replica.evaluate_if_due()
        if comm.bcast(stop, root=0):
            break
        replica.step(step, ddp)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    if comm.rank == 0:
        print("EVALS " + json.dumps(replica.evals), flush=True)
    dist.destroy_process_group()


#: the options of bench_local's hpcps runs that a replica outside hpcps does not take
DROPPED = ("partition_mb", "servers", "paradigm", "eval_interval", "target", "local_steps")


# -- the invocation -----------------------------------------------------------------------------------------
def _box(nodes: int, ranks_per_node: int, link: str) -> list[str]:
    return [sys.executable, "-m", "hpcps", "emulate", "--nodes", str(nodes), "--ranks-per-node",
            str(ranks_per_node), "--link", link, "--"]


def _hpcps(a, seed: int, extra: list[str], out: Path) -> list[tuple[float, float]]:
    """An hpcps run in the box (a shard beside each worker); its evaluations (seconds, loss)."""
    import h5py

    from hpcps.cluster.launcher import clean_environ

    n = a.nodes
    slow = ["--slowdown", f"{2 * n - 1}={a.straggler:g}"] if a.straggler > 1 else []
    cmd = [*_box(n, 2, a.link), sys.executable, "-m", "hpcps", "train", *_common(a, seed), "--servers",
           str(n), "--eval-interval", str(a.eval_interval), "--target", f"loss<={a.target}", *slow, *extra,
           "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, env=clean_environ(), capture_output=True, text=True, timeout=a.budget * 4 + 600)
    if proc.returncode == 3:  # --divergence stop: the run diverged; its evaluations so far count
        print(f"  diverged: {' '.join(extra)}", file=sys.stderr, flush=True)
    elif proc.returncode != 0:
        raise SystemExit(f"{' '.join(extra)} failed:\n{proc.stderr[-3000:]}")
    with h5py.File(out) as f:
        ev = f["eval"][()]
    return [(float(t), float(loss)) for t, loss in zip(ev["t"], ev["loss"])]


def _run_ddp(a, seed: int) -> list[tuple[float, float]]:
    from hpcps.cluster.launcher import clean_environ

    options = [*_common(a, seed), "--straggler", str(a.straggler), "--eval-every-s", str(a.eval_interval)]
    cmd = [*_box(a.nodes, 1, a.link), sys.executable, os.path.abspath(__file__), "--inner-ddp",
           "--bucket-mb", str(a.bucket_mb), "--budget", str(a.budget), "--target", str(a.target), "--", *options]
    proc = subprocess.run(cmd, env=clean_environ(PYTHONPATH=str(Path(__file__).parent)), capture_output=True,
                          text=True, timeout=a.budget * 4 + 600)
    if proc.returncode != 0:
        raise SystemExit(f"DDP failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("EVALS "))
    return [tuple(e) for e in json.loads(line[len("EVALS "):])]


def _run_torchft(a, seed: int, h: int) -> list[tuple[float, float]]:
    """torchft's DiLoCo at H = ``h`` in the box, one replica group per node; its evaluations."""
    from hpcps.cluster.launcher import clean_environ

    options = [*_common(a, seed), "--straggler", str(a.straggler), "--eval-every-s", str(a.eval_interval)]
    replica = Path(__file__).resolve().parent / "peers" / "torchft_diloco.py"
    cmd = [*_box(a.nodes, 1, a.link), sys.executable, str(replica), "--local-steps", str(h), "--budget", str(a.budget),
           "--target", str(a.target), "--", *options]
    proc = subprocess.run(cmd, env=clean_environ(PYTHONPATH=str(Path(__file__).parent)), capture_output=True,
                          text=True, timeout=a.budget * 4 + 600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("EVALS ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"torchft DiLoCo failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    return [tuple(e) for e in json.loads(line[len("EVALS "):])]


def _common(a, seed: int) -> list[str]:
    """What every method shares: data, batch, emulated compute, AdamW's rate, the most steps."""
    return [*PLUGINS, "--seed", str(seed), "--batch-size", str(a.batch_size), "--steps", str(a.steps),
            "--optimizer", "adamw", "--lr", str(a.lr), "--compute-time", str(a.compute_time),
            "--compute-forward", "0.33", "--compute-backward", "0.67", "--threads", "1"]


def time_to(evals: list[tuple[float, float]], target: float) -> float:
    return next((t for t, loss in evals if loss <= target), math.nan)


def loss_at(evals: list[tuple[float, float]], budget: float) -> float:
    """The last validation loss measured by ``budget`` seconds (NaN: none)."""
    before = [loss for t, loss in evals if t <= budget]
    return before[-1] if before else math.nan


def main() -> None:
    from benchlib import fmt, torchft_version

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4, help="nodes, one worker each (default 4)")
    p.add_argument("--link", default="100mbit", help="every node's link (default 100mbit)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--straggler", type=float, default=1.0, metavar="F", help="the last worker F times slower")
    p.add_argument("--target", type=float, default=2.5, help="validation loss to reach (default 2.5)")
    p.add_argument("--budget", type=float, default=120.0,
                   help="seconds: the most DDP trains without reaching --target (hpcps's runs stop at --target "
                        "or after --steps; default 120)")
    p.add_argument("--loss-at", type=float, default=30.0, metavar="SECONDS",
                   help="the fixed wall time at which each method's validation loss is compared (default 30: "
                        "before the runs stop at --target)")
    p.add_argument("--steps", type=int, default=4000, help="the most batches per worker (default 4000)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's rate: bsp's, DDP's, the inner one's")
    p.add_argument("--compute-time", type=float, default=0.05, help="emulated seconds per batch (default 0.05)")
    p.add_argument("--eval-interval", type=float, default=2.0, help="seconds between evaluations (default 2)")
    p.add_argument("--local-steps", type=int, nargs="+", default=[8, 32], metavar="H")
    p.add_argument("--overlap-steps", type=int, nargs="*", default=[], metavar="T",
                   help="also diloco at each H with --overlap-steps T, each T less than H (method 'overlap')")
    p.add_argument("--partition-mb", type=float, default=0.25)
    p.add_argument("--bucket-mb", type=float, default=1.0, help="DDP's bucket_cap_mb (default 1)")
    p.add_argument("--shards-at-once", dest="fanin", type=int, nargs="*", default=[], metavar="K",
                   help="a bsp row more per K, with --shards-at-once K (method bsp-rotated)")
    p.add_argument("--methods", nargs="+",
                   help="only these (bsp, bsp-rotated, bsp-sent, ddp, diloco, overlap, async, bounded, "
                        "torchft-diloco; bsp-sent, bsp with --pull send, and torchft-diloco only when named)")
    p.add_argument("--inner-ddp", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("options", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.inner_ddp:
        _ddp(a.options, a.bucket_mb, a.budget, a.target)
        return
    outer = ["--inner-optimizer", "adamw", "--inner-lr", str(a.lr), "--optimizer", "sgd", "--lr", "0.7",
             "--momentum", "0.9", "--nesterov"]
    h0 = a.local_steps[0]
    methods = {f"bsp, --partition-mb {a.partition_mb:g}, --pull get": (
                   "bsp", ["--paradigm", "bsp", "--pull", "get", "--partition-mb", str(a.partition_mb)]),
               **{f"bsp, --partition-mb {a.partition_mb:g}, --shards-at-once {k}": (
                   "bsp-rotated", ["--paradigm", "bsp", "--partition-mb", str(a.partition_mb), "--shards-at-once", str(k)])
                  for k in a.fanin},
               f"bsp, --partition-mb {a.partition_mb:g}, --pull send": ("bsp-sent", [
                   "--paradigm", "bsp", "--partition-mb", str(a.partition_mb), "--pull", "send"]),
               f"DDP (gloo), {a.bucket_mb:g} MB buckets": ("ddp", None),
               **{f"diloco H={h}": ("diloco", ["--paradigm", "diloco", "--local-steps", str(h), *outer])
                  for h in a.local_steps},
               **{f"torchft {torchft_version()} DiLoCo H={h}": ("torchft-diloco", [str(h)]) for h in a.local_steps},
               **{f"diloco H={h}, --overlap-steps {t}": ("overlap", ["--paradigm", "diloco", "--local-steps", str(h),
                                                                     "--overlap-steps", str(t), *outer])
                  for h in a.local_steps for t in a.overlap_steps if t < h},
               f"asp H={h0} (free), Delayed Nesterov": ("async", ["--paradigm", "asp", "--local-steps", str(h0), *outer,
                                                                  "--momentum-period", str(a.nodes)]),
               f"ssp s=1 H={h0} (bounded), Delayed Nesterov": ("bounded", [
                   "--paradigm", "ssp", "--staleness", "1", "--local-steps", str(h0), *outer,
                   "--momentum-period", str(a.nodes)])}
    methods = {k: v for k, v in methods.items() if v[0] in a.methods} if a.methods else \
        {k: v for k, v in methods.items() if v[0] not in ("bsp-sent", "torchft-diloco")}  # (when asked for)
    results: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in methods}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            for name, (kind, extra) in methods.items():
                # (the options after the plug-ins win: --lr and --optimizer are the outer ones for local steps)
                evals = _run_ddp(a, seed) if kind == "ddp" else _run_torchft(a, seed, int(extra[0])) \
                    if kind == "torchft-diloco" else _hpcps(a, seed, extra, Path(tmp) / "run.h5")
                results[name].append(evals)
                print(f"seed {seed} {name}: {time_to(evals, a.target):.1f} s to loss {a.target}, "
                      f"loss {loss_at(evals, a.loss_at):.3f} at {a.loss_at:g} s", file=sys.stderr, flush=True)
    where = f"{a.nodes} nodes at {a.link}" + (f", the last worker {a.straggler:g}x slower" if a.straggler > 1 else "")
    print(f"{where}; seeds {a.seeds}; target validation loss {a.target}; loss compared at {a.loss_at:g} s; "
          f"compute {a.compute_time * 1e3:g} ms per batch of {a.batch_size}\n")
    times = {name: [time_to(e, a.target) for e in runs] for name, runs in results.items()}
    base = {kind: np.nanmean(times[name]) for name, (kind, _) in methods.items() if kind in ("bsp", "ddp")}
    print(f"| method | time to target s | vs bsp | vs DDP | loss at {a.loss_at:g} s |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        mean = np.nanmean(ts) if not all(math.isnan(t) for t in ts) else math.nan
        ratios = [f"{mean / base[k]:.2f}" if k in base and not math.isnan(mean) else "-" for k in ("bsp", "ddp")]
        losses = [loss_at(e, a.loss_at) for e in results[name]]
        print(f"| {name} | {fmt(ts, 1)} | {ratios[0]} | {ratios[1]} | {fmt(losses, 3)} |")


if __name__ == "__main__":
    main()
