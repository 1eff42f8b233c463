"""``ps.optimizer.state_dict()`` and ``load_state_dict()``: a worker asks the server shards for their
optimizer state, or hands them one (the MPI side; the layouts are :mod:`hpcps.training.optstate`).

Each shard serves requests between two updates (a side task of its loop, :class:`StateDesk`), so the state it
answers with is that of one version, the one it had published when the request came: under bsp, the
version the asking worker's last ``ps.step()`` brought in, on every shard. Messages travel on the PS
communicator::

    tag STATE        worker -> shard   ("get",) or ("set", FlatState of the shard's slice)
    tag STATE_REPLY  shard -> worker   the shard's FlatState (get), or None once it holds the new state (set)
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from mpi4py import MPI

from hpcps.training.optim import ShardOptimizer
from hpcps.training.optstate import FlatState, from_shard, to_shard
from hpcps.transport import wire
from hpcps.transport.poll import Backoff


class StateDesk:
    """A server shard's side task: answer the workers' state requests, one per call at most.

    ``optimizer``: the shard's (None where it holds buffers only); ``length``: its slice's values."""

    def __init__(self, comm: MPI.Comm, optimizer: ShardOptimizer | None, length: int) -> None:
        self.comm, self.optimizer, self.length = comm, optimizer, length
        self.status = MPI.Status()

    def __call__(self) -> bool:
        if not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=wire.TAG_STATE, status=self.status):
            return False
        source = self.status.Get_source()
        request = self.comm.recv(source=source, tag=wire.TAG_STATE)
        opt = self.optimizer if self.optimizer is not None and self.optimizer.optimizer is not None else None
        reply = None
        if request[0] == "get":
            reply = from_shard(opt.state_dict(), opt.spans, self.length) if opt is not None else FlatState()
        elif request[0] == "set" and opt is not None:
            opt.load_state_dict(to_shard(request[1], opt.spans, opt.state_dict()))
        self.comm.send(reply, dest=source, tag=wire.TAG_STATE_REPLY)
        return True


def _await(comm: MPI.Comm, source: int, poke: Callable[[], object], timeout: float):
    """The reply from ``source``, polling (``poke`` between polls keeps this worker's transfers moving)."""
    backoff, began = Backoff(), time.monotonic()
    while True:
        message = comm.improbe(source=source, tag=wire.TAG_STATE_REPLY)
        if message is not None:
            return message.recv()
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"ps.optimizer: server shard at rank {source} did not answer in {timeout:.0f} s "
                               "(has the run ended? ask while ps.running, before close)")
        poke()
        backoff.pause()


def ask(comm: MPI.Comm, shards: Sequence[int], poke: Callable[[], object], timeout: float) -> list[FlatState]:
    """Every shard's state, over its slice (in ``shards``' order)."""
    requests = [comm.isend(("get",), dest=s, tag=wire.TAG_STATE) for s in shards]
    parts = [_await(comm, s, poke, timeout) for s in shards]
    MPI.Request.waitall(requests)
    return parts


def hand(comm: MPI.Comm, shards: Sequence[int], parts: Sequence[FlatState], poke: Callable[[], object],
         timeout: float) -> None:
    """Give each shard its part of a state; return once every shard holds it."""
    requests = [comm.isend(("set", part), dest=s, tag=wire.TAG_STATE) for s, part in zip(shards, parts)]
    for s in shards:
        _await(comm, s, poke, timeout)
    MPI.Request.waitall(requests)
