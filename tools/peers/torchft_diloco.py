#!/usr/bin/env python3
"""One torchft replica group of one process training with torchft's DiLoCo, for ``tools/bench_local.py``
(method ``torchft-diloco``): the workload, batches, emulated compute and evaluation of bench_local's DDP
rows, on the box's links. Launched as the ranks of ``hpcps emulate`` (one per node), which gives each its
node; MPI serves only to start them together and to stop them together. Needs torchft (``pip install
'.[peers]'``).

Replica 0 starts torchft's lighthouse in its node (``--min_replicas`` = every replica, so each round's
quorum is all of them, as DiLoCo's lock-step rounds are); every replica is a replica group of one process
with its own store, reached at its node's address, gloo on the node's interface. Inside, AdamW at
``--lr`` (the inner optimizer); every ``--local-steps`` batches torchft's DiLoCo averages the
pseudo-gradients over the quorum and steps the outer Nesterov sgd (0.7, 0.9), as hpcps's ``diloco`` does.
Replica 0 evaluates the synchronized model after a round once ``--eval-every-s`` seconds have passed (its
clock stopped while it evaluates, as for DDP) and prints ``EVALS`` (seconds, validation loss) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LIGHTHOUSE_PORT, STORE_PORT = 29510, 29520


def _wait_listening(host: str, port: int, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local-steps", type=int, required=True, help="inner steps between two outer steps (H)")
    p.add_argument("--budget", type=float, required=True, help="seconds: the most it trains without the target")
    p.add_argument("--target", type=float, required=True, help="validation loss at which every replica stops")
    p.add_argument("--timeout", type=float, default=60.0, help="torchft's timeout for collectives, seconds")
    p.add_argument("options", nargs="*", help="bench_local's hpcps train options (the workload, its compute)")
    a = p.parse_args()

    from mpi4py import MPI

    from bench_local import DROPPED
    from benchlib import Replica
    from hpcps.box.spec import NODE_IFACE, Cluster
    from hpcps.training.optim import builtin_optimizer

    comm = MPI.COMM_WORLD
    replica = Replica(a.options, comm, DROPPED, target=a.target, budget=a.budget)
    cfg, model = replica.cfg, replica.model
    boxed = os.environ.get("HPCPS_NODE") is not None
    me = Cluster.address(int(os.environ["HPCPS_NODE"])) if boxed else "127.0.0.1"
    head = Cluster.address(0) if boxed else "127.0.0.1"
    if boxed:
        os.environ["GLOO_SOCKET_IFNAME"] = NODE_IFACE
    lighthouse = None
    if comm.rank == 0:
        binary = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) or "torchft_lighthouse"
        lighthouse = subprocess.Popen([binary, "--min_replicas", str(comm.size), "--quorum_tick_ms", "100",
                                       "--join_timeout_ms", "60000", "--bind", f"[::]:{LIGHTHOUSE_PORT}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_listening(head, LIGHTHOUSE_PORT)
    comm.Barrier()

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.local_sgd import DiLoCo

    port = STORE_PORT + (comm.rank if not boxed else 0)  # (one machine: every replica's store on one host)
    store = TCPStore(me, port, is_master=True, wait_for_workers=False)
    inner = builtin_optimizer(cfg.optimizer, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)(
        list(model.parameters()))
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=a.timeout))
    manager = Manager(pg=pg, min_replica_size=comm.size, use_async_quorum=False,
                      load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
                      state_dict=lambda: {"model": model.state_dict()}, replica_id=f"replica{comm.rank}",
                      store_addr=me, store_port=port, rank=0, world_size=1, hostname=me,
                      lighthouse_addr=f"http://{head}:{LIGHTHOUSE_PORT}", timeout=timedelta(seconds=a.timeout),
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=a.timeout),
                                                       device=torch.device("cpu")))
    stop = False
    comm.Barrier()
    replica.start()
    with DiLoCo(manager, [model], inner, outer, sync_every=a.local_steps):
        for step in range(cfg.steps):
            if step % a.local_steps == 0:  # a round's start: the model is the synchronized one
                if comm.rank == 0:
                    stop = replica.evaluate_if_due()
                if comm.bcast(stop, root=0):
                    break
            replica.step(step)
            inner.step()  # (every H-th: DiLoCo's outer step, over the quorum, in its hook)
            inner.zero_grad(set_to_none=False)
    if comm.rank == 0:
        print("EVALS " + json.dumps(replica.evals), flush=True)
    comm.Barrier()
    manager.shutdown(wait=False)
    del store
    if lighthouse is not None:
        lighthouse.kill()
    sys.stdout.flush()
    MPI.Finalize()  # (the launcher counts a rank that leaves without it as failed)
    os._exit(0)  # (torchft's threads and the store's server would hold the process)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # said and ended here: hpcps's hook would MPI_Abort, which blocked in the box once
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
