"""Rank layout: which world rank plays which role (pure arithmetic, no MPI).

Ranks are laid out in three consecutive blocks::

    0 .. S-1          central server shards
    S .. S+G-1        group servers (only for paradigms that use them)
    S+G .. world-K-1  workers
    world-K .. world-1  spare workers (``--spare-workers K``; none by default)

so ``mpiexec -n 5`` with the defaults gives one server (rank 0) and four
workers (ranks 1-4), and ``--slowdown 4=3`` names the last worker. A spare
waits, idle, until a worker dies (under run-through) and it takes that
worker's index, data share and clock (:mod:`hpcps.runtime.spares`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hpcps.errors import UserError


class Role(str, Enum):
    SERVER = "server"
    GROUP = "group"
    WORKER = "worker"
    SPARE = "spare"


def shard_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous blocks, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for p in range(parts):
        stop = start + base + (p < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class Layout:
    """The role blocks of a world of ``world_size`` ranks."""

    world_size: int
    n_servers: int = 1
    n_groups: int = 0
    #: explicit group membership (world ranks per group; ``--group-by speed``), else contiguous blocks
    members: tuple[tuple[int, ...], ...] | None = None
    n_spares: int = 0

    def __post_init__(self) -> None:
        if self.n_servers < 1:
            raise UserError(f"--servers must be at least 1 (got {self.n_servers})")
        if self.n_groups < 0:
            raise UserError(f"--groups must be 0 or more (got {self.n_groups})")
        if self.n_spares < 0:
            raise UserError(f"--spare-workers must be 0 or more (got {self.n_spares})")
        if self.n_workers < 1:
            taken = [f"--servers {self.n_servers}", f"--groups {self.n_groups}"] + \
                ([f"--spare-workers {self.n_spares}"] if self.n_spares else [])
            raise UserError(
                f"world of {self.world_size} rank(s) is too small for {', '.join(taken[:-1])} and {taken[-1]}: "
                f"at least {self.n_servers + self.n_groups + self.n_spares + 1} ranks are needed "
                f"(start more with mpiexec -n / srun -n)"
            )

    def check_groups(self) -> None:
        """Every group needs at least one worker."""
        if self.n_groups > self.n_workers:
            raise UserError(f"--groups {self.n_groups}: only {self.n_workers} worker(s) to share between them "
                            f"(at most one group per worker; start more ranks)")

    @property
    def n_workers(self) -> int:
        return self.world_size - self.n_servers - self.n_groups - self.n_spares

    @property
    def first_worker(self) -> int:
        return self.n_servers + self.n_groups

    def role(self, rank: int) -> Role:
        if rank < self.n_servers:
            return Role.SERVER
        if rank < self.first_worker:
            return Role.GROUP
        if rank >= self.world_size - self.n_spares:
            return Role.SPARE
        return Role.WORKER

    def worker_index(self, rank: int) -> int:
        """Index 0..N-1 of the worker at world ``rank``."""
        if self.role(rank) is not Role.WORKER:
            raise ValueError(f"rank {rank} is not a worker")
        return rank - self.first_worker

    def worker_rank(self, index: int) -> int:
        return self.first_worker + index

    def worker_ranks(self) -> range:
        return range(self.first_worker, self.world_size - self.n_spares)

    def spare_ranks(self) -> range:
        return range(self.world_size - self.n_spares, self.world_size)

    def training_ranks(self) -> range:
        """The workers and the spares: the ranks that hold a model to train (a spare once it takes a place)."""
        return range(self.first_worker, self.world_size)

    def group_members(self) -> list[list[int]]:
        """World ranks of the workers of each group server: ``members``, or contiguous blocks whose sizes
        differ by at most one."""
        if self.members is not None:
            return [list(m) for m in self.members]
        ranks = list(self.worker_ranks())
        return [ranks[lo:hi] for lo, hi in shard_bounds(len(ranks), self.n_groups)] if self.n_groups else []

    def group_of(self, rank: int) -> int | None:
        """Group index of a group server or worker rank (None without groups, or for a central shard)."""
        if self.role(rank) is Role.GROUP:
            return rank - self.n_servers
        for g, members in enumerate(self.group_members()):
            if rank in members:
                return g
        return None

    def rotation_start(self, rank: int, index: int | None = None) -> int:
        """Where ``rank``'s rotation of the central shards starts (``--shards-at-once``): a worker's index
        (``index``, else from its rank), a group server's group (the group servers are the central shards'
        clients, and start apart as the workers do), else 0 (a central shard's own reads)."""
        if index is not None:
            return index
        role = self.role(rank)
        if role is Role.WORKER:
            return self.worker_index(rank)
        return self.group_of(rank) if role is Role.GROUP else 0

    def group_server_rank(self, group: int) -> int:
        return self.n_servers + group

    def describe(self) -> str:
        parts = [f"{self.n_servers} server shard(s) (rank 0-{self.n_servers - 1})"]
        if self.n_groups:
            parts.append(f"{self.n_groups} group server(s)")
        last = self.world_size - self.n_spares - 1
        parts.append(f"{self.n_workers} worker(s) (rank {self.first_worker}-{last})")
        if self.n_spares:
            parts.append(f"{self.n_spares} spare worker(s) (rank {last + 1}-{self.world_size - 1})")
        return ", ".join(parts)
