"""torchft's replicas as the ranks of an MPI job, one replica group of one process per rank: where each
listens, the lighthouse, the Manager. Shared by ``tools/peers/torchft_diloco.py`` (bench_local's
``torchft-diloco``) and ``tools/bench_allreduce.py --torchft`` (torchft's DDP step). MPI only starts the
replicas together and stops them together; torchft's own traffic goes over gloo and its RPCs.

In a cluster in a box (``hpcps emulate``, ``HPCPS_NODE`` set) every replica listens at its node's address
and gloo takes the node's interface; torchft's Manager listens on ``[::]`` (the box's namespaces have IPv6)
and must be given a routable host name. On one machine everything is at 127.0.0.1, each store on a port of
its own. Needs torchft (``pip install '.[peers]'``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any, Callable

from benchlib import box_node, gloo_addresses, torchft_lighthouse  # (tools/ is on the path of both callers)

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


def start_lighthouse(comm) -> subprocess.Popen | None:
    """Collective: rank 0 starts torchft's lighthouse (every replica in each quorum, so a quorum is the whole
    job as a lock-step all-reduce's is) and waits until it listens; the process on rank 0, else None."""
    lighthouse = None
    if comm.rank == 0:
        head = gloo_addresses()[1]
        lighthouse = subprocess.Popen([torchft_lighthouse(), "--min_replicas", str(comm.size), "--quorum_tick_ms", "100",
                                       "--join_timeout_ms", "60000", "--bind", f"[::]:{LIGHTHOUSE_PORT}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_listening(head, LIGHTHOUSE_PORT)
    comm.Barrier()
    return lighthouse


def manager(comm, *, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], Any], timeout: float,
            use_async_quorum: bool = True) -> tuple[Any, Any, Any]:
    """This rank's torchft Manager over gloo, as a replica group of one process (``rank=0, world_size=1``)
    named ``replica<rank>``, with its own TCPStore and a PGTransport to heal from a peer; every replica is
    needed in a quorum. Returns (the manager, its process group, the store, which must outlive it)."""
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    me, head = gloo_addresses()
    port = STORE_PORT + (comm.rank if box_node() is None else 0)  # (one machine: every replica's store on one host)
    store = TCPStore(me, port, is_master=True, wait_for_workers=False)
    wait = timedelta(seconds=timeout)
    pg = ProcessGroupGloo(timeout=wait)
    made = Manager(pg=pg, min_replica_size=comm.size, use_async_quorum=use_async_quorum,
                   load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica{comm.rank}",
                   store_addr=me, store_port=port, rank=0, world_size=1, hostname=me,
                   lighthouse_addr=f"http://{head}:{LIGHTHOUSE_PORT}", timeout=wait,
                   checkpoint_transport=PGTransport(pg, timeout=wait, device=torch.device("cpu")))
    return made, pg, store


def leave(comm, made, lighthouse: subprocess.Popen | None) -> None:
    """Collective: every replica done, the manager shut, the lighthouse killed, ``MPI_Finalize`` (the launcher
    counts a rank that leaves without it as failed), then out at once: torchft's threads and the store's
    server would hold the process."""
    from mpi4py import MPI

    comm.Barrier()
    made.shutdown(wait=False)
    if lighthouse is not None:
        lighthouse.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(0)


def run_main(main: Callable[[], None]) -> None:
    """``main()``, its error printed and the process ended here: hpcps's exception hook would ``MPI_Abort``,
    which blocked in the box under Open MPI once."""
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
