#!/usr/bin/env python3
"""A bsp round's bytes in the parameter server's traffic patterns against a ring's, in a cluster in a box.

With a shard beside every worker (colocated), one bsp round sends out of every node, and into it,
``(N-1)/N`` of the model twice: the push (a slice to every other node's shard) and the pull (every other
shard's slice read). A ring all-reduce's two phases send the same bytes per node. What differs is the
pattern, and this measures what the pattern alone costs on the box's links, with nothing but MPI
(mpi4py) running, each pattern timed between barriers, ``--reps`` times, on N nodes with one rank each:

* ``ring``: the bytes to the next node, from the previous one (one flow each way per port: a ring
  all-reduce's step);
* ``fan``: a slice to every other node at once, one from each (the push: N-1 flows out and in per port);
* ``rotated``: the fan in N-1 phases, one peer each way per phase;
* ``get``: every other node's slice read at once with one-sided ``Rget`` under ``Lock_all`` (the pull;
  over TCP, MPICH carries it as active messages);
* ``get-rotated``: the reads one node at a time, each rank starting at another (``--shards-at-once 1``);
* ``get-pieces``: every slice read at once in 64 KB pieces (as partitioned pulls cut them);
* ``allreduce``: ``MPI_Allreduce`` of the model (twice the bytes: both phases), for reference.

Each row's "of line" is the seconds its bytes need at the link's rate over the median measured; "vs ring"
is its median over the ring's, from the same run:

    python tools/bench_patterns.py --nodes 4 --link 10mbit --mb 1.4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def _inner(a: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    r, n = comm.rank, comm.size
    k = int(a.mb * 1e6) // 4 // n  # one node's slice, float32 elements
    send, recv = np.ones(k * n, np.float32), np.empty(k * n, np.float32)
    win = MPI.Win.Allocate(k * 4, 4, comm=comm)
    win.Lock_all()

    def ring() -> None:
        MPI.Request.Waitall([comm.Irecv(recv[:k * (n - 1)], (r - 1) % n, 1),
                             comm.Isend(send[:k * (n - 1)], (r + 1) % n, 1)])

    def fan() -> None:
        requests = []
        for j in range(n):
            if j != r:
                requests += [comm.Irecv(recv[j * k:(j + 1) * k], j, 2), comm.Isend(send[j * k:(j + 1) * k], j, 2)]
        MPI.Request.Waitall(requests)

    def rotated() -> None:
        for j in range(1, n):
            to, frm = (r + j) % n, (r - j) % n
            MPI.Request.Waitall([comm.Irecv(recv[frm * k:(frm + 1) * k], frm, 3),
                                 comm.Isend(send[to * k:(to + 1) * k], to, 3)])

    def get() -> None:
        MPI.Request.Waitall([win.Rget(recv[j * k:(j + 1) * k], j) for j in range(n) if j != r])

    def get_rotated() -> None:
        for j in range(1, n):
            frm = (r - j) % n
            win.Rget(recv[frm * k:(frm + 1) * k], frm).Wait()

    def get_pieces() -> None:  # every slice read in pieces of 64 KB, all at once (as partitioned pulls do)
        step = 1 << 14
        MPI.Request.Waitall([win.Rget(recv[j * k + a:j * k + min(a + step, k)], j, (a, min(step, k - a), MPI.FLOAT))
                             for j in range(n) if j != r for a in range(0, k, step)])

    def allreduce() -> None:  # (into recv: summed in place, the values would grow n-fold per repetition)
        comm.Allreduce(send, recv, op=MPI.SUM)

    patterns = {"ring": ring, "fan": fan, "rotated": rotated, "get": get, "get-rotated": get_rotated,
                "get-pieces": get_pieces, "allreduce": allreduce}
    times: dict[str, list[float]] = {name: [] for name in patterns}
    for _ in range(a.reps):  # interleaved, so a slow spell of the machine falls on every pattern
        for name, move in patterns.items():
            comm.Barrier()
            t = time.perf_counter()
            move()
            comm.Barrier()
            times[name].append(time.perf_counter() - t)
    win.Unlock_all()
    win.Free()
    if r == 0:
        print("TIMES " + json.dumps({"n": n, "slice_bytes": 4 * k, "times": times}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4, help="nodes, one rank each (default 4)")
    p.add_argument("--link", default="10mbit", help="every node's link (default 10mbit)")
    p.add_argument("--buffer", default="512kb", help="the switch's queue per port (default 512kb)")
    p.add_argument("--mb", type=float, default=1.4, help="the model's size in MB (default 1.4)")
    p.add_argument("--reps", type=int, default=6, help="timings of each pattern (default 6)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.inner:
        return _inner(a)
    if a.nodes < 3:
        p.error("--nodes: at least 3 (with 2, the fan is the ring)")
    from hpcps.box.spec import parse_rate
    from hpcps.cluster.launcher import clean_environ

    cmd = [sys.executable, "-m", "hpcps", "emulate", "--nodes", str(a.nodes), "--link", a.link, "--buffer",
           a.buffer, "--", sys.executable, __file__, "--inner", "--mb", str(a.mb), "--reps", str(a.reps)]
    proc = subprocess.run(cmd, env=clean_environ(), capture_output=True, text=True, timeout=600 + 60 * a.reps)
    if proc.returncode != 0:
        raise SystemExit(f"the box's run failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TIMES "))
    got = json.loads(line[len("TIMES "):])
    n, out = got["n"], got["slice_bytes"] * (got["n"] - 1)  # bytes out of (and into) each node per phase
    line_s = 8 * out / parse_rate(a.link)
    medians = {name: statistics.median(t) for name, t in got["times"].items()}
    print(f"{n} nodes at {a.link} (switch buffer {a.buffer}), {out / 1e6:.3f} MB out of and into each node "
          f"per phase ({line_s:.3f} s at the link's rate), {a.reps} timings each, medians:\n")
    print("| pattern | median s | min-max s | of line | vs ring |")
    print("|---|---|---|---|---|")
    for name, t in got["times"].items():
        ideal = line_s * (2 if name == "allreduce" else 1)
        print(f"| {name} | {medians[name]:.3f} | {min(t):.3f}-{max(t):.3f} | {ideal / medians[name]:.2f} | "
              f"{medians[name] / medians['ring'] / (2 if name == 'allreduce' else 1):.2f} |")
    print(f"\nfan / ring: {medians['fan'] / medians['ring']:.2f}; get / ring: {medians['get'] / medians['ring']:.2f}"
          " (allreduce's vs ring: per phase)")


if __name__ == "__main__":
    main()
