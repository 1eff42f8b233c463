"""The communicators of one run, split once from the run's communicator.

Nothing below keeps a global ``COMM_WORLD``: the run communicator is an
argument, and each component receives the communicator it talks on.

* ``ps``: pushes, notices and the parameter RMA window (a duplicate, so
  parameter-server traffic never matches anyone else's messages);
* ``metrics``: metric batches to rank 0 (another duplicate);
* ``role_comm``: the ranks of this rank's role (servers, group servers, workers);
* ``node``: the ranks on this node (shared-memory split), for local ranks;
* ``group``: with group servers, one per group: its group server (rank 0 in
  it) and its workers; the group's pushes, notices and parameter window use
  it. ``COMM_NULL`` on central shards and without groups.
"""

from __future__ import annotations

from mpi4py import MPI

from hpcps.cluster.layout import Layout, Role


class Topology:
    """Collective over ``comm`` to create and to :meth:`free`."""

    def __init__(self, comm: MPI.Comm, layout: Layout) -> None:
        if comm.size != layout.world_size:
            raise ValueError("layout does not match the communicator size")
        self.comm = comm
        self.layout = layout
        self.rank = comm.rank
        self.role = layout.role(comm.rank)
        self.ps = comm.Dup()
        self.metrics = comm.Dup()
        self.role_comm = comm.Split(list(Role).index(self.role), comm.rank)
        self.node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        g = layout.group_of(comm.rank)
        # key: the group server (a lower world rank than its workers) becomes rank 0 of its group
        self.group = comm.Split(MPI.UNDEFINED if g is None else g, comm.rank)

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks on its node."""
        return self.node.rank

    def free(self) -> None:
        for name in ("ps", "metrics", "role_comm", "node", "group"):
            c = getattr(self, name, None)
            if c is not None and c != MPI.COMM_NULL:
                c.Free()
            setattr(self, name, None)

    def __enter__(self) -> "Topology":
        return self

    def __exit__(self, *exc) -> None:
        self.free()


def node_local_index(comm: MPI.Comm, members) -> int | None:
    """Collective: this rank's index among the ``members`` ranks (of ``comm``) on its node; None if not one.

    Works before a :class:`Topology` exists (devices are chosen before the
    model's buffers are laid out), so it splits and frees a node communicator
    of its own.
    """
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        on_node = node.allgather(comm.rank)
    finally:
        node.Free()
    members = set(members)
    local = [r for r in on_node if r in members]
    return local.index(comm.rank) if comm.rank in members else None
