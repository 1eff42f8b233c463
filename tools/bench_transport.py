#!/usr/bin/env python3
"""Push and pull through hpcps against raw mpi4py, on the same two ranks, in one run.

Rank 0 is a server shard, rank 1 a worker. For each size, both measure:

* push: ``R`` gradients of that size, one after the other (the next starts
  when the previous has left), through hpcps (``Pusher`` -> ``PushInbox``:
  header + payload, the shard releasing each) and through raw
  ``Send``/``Recv`` of the payload alone;
* pull: ``R`` pulls through hpcps (``ParamWindow.pull``, the protocol the
  run would use) and through a raw ``Lock``/``Get``/``Unlock`` of a plain
  window of the same size.

With ``--device cuda`` (or ``--transfer staged|direct`` on the CPU, to
see what the copies cost without a GPU) the worker's vectors live where a
GPU worker's do: hpcps's push includes staging the gradient
(``FlatParameters.stage_grads``) and its pull the upload to the device.
On the CPU the raw baselines still move host memory, so the ratio is the
whole price of the staged path against MPI at its best; on a GPU they move
the device's memory as a hand-written transfer would (one blocking copy to
pinned host memory, then ``Send``; ``Get`` into pinned memory, then one
copy up), so the ratio is hpcps's own price. ``--pipeline-mb C`` (GPU)
also times that raw push in chunks of C MiB, the copy of chunk k+1
overlapping the send of chunk k.

Times are the worker's, the median over repetitions that alternate hpcps
and raw. Printed per size: GB/s of each and ``raw time / hpcps time`` for
push, pull and push+pull; the last line is ``ratio vs raw: X.XX``, the worst
push+pull ratio at 16 MiB and above (1.00: as fast as raw MPI).

    python tools/bench_transport.py                 # starts mpiexec -n 2 itself
    python tools/bench_transport.py --device cuda   # worker on cuda:0, staged unless --transfer direct
    mpiexec -n 2 python tools/bench_transport.py    # or under your own launcher
    hpcps emulate --nodes 2 --link 1gbit -- python tools/bench_transport.py   # over a shaped TCP link

In a box (``hpcps emulate``) it also prints how close push and pull come to the link's rate.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

MIB = 1 << 20


def _relaunch(argv: list[str]) -> int:
    from hpcps.cluster.launcher import clean_environ, find_mpiexec
    # python -m mpi4py: an exception on one rank aborts both, instead of leaving the other waiting
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", os.path.abspath(__file__), *argv]
    return subprocess.run(cmd, env=clean_environ()).returncode


def _timed_pair(comm, fns, reps: int) -> list[float]:
    from hpcps.transport.poll import polite_barrier

    """Median seconds of each of ``fns`` on the worker (rank 1), run alternately ``reps`` times.

    Alternating the hpcps call and its raw twin exposes both to the same
    background noise; the median drops the outliers a shared 2-core box has.
    """
    times = [[] for _ in fns]
    comm.Barrier()
    for _ in range(reps):
        for k, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    polite_barrier(comm)  # the shard waits as a run's shard does, sleeping between polls, not spinning
    return [float(np.median(ts)) for ts in times]


def _worker_vectors(n: int, device: str, transfer: str | None):
    """A worker's flat parameters and gradient of ``n`` floats on ``device``, moved as ``transfer`` says."""
    import torch

    from hpcps.training.flat import FlatParameters

    class Vector(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(n))

    flat = FlatParameters(Vector(), device, transfer)
    flat.grads_t.fill_(1.0)
    return flat


def measure(comm, nbytes: int, reps: int, device: str = "cpu", transfer: str | None = None,
            pipeline_bytes: int = 0) -> dict[str, float]:
    from mpi4py import MPI

    from hpcps.transport.push import Pusher, PushInbox
    from hpcps.transport.window import ParamWindow

    n = nbytes // 4
    pipeline = pipeline_bytes // 4
    server = comm.rank == 0
    grad = np.ones(n, np.float32)
    out = np.empty(n, np.float32)
    bounds = [(0, n)]
    flat = None if server else _worker_vectors(n, device, transfer)

    # hpcps push: persistent header + payload sends; the shard receives into its buffer as the header comes
    pusher = None if server else Pusher(comm, buffers=[flat.push_grads], shard_ranks=[0], bounds=bounds,
                                        worker_rank=1)
    inbox = PushInbox(comm, worker_ranks=[1], shard_len=n) if server else None
    versions = np.zeros(1, np.int64)
    clock = [0]

    def hpcps_push():
        if server:
            while not inbox.poll():
                pass
            inbox.release(0)
        else:
            clock[0] += 1
            flat.stage_grads()
            pusher.start(clock[0], versions, 0.1)
            while not pusher.test():
                pass

    # on a GPU the raw twins move the worker's device memory too: one blocking copy to (from) pinned host
    # memory, then the plain MPI call, the least a hand-written staged transfer does
    on_gpu = flat is not None and flat.device.type == "cuda"
    if on_gpu:
        import torch
        pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
        grad = pinned.numpy()
    chunks = [(lo, min(lo + pipeline, n)) for lo in range(0, n, pipeline)] if pipeline else []

    def raw_push():
        if server:
            comm.Recv(out, source=1, tag=77)
        else:
            if on_gpu:
                pinned.copy_(flat.grads_t)  # device to pinned host memory: returns when done
            comm.Send(grad, dest=0, tag=77)

    def pipelined_push():
        """The raw push in chunks: chunk k+1 is copied to the host while chunk k is sent."""
        if server:
            MPI.Request.Waitall([comm.Irecv(out[lo:hi], source=1, tag=78) for lo, hi in chunks])
            return
        import torch
        stream = torch.cuda.current_stream(flat.device)
        done = []
        for lo, hi in chunks:
            pinned[lo:hi].copy_(flat.grads_t[lo:hi], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            done.append(event)
        requests = []
        for (lo, hi), event in zip(chunks, done):
            event.synchronize()
            requests.append(comm.Isend(grad[lo:hi], dest=0, tag=78))
        MPI.Request.Waitall(requests)

    # pulls: the run's window protocol, and a plain window with a shared lock around each Get
    window = ParamWindow(comm, shard_ranks=[0], bounds=bounds, local_len=n if server else 0)
    raw_win = MPI.Win.Allocate(nbytes if server else 0, 1, comm=comm)
    if server:
        window.publish(grad, 1)
        np.frombuffer(raw_win.tomemory(), np.float32)[:] = 1.0
    comm.Barrier()

    def hpcps_pull():
        if not server:
            window.pull(flat.params)
            flat.upload()
            flat.synchronize()

    def raw_pull():
        if not server:
            raw_win.Lock(0, MPI.LOCK_SHARED)
            raw_win.Get(grad if on_gpu else out, 0)
            raw_win.Unlock(0)
            if on_gpu:
                flat.params_t.copy_(pinned)
                flat.synchronize()

    pushes = (("push", "push_raw", "push_pipelined"), (hpcps_push, raw_push, pipelined_push)) if chunks else \
        (("push", "push_raw"), (hpcps_push, raw_push))
    results = {}
    for names, fns in (pushes, (("pull", "pull_raw"), (hpcps_pull, raw_pull))):
        for fn in fns:
            fn()  # warm: first-touch, lazy connection set-up
        results.update(zip(names, _timed_pair(comm, fns, reps)))
    raw_win.Free()
    window.free()
    if inbox is not None:
        inbox.free()
    if pusher is not None:
        pusher.free()
    results["protocol"] = window.protocol
    if flat is not None:
        results["transfer"] = f"worker on {flat.device}, transfer {flat.transfer}"
    return results


def _device_name(device: str) -> str:
    import torch

    return f" ({torch.cuda.get_device_name(torch.device(device))})" if device.startswith("cuda") else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64], help="MiB (default 1 16 64)")
    p.add_argument("--reps", type=int, default=50, help="repetitions per measurement (default 50)")
    p.add_argument("--device", default="cpu", help="the worker's device: cpu (default), cuda or cuda:N")
    p.add_argument("--transfer", choices=["shared", "staged", "direct"],
                   help="how the worker's tensors reach MPI (default: shared on the CPU, staged on a GPU; "
                        "direct needs a CUDA-aware MPI on a GPU)")
    p.add_argument("--pipeline-mb", type=float, default=0.0,
                   help="on a GPU, also time the raw push in chunks of this many MiB, chunk k+1 copied to the host "
                        "while chunk k is sent (printed as the pipelined push's speed-up over the raw one)")
    a = p.parse_args()
    from hpcps.box import cluster_record  # hpcps before MPI starts: its Open MPI settings (docs/internals.md)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.size == 1:
        return _relaunch(sys.argv[1:])
    if comm.size != 2:
        if comm.rank == 0:
            print("bench_transport: run on exactly 2 ranks", file=sys.stderr)
        return 2
    rows, worst = [], None
    for mib in a.sizes:
        sub = comm.Dup()  # a communicator per size: nothing of one size can meet the next
        pipeline = int(a.pipeline_mb * MIB) if a.device.startswith("cuda") else 0
        r = sub.bcast(measure(sub, mib * MIB, a.reps, a.device, a.transfer, pipeline), root=1)  # the worker's timings
        sub.Free()
        both = (r["push_raw"] + r["pull_raw"]) / (r["push"] + r["pull"])
        if mib >= 16:
            worst = both if worst is None else min(worst, both)
        rows.append((mib, r, both))
    if comm.rank == 0:
        print(f"2 ranks (server shard + worker), median of {a.reps} repetitions, window protocol "
              f"{rows[0][1]['protocol']}, {rows[0][1]['transfer']}{_device_name(a.device)}\n")
        print("| MiB | push GB/s hpcps | push GB/s raw | push ratio | pull GB/s hpcps | pull GB/s raw | pull ratio "
              "| push+pull ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for mib, r, both in rows:
            gbs = lambda s: mib * MIB / s / 1e9  # noqa: E731
            print(f"| {mib} | {gbs(r['push']):.2f} | {gbs(r['push_raw']):.2f} | {r['push_raw'] / r['push']:.2f} "
                  f"| {gbs(r['pull']):.2f} | {gbs(r['pull_raw']):.2f} | {r['pull_raw'] / r['pull']:.2f} | {both:.2f} |")
        cluster = cluster_record()
        if cluster and worst is not None:  # in a box: how close each moves to the links' rate
            rate = min(cluster["link_bps"][cluster["node_of_rank"][r]] for r in (0, 1)) / 8
            mib, r, _ = next(row for row in rows if row[0] >= 16)
            print(f"\nat {mib} MiB, of the link's rate ({rate / 1e9:.3f} GB/s): push "
                  f"{mib * MIB / r['push'] / rate:.2f}, pull {mib * MIB / r['pull'] / rate:.2f}")
        if any("push_pipelined" in r for _, r, _ in rows):
            print(f"\nraw push pipelined in {a.pipeline_mb:g} MiB chunks, speed-up over the raw push "
                  "(copy, then send): "
                  + ", ".join(f"{mib} MiB {r['push_raw'] / r['push_pipelined']:.2f}" for mib, r, _ in rows))
        if worst is not None:
            print(f"\nratio vs raw: {worst:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
