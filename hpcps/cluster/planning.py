"""The checks of a run's options against its world size, and its rank layout (pure: no MPI).

Shared by ``hpcps train`` (every rank, at start-up) and ``hpcps jobs render``
(before a batch script is written), so a job that would be refused at
start-up is refused before it waits in a queue.
"""

from __future__ import annotations

from hpcps.config import TrainConfig
from hpcps.errors import UserError
from hpcps.cluster.layout import Layout, Role
from hpcps.policies import make_policy, policy_class


def plan(cfg: TrainConfig, world_size: int) -> Layout:
    """Check the options that depend on the world size; return the rank layout."""
    layout = Layout(world_size, cfg.servers, cfg.groups)
    cls = policy_class(cfg.paradigm)
    if cfg.groups and not cls.uses_groups:
        raise UserError(f"--groups {cfg.groups}: paradigm {cfg.paradigm!r} does not use group servers")
    if cls.uses_groups and not cfg.groups:
        raise UserError(f"--paradigm {cfg.paradigm} needs --groups G (1 or more group servers)")
    layout.check_groups()
    # your own paradigm's options are checked by building it, before any rank waits on another
    make_policy(cfg.paradigm, layout.n_groups or layout.n_workers, cfg.paradigm_option, staleness=cfg.s_lo,
                staleness_max=cfg.s_hi)
    periodic = "--checkpoint-every" if cfg.checkpoint_every else "--checkpoint-interval" if cfg.checkpoint_interval \
        else None
    if periodic and cls.periodic_cut() is None:
        raise UserError(f"{periodic}: --paradigm {cfg.paradigm} holds gradients its own way, and periodic "
                        f"checkpoints cut only paradigms that hold rounds or apply every gradient on arrival "
                        f"(every built-in one); a run of it writes one when SIGUSR1, SIGTERM or Ctrl-C stops it")
    if cfg.partition_mb and cls.eager_pull:
        raise UserError(f"--partition-mb: --paradigm {cfg.paradigm} pulls behind its computation already (and "
                        f"swaps the whole pull in); partitioned pulls are for paradigms that pull between steps")
    if cfg.checkpoint_interval and cls.checkpoints_at_publish():  # bsp, or a plug-in built on it
        raise UserError(f"--checkpoint-interval: --paradigm {cfg.paradigm} checkpoints at a round's close, where "
                        f"every worker waits: give --checkpoint-every ROUNDS")
    workers = f"ranks {layout.first_worker}-{world_size - 1}"
    for fault in cfg.faults:
        if not 0 <= fault.rank < world_size or layout.role(fault.rank) is not Role.WORKER:
            raise UserError(f"--fault {fault.kind}@{fault.rank}:{fault.step}: rank {fault.rank} is not a worker "
                            f"(workers are {workers})")
    for rank in cfg.slowdown:
        if not 0 <= rank < world_size:
            raise UserError(f"--slowdown {rank}=...: no rank {rank} in a world of {world_size} (workers are {workers})")
        if layout.role(rank) is not Role.WORKER:
            raise UserError(f"--slowdown {rank}=...: rank {rank} is a {layout.role(rank).value}, not a worker "
                            f"(workers are {workers})")
    return layout
