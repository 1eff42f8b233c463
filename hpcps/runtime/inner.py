"""A worker's rounds under ``--local-steps`` in the step API: each inner step's record, the round's end (its
losses and seconds, ``--local-steps-by-speed``'s shares), and the inner optimizer's checkpoints (its state
written each round beside the run's checkpoints, taken back on resume). The inner steps' arithmetic is
:class:`hpcps.training.local.LocalSteps`'s; the session (:mod:`hpcps.runtime.session`) drives both."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from hpcps.runtime.checkpoints.files import checkpoint_files, newest_clocks
from hpcps.runtime.collectives import WorkerCollectives
from hpcps.runtime.plan import start_clock
from hpcps.training.local import InnerFiles, LocalSteps, seconds_per_step, steps_by_speed

if TYPE_CHECKING:
    from hpcps.runtime.run import Run

log = logging.getLogger("hpcps")


class InnerRounds:
    """Worker ``index``'s (rank ``rank``) rounds of ``local``'s inner steps in ``run``."""

    def __init__(self, local: LocalSteps, run: "Run", index: int, rank: int) -> None:
        self.local, self.run, self.index, self.rank = local, run, index, rank
        #: the inner steps whose gradient was not finite, skipped (:meth:`nonfinite_step`)
        self.nonfinite = 0
        #: the round's steps so far: each one's computation seconds and loss
        self.steps: list[float] = []
        self.losses: list[float] = []
        self._ckpt_files: tuple[str, ...] = ()  # the checkpoint files the inner files were last pruned by

    def record(self, compute_s: float, loss: float) -> None:
        """An inner step of the round took ``compute_s`` seconds at ``loss``."""
        self.steps.append(compute_s)
        self.losses.append(loss)

    def close_round(self) -> tuple[float, float]:
        """The round's loss (the mean of its steps') and computation seconds (their sum); a new round begins."""
        value, compute_s = float(np.mean(self.losses)), sum(self.steps)
        self.steps, self.losses = [], []
        return value, compute_s

    def nonfinite_step(self, iteration: int) -> bool:
        """Under local steps, an inner step's gradient holds NaN or Inf: the inner optimizer never applies it
        (applied, it would leave the parameters and an AdamW's or momentum's state non-finite, and every later
        round of this worker dropped), as ``--nonfinite skip`` never applies such a push; counted in
        ``/workers/scalars`` (``inner_nonfinite``) and said once. Under ``--nonfinite abort``: ends the job."""
        from hpcps.errors import RunAborted

        if self.run.plan.cfg.nonfinite == "abort":
            raise RunAborted(f"worker rank {self.rank} computed a non-finite gradient at inner step {iteration} "
                             "(--nonfinite abort)")
        self.nonfinite += 1
        if self.nonfinite == 1:
            log.warning("worker rank %d: a non-finite gradient at inner step %d was skipped, not applied by the "
                        "inner optimizer (counted in /workers/scalars as inner_nonfinite; said once)", self.rank,
                        iteration)
        self.run.state.recorder.add("workers/scalars", (self.rank, iteration, self.run.clock(), b"inner_nonfinite",
                                                        float(self.nonfinite)))
        return True

    def share_by_speed(self, collectives: WorkerCollectives) -> None:
        """``--local-steps-by-speed``, at the end of this run's first round (every worker gets there: a stop is
        seen only between rounds): the workers' seconds per step, gathered, make each one's steps per round.
        Under run-through after a death: the living's (a worker's place is its rank among them)."""
        mine = np.array([seconds_per_step(self.steps)])
        gathered: list[np.ndarray] = []

        def start(comm: MPI.Comm) -> MPI.Request:
            gathered[:] = [np.empty(comm.size)]  # sized anew where a death shrank the workers
            return comm.Iallgather(mine, gathered[0])

        collectives.run(start, "every worker's first round (--local-steps-by-speed times them)")
        every = gathered[0]
        shares = steps_by_speed(self.local.every, every.tolist())
        self.local.own = shares[collectives.comm.rank]
        if collectives.comm.rank == 0:
            log.info("local steps by speed: %s per round (seconds per step %s)", shares,
                     ", ".join(f"{s:.3g}" for s in every))

    # -- the inner optimizer's checkpoints -----------------------------------------
    def resume(self) -> None:
        """A resumed run under local steps: the inner optimizer's state as this worker left it after the round
        the checkpoint resumes at; where the checkpoint cannot give it, the state starts afresh (said once)."""
        run, w = self.run, self.index
        if run.state.placed_at is not None:
            log.warning("local steps: spare rank %d starts its inner optimizer afresh (worker %d's died with it)",
                        self.rank, w)
            return
        if run.plan.ckpt is None:
            return
        clock = start_clock(run.plan, run.state)
        if run.plan.ckpt.redealt:
            if w == 0:
                log.warning("local steps: the run resumes with another worker count, so each worker's inner "
                            "optimizer state starts afresh (the parameters and the outer state come back)")
            return
        state = InnerFiles(os.path.dirname(os.path.abspath(run.plan.cfg.resume)), w).read(clock)
        if state is None:
            log.warning("local steps: worker %d finds no inner optimizer state of round %d beside %s; it starts "
                        "afresh", w, clock, run.plan.cfg.resume)
            return
        kind = type(self.local.optimizer).__name__
        if state.get("class", kind) != kind:  # another --inner-optimizer: that state means nothing to this one
            if w == 0:
                log.warning("local steps: the checkpoint's inner optimizer was %s, this run's is %s: each "
                            "worker's inner state starts afresh", state["class"], kind)
            return
        self.local.optimizer.load_state_dict(state["optimizer"])

    def write(self, clock: int) -> None:
        """Under periodic checkpoints: the inner optimizer's state after round ``clock``, written before the
        round is pushed; files of rounds before this worker's clock in the newest complete checkpoint go."""
        cfg = self.run.plan.cfg
        if not (cfg.checkpoint_every or cfg.checkpoint_interval):
            return
        self.save(clock)
        files = checkpoint_files(self.run.state.ckpt_dir)
        if files == self._ckpt_files:  # no checkpoint written or completed since the last round: nothing to read
            return
        self._ckpt_files = files
        clocks = newest_clocks(self.run.state.ckpt_dir)
        if clocks is not None and len(clocks) > self.index:
            self.files().prune(int(clocks[self.index]))

    def save(self, clock: int) -> None:
        self.files().write(clock, {"optimizer": self.local.optimizer.state_dict(), "round": clock,
                                   "class": type(self.local.optimizer).__name__})

    def files(self) -> InnerFiles:
        return InnerFiles(self.run.state.ckpt_dir, self.index)
