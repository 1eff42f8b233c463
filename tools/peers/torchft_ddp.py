#!/usr/bin/env python3
"""One torchft replica group of one process, for ``tools/bench_peers.py``: torchft's fault-tolerant DDP
(gloo on the CPU) on hpcps's default workload (``mlp`` on ``digits``), with the step padded to
``--compute-time`` as ``hpcps train --compute-time`` pads its own. Needs torchft (``pip install torchft``)
and a lighthouse (``torchft_lighthouse``) at ``TORCHFT_LIGHTHOUSE``.

It writes one JSON line per event to ``--log`` (wall-clock seconds, ``time.time()``): ``launch`` (the
process's first line), ``ready`` (its Manager built), ``step`` (after each ``optimizer.step()``: torchft's
global step, whether it committed, the replicas in the quorum, the loss), ``kill`` (just before it SIGKILLs
itself, ``--kill-at STEP --kill-in allreduce|between``: inside its gradient's all-reduce, or after a
committed step) and ``end`` (with the held-out loss and accuracy).

``--fixed-hook`` replaces torchft 0.2.0's DDP comm hook by one that survives a peer's death during the
all-reduce: the shipped hook asserts ``fut._fut`` after ``_ManagedWork.wait()`` has reported the error and
left the future unset, which crashes the healthy replica too; the fixed one returns the bucket unreduced
(the manager has recorded the error, so the step does not commit).
"""

from __future__ import annotations

import time

LAUNCHED = time.time()

import argparse  # noqa: E402 (the launch time first: what follows is the start-up a replacement pays)
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replica", type=int, required=True, help="this replica group's index")
    p.add_argument("--replicas", type=int, default=4, help="replica groups of the job (its data shards)")
    p.add_argument("--steps", type=int, default=200, help="torchft's global steps to commit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compute-time", type=float, default=0.02, help="seconds a step's passes take at least")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--store-port", type=int, required=True, help="this replica group's own TCPStore port")
    p.add_argument("--address", default="127.0.0.1", help="the address other replicas reach this one at")
    p.add_argument("--log", required=True, help="JSON lines, appended")
    p.add_argument("--kill-at", type=int, help="SIGKILL itself at this global step")
    p.add_argument("--kill-in", choices=("allreduce", "between"), default="between")
    p.add_argument("--fixed-hook", action="store_true", help="a comm hook that survives a peer's death")
    p.add_argument("--timeout", type=float, default=10.0, help="torchft's timeout for collectives, seconds")
    p.add_argument("--go", help="once ready, wait until this file exists (every replica starts together)")
    args = p.parse_args()
    log = open(args.log, "a", buffering=1)

    def event(name: str, **fields) -> None:
        log.write(json.dumps({"event": name, "replica": args.replica, "t": time.time(), **fields}) + "\n")

    event("launch", t_launch=LAUNCHED)
    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from hpcps.data.loaders import load_dataset
    from hpcps.training.models import build_model

    data = load_dataset("digits")
    x = torch.as_tensor(data.x_train, dtype=torch.float32)[args.replica::args.replicas]
    y = torch.as_tensor(data.y_train, dtype=torch.long)[args.replica::args.replicas]
    model = build_model("mlp", tuple(data.x_train.shape[1:]), data.n_classes, seed=args.seed)

    store = TCPStore(args.address, args.store_port, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    transport = PGTransport(pg, timeout=timedelta(seconds=args.timeout), device=torch.device("cpu"))
    optim = torch.optim.SGD(model.parameters(), lr=args.lr)
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                                                             optim.load_state_dict(sd["optim"])),
                      state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
                      replica_id=f"replica{args.replica}", store_addr=args.address, store_port=args.store_port,
                      rank=0, world_size=1, hostname=args.address, timeout=timedelta(seconds=args.timeout),
                      checkpoint_transport=transport)
    HOOK["fixed"] = args.fixed_hook
    ddp = replica_ddp()(manager, model)
    optimizer = Optimizer(manager, optim)
    event("ready")
    while args.go and not os.path.exists(args.go):
        time.sleep(0.01)
    generator = torch.Generator().manual_seed(args.seed * 1000 + args.replica)
    order, at = torch.randperm(len(x), generator=generator), 0
    while manager.current_step() < args.steps:
        started = time.perf_counter()
        if args.kill_at == manager.current_step() and args.kill_in == "allreduce":
            HOOK["die"] = lambda: (event("kill"), os.kill(os.getpid(), signal.SIGKILL))
        optimizer.zero_grad()  # (torchft's quorum for this step begins)
        if at + args.batch_size > len(order):
            order, at = torch.randperm(len(x), generator=generator), 0
        batch = order[at:at + args.batch_size]
        at += args.batch_size
        loss = F.cross_entropy(ddp(x[batch]), y[batch])
        loss.backward()  # (its all-reduce waited for the quorum: a healed replica is at its peers' step now)
        step = manager.current_step()
        pad = args.compute_time - (time.perf_counter() - started)
        if pad > 0:
            time.sleep(pad)
        optimizer.step()
        committed = manager.current_step() > step
        event("step", step=step, committed=committed, participants=manager.num_participants(),
              loss=float(loss))
        if args.kill_at == step and args.kill_in == "between" and committed:
            event("kill")
            os.kill(os.getpid(), signal.SIGKILL)
    with torch.no_grad():
        out = model(torch.as_tensor(data.x_test, dtype=torch.float32))
        labels = torch.as_tensor(data.y_test, dtype=torch.long)
        event("end", step=manager.current_step(), test_loss=float(F.cross_entropy(out, labels)),
              accuracy=float((out.argmax(1) == labels).float().mean()))
    manager.shutdown(wait=False)
    del store  # (its server ends with the process)
    log.close()
    os._exit(0)  # (torchft's threads and the store's server would hold the process)


#: what the comm hook does besides torchft's: SIGKILL this process first (a callable, armed for one step),
#: and survive a peer's death (``--fixed-hook``)
HOOK: dict = {"die": None, "fixed": False}


def replica_ddp():
    """torchft's DistributedDataParallel with :func:`comm_hook` (DDP takes one comm hook, registered by
    torchft's constructor: a subclass's static ``_comm_hook`` is the one it registers)."""
    from torchft import DistributedDataParallel

    class ReplicaDDP(DistributedDataParallel):
        _comm_hook = staticmethod(comm_hook)
    return ReplicaDDP


def comm_hook(state, bucket):
    """torchft 0.2.0's DDP hook (``DistributedDataParallel._comm_hook``), line for line, with :data:`HOOK`'s kill where one is
    armed: once this replica's all-reduce has begun (its quorum formed, its peers in the same collective).
    With ``--fixed-hook``, less its assertion: where the all-reduce failed (a peer died) the manager holds
    the error and the step will not commit, so the bucket goes back as it is."""
    work = state.allreduce(bucket.buffer())
    if HOOK["die"] is not None:
        HOOK["die"]()
    work.wait()
    fut = work.get_future()
    if HOOK["fixed"] and getattr(fut, "_fut", None) is None:
        import torch
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    assert fut._fut  # (torchft's own: where a peer died, wait() reported it and left the future unset)
    return fut._fut


if __name__ == "__main__":
    main()
