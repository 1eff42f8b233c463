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

from typing import Callable, Sequence

from mpi4py import MPI

from hpcps.training.optim import ShardOptimizer
from hpcps.training.optstate import FlatState, from_shard, to_shard
from hpcps.transport import wire
from hpcps.transport.failures import retried


class StateDesk:
    """A server shard's side task: answer the workers' state requests, one per call at most.

    ``optimizer``: the shard's (None where it holds buffers only); ``length``: its slice's values."""

    def __init__(self, comm: MPI.Comm, optimizer: ShardOptimizer | None, length: int, dead=None) -> None:
        """``dead``: :class:`~hpcps.transport.failures.DeadRanks` over ``comm`` under run-through."""
        self.comm, self.optimizer, self.length, self.dead = comm, optimizer, length, dead
        self.status = MPI.Status()

    def __call__(self) -> bool:
        if not retried(self.dead, lambda: self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=wire.TAG_STATE,
                                                           status=self.status)):
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


#: ``wait(test, what)``: poll ``test`` until true, under a stall watch naming ``what``
#: (:meth:`hpcps.runtime.session.Session._wait`: the worker's transfers move between polls)
Wait = Callable[[Callable[[], bool], str], None]


def _answer(comm: MPI.Comm, source: int, wait: Wait):
    """The answer of the shard at rank ``source``."""
    messages = []

    def arrived() -> bool:
        message = comm.improbe(source=source, tag=wire.TAG_STATE_REPLY)
        if message is not None:
            messages.append(message)
        return message is not None
    wait(arrived, f"the answer of server shard rank {source} to ps.optimizer (shards answer while the run is on)")
    return messages[0].recv()


def ask(comm: MPI.Comm, shards: Sequence[int], wait: Wait) -> list[FlatState]:
    """Every shard's state, over its slice (in ``shards``' order)."""
    requests = [comm.isend(("get",), dest=s, tag=wire.TAG_STATE) for s in shards]
    parts = [_answer(comm, s, wait) for s in shards]
    MPI.Request.waitall(requests)
    return parts


def hand(comm: MPI.Comm, shards: Sequence[int], parts: Sequence[FlatState], wait: Wait) -> None:
    """Give each shard its part of a state; return once every shard holds it."""
    requests = [comm.isend(("set", part), dest=s, tag=wire.TAG_STATE) for s, part in zip(shards, parts)]
    for s in shards:
        _answer(comm, s, wait)
    MPI.Request.waitall(requests)
