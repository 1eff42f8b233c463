"""Where the server shards go: one per node, round-robin over nodes, workers on the rest.

A run's roles follow its communicator's rank order (:class:`hpcps.cluster.layout.Layout`: shards are
ranks 0..S-1). With block placement, as ``mpiexec`` and ``srun`` number ranks, all S shards would
then sit on the first node and share its network link. ``--placement spread`` (the default)
renumbers the ranks first: shard s goes to node ``s mod M`` (of M nodes, in the order of their
first rank; a node is a host and network namespace, so the emulated nodes of
:mod:`hpcps.box` count), as the ``s // M``-th rank there; every other rank keeps its world order. On one node
this is the world order itself. ``--placement rank`` keeps the world order (tests, or a site
whose launcher already places ranks).

:func:`placement_order` is the pure policy; :func:`place` is the MPI mechanism (a
``Comm.Split`` with the new order as key, so the run's communicator is a renumbered copy, freed
by the caller).
"""

from __future__ import annotations

import os
import socket
from typing import Sequence

from mpi4py import MPI

PLACEMENTS = ("spread", "rank")


def placement_order(nodes: Sequence[int], n_shards: int) -> list[int]:
    """The world ranks in run-rank order: ``order[k]`` is the world rank that becomes run rank ``k``.

    ``nodes[r]`` names world rank r's node (any hashable id). Shards (run ranks 0..S-1) are dealt
    round-robin over the nodes, in the order the nodes first appear; a node that runs out of ranks
    is skipped. The other ranks follow in world order.
    """
    per_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        per_node.setdefault(node, []).append(rank)
    queues = list(per_node.values())
    shards: list[int] = []
    depth = 0
    while len(shards) < n_shards:
        took = False
        for queue in queues:
            if depth < len(queue) and len(shards) < n_shards:
                shards.append(queue[depth])
                took = True
        if not took:
            raise ValueError(f"{n_shards} shards but only {len(nodes)} ranks")
        depth += 1
    chosen = set(shards)
    return shards + [r for r in range(len(nodes)) if r not in chosen]


def node_key() -> str:
    """What names this process's node: its host and its network namespace.

    Ranks of one real node share both. Ranks of different emulated nodes of a box
    (:mod:`hpcps.box`) share the host but not the network namespace, and MPI's shared-memory
    split cannot tell them apart (``MPIR_CVAR_NOLOCAL`` makes it see a node per rank).
    """
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:  # not Linux: the host alone names the node
        netns = 0
    return f"{socket.gethostname()}:{netns}"


def node_ids(comm: MPI.Comm) -> list[int]:
    """Collective: every rank's node, as the lowest rank (of ``comm``) with the same :func:`node_key`."""
    keys = comm.allgather(node_key())
    first: dict[str, int] = {}
    return [first.setdefault(key, rank) for rank, key in enumerate(keys)]


def run_order(comm: MPI.Comm, n_shards: int, mode: str, nodes: Sequence[int] | None = None) -> list[int]:
    """Collective (unless ``nodes``, :func:`node_ids` of ``comm``, is given): ``comm``'s ranks in the run's
    order, as ``mode`` says (:func:`placement_order` for ``spread``, their own order for ``rank``):
    ``order[k]`` becomes the run's rank ``k``."""
    if mode != "spread":
        return list(range(comm.size))
    return placement_order(node_ids(comm) if nodes is None else nodes, n_shards)


def place(comm: MPI.Comm, n_shards: int, mode: str, nodes: Sequence[int] | None = None) -> tuple[MPI.Comm, list[int]]:
    """Collective: the run's communicator, renumbered as ``mode`` says, and the world rank of each of
    its ranks (``comm``'s ranks, in the new order). The caller frees the communicator."""
    order = run_order(comm, n_shards, mode, nodes)
    new_rank = {world: k for k, world in enumerate(order)}
    return comm.Split(0, new_rank[comm.rank]), order
