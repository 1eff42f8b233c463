"""Backup workers (Chen et al. 2016, "Revisiting Distributed Synchronous SGD"): a paradigm of your own.

Synchronous SGD whose round closes with the first N - b gradients computed
on the round's parameters: the b slowest workers of each round are backups,
so one straggler no longer holds every round up. A gradient that arrives
after its round closed (computed on older parameters) is dropped, counted
(``reason`` 3 in the run file's ``/servers/updates``), and its worker is
released at once, to compute on the newest parameters with everyone else.
With b = 0 it is BSP, bit for bit.

Each central shard runs its own instance and sees the pushes in its own
order, so with several shards (``--servers``) a late gradient may be
applied on one shard's slice and dropped on another's; run it on one shard
for the paper's semantics.

Written as a user writes a paradigm (docs/paradigms.md, "Write your own
paradigm"): one file, one subclass of :class:`hpcps.Policy`, nothing of
hpcps changed. Run it against BSP with a straggler::

    mpiexec -n 5 hpcps train --paradigm examples/backup_workers.py:BackupWorkers \\
        --paradigm-option backups=1 --slowdown 4=3
"""

from __future__ import annotations

from hpcps import Decision, Policy


class BackupWorkers(Policy):
    """BSP closing each round with its first ``n_workers - backups`` gradients; the late ones are dropped."""

    name = "backup-workers"
    summary = "synchronous rounds of the first N - b gradients; the b late ones are dropped (Chen et al. 2016)"
    # worker_blocks (True by default): a worker waits for its grant before it computes again.
    # applies_on_arrival and holds_rounds stay False: the shard holds each worker's gradient until the
    # round closes, in a receive buffer per worker.

    def __init__(self, n_workers: int, *, backups: int = 1) -> None:
        super().__init__(n_workers)
        if not 0 <= backups < n_workers:
            raise ValueError(f"backups must be 0 to {n_workers - 1} with {n_workers} workers; got {backups}")
        self.backups = backups
        self.version = 0  # the parameters' version: one per closed round
        self.round: list[int] = []  # workers whose gradient on this version is in

    @classmethod
    def updates_per_step(cls, n_clients: int) -> int:
        return 1  # one averaged update per round, as bsp: --lr is the round's step

    def resume_at(self, version: int) -> None:
        self.version = version

    def threshold(self, worker: int) -> int:
        return 0  # every applied gradient is computed on the version it is applied to

    def on_push(self, worker: int, clock: int, version: int, now: float) -> Decision:
        if version < self.version:  # its round closed without it: a backup's gradient, too late
            return Decision(drops=(worker,), grants=(worker,))
        self.round.append(worker)
        return self._close()

    def on_leave(self, worker: int, now: float) -> Decision:
        super().on_leave(worker, now)  # one fewer active worker: the round may close now
        return self._close()

    def _close(self) -> Decision:
        """Close the round once it has N - b gradients of the active workers (or every active one has
        pushed, as the last workers leave)."""
        needed = max(len(self.active) - self.backups, 1)
        in_round = sum(w in self.active for w in self.round)  # a worker that pushed and left counts no more
        if not self.round or (in_round < needed and not self.active <= set(self.round)):
            return Decision()
        done = tuple(sorted(self.round))  # worker order: the float sum is the same in every run
        self.round = []
        self.version += 1
        return Decision(updates=(done,), grants=done)
