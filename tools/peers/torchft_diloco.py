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
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


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
    from hpcps.training.optim import builtin_optimizer
    from torchft.local_sgd import DiLoCo
    from torchft_box import leave, manager, start_lighthouse

    comm = MPI.COMM_WORLD
    replica = Replica(a.options, comm, DROPPED, target=a.target, budget=a.budget)
    cfg, model = replica.cfg, replica.model
    lighthouse = start_lighthouse(comm)
    inner = builtin_optimizer(cfg.optimizer, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)(
        list(model.parameters()))
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    made, _pg, _store = manager(comm, state_dict=lambda: {"model": model.state_dict()},
                                load_state_dict=lambda sd: model.load_state_dict(sd["model"]), timeout=a.timeout,
                                use_async_quorum=False)
    stop = False
    comm.Barrier()
    replica.start()
    with DiLoCo(made, [model], inner, outer, sync_every=a.local_steps):
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
    leave(comm, made, lighthouse)


if __name__ == "__main__":
    from torchft_box import run_main

    run_main(main)
