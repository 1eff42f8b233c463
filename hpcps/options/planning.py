"""The checks of a run's options against its world size, and its rank layout (pure: no MPI).

Shared by ``hpcps train`` (every rank, at start-up) and ``hpcps jobs render``
(before a batch script is written), so a job that would be refused at
start-up is refused before it waits in a queue.
"""

from __future__ import annotations

from typing import Sequence

from hpcps.options.config import TrainConfig
from hpcps.options.defaults import settle_layout
from hpcps.errors import UserError
from hpcps.cluster.layout import Layout, Role
from hpcps.options.effects import refuse
from hpcps.options.paradigm_choice import AUTO, candidates
from hpcps.policies import Policy, make_policy, policy_class


def plan(cfg: TrainConfig, world_size: int, nodes: Sequence[int] | None = None) -> Layout:
    """Check the options (:func:`resolve`); return the rank layout."""
    return resolve(cfg, world_size, nodes)[1]


def resolve_each(cfg: TrainConfig, world_size: int, nodes: Sequence[int] | None = None) \
        -> list[tuple[TrainConfig, type[Policy], Layout]]:
    """:func:`resolve` of ``cfg``, or under ``--paradigm auto`` of each paradigm it may choose (every one must
    be able to run: the trials run them all), each with its options."""
    if cfg.paradigm != AUTO:
        return [(cfg, *resolve(cfg, world_size, nodes))]
    each = []
    for c in candidates(cfg):
        try:
            each.append((c, *resolve(c, world_size, nodes)))
        except UserError as exc:
            raise UserError(f"{exc} (in --paradigm auto's trial of {c.paradigm}: leave {c.paradigm} out of "
                            f"--paradigms, or name a paradigm)") from None
    return each


def resolve(cfg: TrainConfig, world_size: int, nodes: Sequence[int] | None = None) -> tuple[type[Policy], Layout]:
    """The paradigm's class, resolved from its name once for the run (a run's
    :class:`~hpcps.runtime.plan.RunPlan` keeps it), and the rank layout, once the options are checked
    (:func:`hpcps.options.effects.refuse`) with those that depend on the world size. ``nodes[r]`` names
    rank r's node, for ``--servers auto`` (:mod:`hpcps.options.defaults`); None: one node."""
    if cfg.paradigm == AUTO:
        raise UserError("--paradigm auto is chosen by trials of the training loop, which hpcps train and "
                        "hpcps.train run; in your own loop name a paradigm (hpcps train --paradigm auto on the same "
                        "model and data says which)")
    paradigm = policy_class(cfg.paradigm)
    cfg = settle_layout(cfg, [0] * world_size if nodes is None else nodes)
    refuse(cfg, paradigm)  # the combinations that cannot work, whatever the world size
    layout = Layout(world_size, cfg.servers, cfg.groups, n_spares=cfg.spare_workers)
    layout.check_groups()
    # your own paradigm's options are checked by building it, before any rank waits on another
    make_policy(cfg.paradigm, layout.n_groups or layout.n_workers, cfg.paradigm_option, staleness=cfg.s_lo,
                staleness_max=cfg.s_hi)
    workers = f"ranks {layout.first_worker}-{world_size - layout.n_spares - 1}"
    if layout.n_spares:
        workers += f", spares ranks {world_size - layout.n_spares}-{world_size - 1}"
    trains = (Role.WORKER, Role.SPARE)  # a spare's fault or slowdown acts once it is in a dead worker's place
    for fault in cfg.faults:
        if not 0 <= fault.rank < world_size or layout.role(fault.rank) not in trains:
            raise UserError(f"--fault {fault.kind}@{fault.rank}:{fault.step}: rank {fault.rank} is not a worker "
                            f"(workers are {workers})")
    for rank in cfg.slowdown:
        if not 0 <= rank < world_size:
            raise UserError(f"--slowdown {rank}=...: no rank {rank} in a world of {world_size} (workers are {workers})")
        if layout.role(rank) not in trains:
            raise UserError(f"--slowdown {rank}=...: rank {rank} is a {layout.role(rank).value}, not a worker "
                            f"(workers are {workers})")
    return paradigm, layout
