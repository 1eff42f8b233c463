#!/usr/bin/env python3
"""Parameter-server training on one GPU shared by N workers against DDP on the same GPU and data.

For each ``--models`` (ResNet-18, ResNet-50 on synthetic CIFAR-shaped data by default), measured in one
invocation:

* ``hpcps <paradigm>`` for each ``--paradigms``, each ``--servers`` count and each ``--server-devices``:
  ``hpcps train --device cuda`` on that many shards + N workers, every worker on ``cuda:0``, the shards'
  slices in host memory (``host``, stepped on the CPU) or on the GPU (``cuda``, ``--server-device``);
* ``DDP (nccl) 1 rank``: ``DistributedDataParallel`` over NCCL on one rank whose batch is the N workers'
  batches together: one GPU trained as well as PyTorch does it, the ceiling for N workers sharing it;
* ``DDP (nccl) N ranks``: N ranks on the one GPU. NCCL refuses two ranks on one device; the row then
  says so instead of a number;
* ``DDP (gloo) N ranks``: N ranks on the one GPU, gradients all-reduced by gloo through host memory:
  the data-parallel peer of N PS workers on one GPU.

Per row: samples per second over the steps after ``--warmup`` (all ranks together; a DDP step is N
batches, an hpcps iteration one), the ratio to ``DDP (nccl) 1 rank``, and for hpcps the share of a
worker's iteration spent moving parameters and gradients (push + the pull it waited for, with the staging
copies) and blocked on the paradigm (wait).

    python tools/bench_gpu.py                                   # resnet18 resnet50 x bsp asp eager, 4 workers
    python tools/bench_gpu.py --models resnet18 --steps 60 --batch-size 64
    python tools/bench_gpu.py --servers 1 4 --server-devices host cuda   # host against device shards
    python tools/bench_gpu.py --device cpu --models mlp --dataset digits   # the same on the CPU (gloo only)
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchlib import data_parallel_replica, launch_argv, train


def _inner(kind: str, a: argparse.Namespace) -> None:
    """Under mpiexec -n R: DDP over ``kind`` (nccl, gloo); rank 0 prints samples per second after the warm-up."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from hpcps.options.config import make_config
    from hpcps.data.batches import to_device

    comm = MPI.COMM_WORLD
    cfg = make_config({"model": a.model, "dataset": a.dataset, "batch_size": a.batch, "seed": 0, "lr": 0.05})
    workload, model, batches = data_parallel_replica(cfg, comm, a.steps)
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # NCCL's eager start wants the index
    model.to(device)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(comm.bcast(29500 + os.getpid() % 1000 if comm.rank == 0 else None))
    try:
        dist.init_process_group(kind, rank=comm.rank, world_size=comm.size,
                                device_id=device if kind == "nccl" else None)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr)
        comm.Barrier()
        t0 = None
        for step in range(a.steps):
            if step == a.warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                comm.Barrier()
                t0 = time.perf_counter()
            batch = to_device(batches.batch(step), device)
            opt.zero_grad(set_to_none=False)
            workload.loss(ddp, batch).backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        comm.Barrier()
        seconds = time.perf_counter() - t0
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - NCCL's refusal of two ranks on one GPU is a result to print
        if comm.rank == 0:
            print(f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", flush=True)
        os._exit(0)  # a half-made process group can hang at exit
    if comm.rank == 0:
        print(f"SAMPLES_PER_S {(a.steps - a.warmup) * a.batch * comm.size / seconds}")


def _ddp(kind: str, ranks: int, batch: int, a: argparse.Namespace, model: str) -> tuple[float | None, str]:
    """Samples per second of DDP over ``kind`` on ``ranks`` ranks (None and the reason where it failed)."""
    from hpcps.cluster.launcher import clean_environ
    cmd = launch_argv(ranks, [sys.executable, os.path.abspath(__file__), "--inner", kind, "--model", model,
                              "--dataset", a.dataset, "--batch", str(batch), "--steps", str(a.steps),
                              "--warmup", str(a.warmup), "--device", a.device])
    proc = subprocess.run(cmd, env=clean_environ(), capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("SAMPLES_PER_S"):
            return float(line.split()[1]), ""
        if line.startswith("FAILED"):
            return None, line[len("FAILED "):]
    return None, f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:160]}"


def _hpcps(paradigm: str, a: argparse.Namespace, model: str, out: Path, servers: int,
           server_device: str) -> dict[str, float]:
    """Samples per second of an hpcps run, and the shares of a worker's iteration in transfers and waits."""
    try:  # (random labels: the loss need not fall, so the divergence guard stays off)
        t = train(servers + a.workers, out, ["--paradigm", paradigm, "--servers", str(servers), "--model", model,
                                       "--server-device", server_device, "--dataset", a.dataset,
                                       "--batch-size", str(a.batch_size), "--steps", str(a.steps),
                                       "--device", a.device, "--eval-interval", "1e9", "--lr", "0.05",
                                       "--divergence", "ignore", *a.train_args], timeout=600)
    except subprocess.CalledProcessError as e:
        return {"failed": f"exit {e.returncode}: {(e.stderr or b'').decode(errors='replace').strip()[-160:]}"}
    it = t["it"]
    if int(t["summary"]["gradients_applied"]) + int(t["summary"]["gradients_dropped"]) != len(it):
        raise SystemExit(f"hpcps {paradigm}: gradients lost: {len(it)} pushed, {t['summary']}")
    late = it[it["step"] >= a.warmup]
    seconds = float(late["t_end"].max() - late["t_start"].min())
    span = late["t_end"] - late["t_start"]
    return {"samples_per_s": len(late) * a.batch_size / seconds,
            "transfer": float(np.sum(late["push_s"] + late["pull_wait_s"]) / np.sum(span)),
            "wait": float(np.sum(late["wait_s"]) / np.sum(span))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["resnet18", "resnet50"])
    p.add_argument("--paradigms", nargs="+", default=["bsp", "asp", "eager"])
    p.add_argument("--gloo-models", nargs="*", help="the models DDP over gloo runs for (default: every one)")
    p.add_argument("--dataset", default="synthetic:3x32x32:10:8192", help="default: synthetic CIFAR-shaped data")
    p.add_argument("--workers", type=int, default=4, help="N workers / DDP ranks (default 4)")
    p.add_argument("--servers", type=int, nargs="+", default=[1], help="server shards of the hpcps runs (default 1)")
    p.add_argument("--server-devices", nargs="+", choices=["host", "cpu", "cuda"],
                   help="where the shards step their slices, a row each (default: host and, on a GPU, cuda)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    p.add_argument("--steps", type=int, default=40, help="iterations per worker (default 40)")
    p.add_argument("--warmup", type=int, default=10, help="first iterations left out of the rates (default 10)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--inner", choices=["nccl", "gloo"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("train_args", nargs="*", help="after --: more hpcps train options")
    a = p.parse_args()
    if a.inner:
        _inner(a.inner, a)
        return 0
    n = a.workers
    gpu = a.device.startswith("cuda")
    server_devices = a.server_devices or (["host", "cuda"] if gpu else ["host"])
    name = ""
    if gpu:
        import torch
        name = f" on {torch.cuda.get_device_name(0)}"
    print(f"{n} workers{name}, batch {a.batch_size} per worker, {a.steps} steps ({a.warmup} warm-up), "
          f"data {a.dataset}\n", flush=True)
    print("| model | method | ranks | samples/s | vs DDP 1 rank | transfer share | wait share |")
    print("|---|---|---|---|---|---|---|", flush=True)
    refused = False
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models:
            one = ("DDP (nccl) 1 rank", "nccl", 1, n * a.batch_size) if gpu else \
                ("DDP (gloo) 1 rank", "gloo", 1, n * a.batch_size)
            ddp = [one, *([(f"DDP (nccl) {n} ranks", "nccl", n, a.batch_size)] if gpu else []),
                   (f"DDP (gloo) {n} ranks", "gloo", n, a.batch_size)]
            base = None
            for label, kind, ranks, batch in ddp:
                if kind == "gloo" and a.gloo_models is not None and model not in a.gloo_models:
                    continue
                if kind == "nccl" and ranks > 1 and refused:  # NCCL's answer does not depend on the model
                    print(f"| {model} | {label} | {ranks} | failed, as above | | | |", flush=True)
                    continue
                rate, why = _ddp(kind, ranks, batch, a, model)
                refused = refused or (kind == "nccl" and ranks > 1 and rate is None)
                base = rate if base is None else base
                shown = f"{rate:.0f} | {rate / base:.2f}" if rate and base else f"failed: {why} | "
                print(f"| {model} | {label} | {ranks} | {shown} | | |", flush=True)
            for paradigm, servers, where in itertools.product(a.paradigms, a.servers, server_devices):
                r = _hpcps(paradigm, a, model, Path(tmp) / f"{model}-{paradigm}-{servers}-{where}.h5", servers, where)
                label = f"hpcps {paradigm}, {servers} shard{'s' if servers > 1 else ''} " + \
                    ("in host memory" if where == "host" else f"on {where}")
                if "failed" in r:
                    print(f"| {model} | {label} | {servers + n} | failed: {r['failed']} | | | |", flush=True)
                    continue
                vs = f"{r['samples_per_s'] / base:.2f}" if base else ""
                print(f"| {model} | {label} | {servers + n} | {r['samples_per_s']:.0f} | {vs} "
                      f"| {r['transfer']:.2f} | {r['wait']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
