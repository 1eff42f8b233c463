"""A run's learning rates and schedule, from its options (pure: no MPI).

``--lr`` is the step bsp takes per round; under ``--lr-scaling auto`` each
update's rate is ``--lr`` times its paradigm's share of a step of every
worker (:meth:`hpcps.policies.base.Policy.lr_scale`), and the schedule
(``--lr-schedule``, or the user's) runs over the updates a central shard
applies in the whole run, its horizon.
"""

from __future__ import annotations

from hpcps.options.config import TrainConfig
from hpcps.policies import Policy
from hpcps.training.optim import Schedule, make_schedule


def lr_scale(cfg: TrainConfig, paradigm: type[Policy], n_clients: int, *, extra: bool = False) -> float:
    """What a gradient's learning rate is multiplied by under ``--lr-scaling``, ``n_clients`` pushing to a
    central shard (the paradigm's :meth:`~hpcps.policies.base.Policy.lr_scale`; 1 under ``none``);
    ``extra``: an extra gradient's."""
    if cfg.lr_scaling == "none":
        return 1.0
    return paradigm.lr_scale(n_clients, extra=extra)


def horizon(paradigm: type[Policy], steps: int, n_clients: int) -> int:
    """The updates a central shard applies over the run (its last version): the schedules' horizon."""
    return steps * paradigm.updates_per_step(n_clients)


def schedule(cfg: TrainConfig, own: Schedule | None, updates: int, base_lr: float) -> Schedule:
    """The learning-rate multiplier by server version: the user's own (``own``), or ``--lr-schedule`` over
    ``updates`` (down to ``--min-lr`` over the optimizer's own rate ``base_lr``)."""
    return own or make_schedule(cfg.lr_schedule, horizon=updates, warmup=cfg.warmup_steps,
                                step_every=cfg.lr_step_every, gamma=cfg.lr_gamma, floor=(cfg.min_lr or 0.0) / base_lr)


def samples(schedule: Schedule, updates: int) -> list[list[float]]:
    """``[version, multiplier]`` at 9 versions over ``updates``: what the run file and checkpoints record of
    the schedule in force (a resumed run must have the same)."""
    return [[v, float(schedule(v))] for v in sorted({int(updates * k / 8) for k in range(9)})]
