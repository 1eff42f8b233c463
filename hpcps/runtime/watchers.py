"""What a run watches while it serves: the workers' losses for divergence, the first gradients for a run
that cannot start, and stop signals, each raising every shard's stop flag (rank 0's, or any server's)."""

from __future__ import annotations

import logging

import numpy as np

from hpcps.training import rates
from hpcps.training.divergence import DivergenceWatch, FlatLoss, NonFiniteStart, window_for
from hpcps.transport.window import ParamWindow
from hpcps.runtime.plan import RunPlan, RunState, carried_loss_start

log = logging.getLogger("hpcps")


def divergence_watch(plan: RunPlan, state: RunState, window: ParamWindow):
    """Rank 0: the workers' rows as they arrive, checked for divergence (hpcps.training.divergence); once
    diverged, one line saying what to try, and every shard's stop flag up. A resumed run compares with
    the start its checkpoint carries (``state.loss_start``, written into this run's checkpoints in turn), over
    a window of two losses a worker (hpcps.training.divergence.window_for)."""
    watch, cfg = DivergenceWatch(window_for(plan.layout.n_workers), start=carried_loss_start(plan)), plan.cfg
    state.loss_start = lambda: watch.start
    n_clients = len(plan.clients)  # who pushes to a central shard
    per_step = plan.paradigm.updates_per_step(n_clients)
    rate = cfg.lr * rates.lr_scale(cfg, plan.paradigm, n_clients)

    def on_rows(rows: np.ndarray) -> None:
        reason = watch.observe(rows)
        if reason is None or state.diverged is not None:
            return
        state.diverged = reason
        opt = state.optimizer  # shard 0's: the rate a loop set through ps.optimizer, if it set one
        loop_lr = opt.recorded_lr if opt is not None and opt.recorded_lr != opt.default_lr else None
        if loop_lr is not None:
            how = (f"the loop set the rate to {loop_lr:g} in ps.optimizer's param groups (--lr {cfg.lr:g} is "
                   f"not the rate in force): try a smaller one there, or --clip-norm")
        elif per_step > 1 and cfg.lr_scaling == "none":
            how = (f"each worker's gradient is applied as its own update at --lr {cfg.lr:g} (--lr-scaling "
                   f"none), {per_step} updates per step of every worker: try --lr-scaling auto (--lr / "
                   f"{per_step} per update)")
        elif per_step > 1:
            how = (f"each worker's gradient is applied as its own update at {rate:g} (--lr {cfg.lr:g} / "
                   f"{per_step}): try a smaller --lr, --clip-norm, or a bounded paradigm (ssp, dssp)")
        else:
            how = f"one update per round at {rate:g} (--lr {cfg.lr:g}): try a smaller --lr, or --clip-norm"
        if not _trial_said(plan, "diverged", reason):
            log.error("training diverged under %s: %s; %s, or --divergence ignore to train on; stopping",
                      cfg.paradigm, reason, how)
        window.set_stop()
    return on_rows


def flat_loss_watch(plan: RunPlan, state: RunState, window: ParamWindow):
    """Rank 0: the workers' rows as they arrive; once the loss has stayed at its start over half of the
    run (hpcps.training.divergence.FlatLoss), one line saying what to try, and every shard's stop flag up.
    Not for a resumed run, whose start is no untrained loss (a late plateau is no fault)."""
    watch, cfg = FlatLoss(plan.rounds), plan.cfg

    def on_rows(rows: np.ndarray) -> None:
        reason = watch.observe(rows)
        if reason is None or state.diverged is not None:
            return
        state.diverged = reason
        if plan.paradigm.updates_per_step(len(plan.clients)) > 1:
            how = ("under an asynchronous paradigm its first updates can kill a model no one tuned for it: try a "
                   "smaller --lr or --momentum, --warmup-steps, a bounded paradigm (ssp, dssp) or bsp")
        else:
            how = "try a larger --lr, another --optimizer, or check that the labels match the data"
        if not _trial_said(plan, "is not learning", reason):
            log.error("training is not learning under %s: %s; %s, or --divergence ignore to train on; stopping",
                      cfg.paradigm, reason, how)
        window.set_stop()
    return on_rows if plan.ckpt is None and plan.start_iteration == 0 else None


def nonfinite_start_watch(plan: RunPlan, state: RunState, window: ParamWindow):
    """Rank 0: the shards' rows as they arrive; if the run's first gradients were all non-finite, one line
    saying so, and every shard's stop flag up (stopped by divergence: nothing worth resuming)."""
    watch = NonFiniteStart()

    def on_rows(rows: np.ndarray) -> None:
        reason = watch.observe(rows)
        if reason is None or state.diverged is not None:
            return
        state.diverged = reason
        if not _trial_said(plan, "cannot start", reason):
            log.error("training cannot start under %s: %s; stopping (--divergence ignore trains on)",
                      plan.cfg.paradigm, reason)
        window.set_stop()
    return on_rows


def _trial_said(plan: RunPlan, what: str, reason: str) -> bool:
    """In a trial (:class:`~hpcps.runtime.plan.Leg`), the stop said as the trial's end, a warning: the trials
    go on without it, and a run's advice (a smaller rate, ``--divergence ignore``) is not the user's to take.
    False in a run, whose watch says what to try."""
    if plan.trial:
        log.warning("--paradigm auto: %s's trial %s: %s; stopping it (it is not chosen)", plan.cfg.paradigm,
                    what, reason)
    return plan.trial


def spread_signal(plan: RunPlan, state: RunState, window: ParamWindow, own: ParamWindow | None = None):
    """A server's side task: a stop signal this rank received, or (a group server, ``own``) a stop one
    of its workers asked for, raises the stop flag of every shard of ``window``, once."""
    spread = False

    def task() -> None:
        nonlocal spread
        if spread:
            return
        if state.signals.take() or (own is not None and own.stop_raised()):
            window.request_stop()
            spread = True
    return task
