"""``hpcps tune``: short trials of a job's layouts on its own model, data and ranks, ranked by measured speed.

Collective over the job's ranks, launched as the job would be (``mpiexec -n 8 hpcps tune <train
options>``). The first trial runs the options as given (every ``auto`` settled as a run settles it);
its model's size bounds the partition sizes worth a trial (:func:`hpcps.options.tuning.candidates`);
then each other layout runs ``--trial-steps`` steps. Rank 0 prints the layouts ranked by batches a
second (the mean step: the slowest worker's wall time over its steps after the first, which start-up
and torch's first passes slow), and the command line of the best ``--top``. The options as given run
again last, and the two trials' difference says how far apart two layouts must be to differ here (in
the box at 1 Gbit/s, 30 steps of one layout measured 88.5 and 101.4 ms). Trials write their run files
in a temporary folder, removed at the end; nothing of them is kept.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np
from mpi4py import MPI

from hpcps.analysis.report import mean_step
from hpcps.errors import UserError
from hpcps.options.config import TrainConfig
from hpcps.options.tuning import TUNED, Trial, candidates, command, flags, ranked, table

log = logging.getLogger("hpcps")

#: what a trial changes of the user's options: its length and its outputs (none kept), no stop but its steps
TRIAL = {"epochs": None, "save": None, "tensorboard": None, "checkpoint_every": None, "checkpoint_interval": None,
         "target": None, "target_accuracy": None, "divergence": "ignore", "progress": False, "eval_interval": 1e6,
         "eval_every": None}
#: options a trial cannot honour
REFUSED = ("resume", "fault")


#: steps left out at each worker's start (at most a quarter of its steps): start-up, torch's first passes
WARMUP_STEPS = 5


def measured(path: str) -> tuple[float, int]:
    """A trial's run file: its mean step (s; :func:`hpcps.analysis.report.mean_step` after
    :data:`WARMUP_STEPS`) and its worker count."""
    with h5py.File(path, "r") as f:
        it = f["workers/iterations"][()]
    return mean_step(it, WARMUP_STEPS), len(np.unique(it["rank"]))


def settled(path: str) -> dict[str, Any]:
    """The tuned options as a run file's config keeps them (``auto`` settled)."""
    with h5py.File(path, "r") as f:
        config = json.loads(f.attrs["config"])
    return {name: config[name] for name in TUNED}


def run_tune(cfg: TrainConfig, given: Sequence[str], comm: MPI.Comm, *, trial_steps: int, top: int,
             train_words: Sequence[str], train) -> list[Trial] | None:
    """Collective: the trials of ``cfg``'s layouts on ``comm`` (``given``: the options the user set, kept;
    ``train(cfg, comm)``: a run, returning its result on rank 0). Rank 0 prints the ranking and returns
    the trials; the others return None."""
    for name in REFUSED:
        if getattr(cfg, name):
            raise UserError(f"hpcps tune: --{name} is not tried in a trial; drop it")
    folder = comm.bcast(tempfile.mkdtemp(prefix="hpcps-tune-") if comm.rank == 0 else None, root=0)
    try:
        trials = _trials(cfg, given, comm, trial_steps, Path(folder), train)
        comm.Barrier()  # (every rank done with the trials' files; a failed trial ends the job instead)
    finally:
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    if comm.rank != 0:
        return None
    launch = ["mpiexec", "-n", str(comm.size)]
    print(f"hpcps tune: {len(trials)} layouts of --paradigm {cfg.paradigm} on {comm.size} ranks, "
          f"{trial_steps} steps each, ranked by batches a second (the slowest worker's mean step):")
    print("\n".join(table(trials)))
    first, again = trials[0].repeats
    print(f"\nthe options as given, tried first and last: {first * 1e3:.1f} and {again * 1e3:.1f} ms a step "
          f"({abs(first - again) / min(first, again):.0%} apart): layouts closer than that are alike here "
          f"(more --trial-steps narrow it)")
    print(f"\nthe best {min(top, len(trials))} (mean step in ms; your launcher's words in place of mpiexec's):")
    for t in ranked(trials)[:top]:
        layout = {k: v for k, v in t.values.items() if k not in given}  # (what the user set is in their words)
        print(f"  {t.step_s * 1e3:7.1f}  {command(launch, train_words, layout)}")
    return trials


def _trials(cfg: TrainConfig, given: Sequence[str], comm: MPI.Comm, steps: int, folder: Path, train) -> list[Trial]:
    """Every layout's trial, the options as given first; on rank 0 the measured trials (elsewhere empty)."""
    from hpcps.cluster.placement import node_ids

    nodes = node_ids(comm)
    base = cfg.model_copy(update={**TRIAL, "steps": steps})
    if comm.rank == 0:
        log.info("hpcps tune: trial 1: the options as given, %d steps", steps)
    result = train(base.model_copy(update={"out": str(folder / "trial-0.h5")}), comm)
    first = None
    if comm.rank == 0:
        step_s, workers = measured(result.path)
        first = (Trial(settled(result.path), workers, step_s, as_given=True), 4 * result.params.size / 2**20)
    first = comm.bcast(first, root=0)
    trials, model_mb = [first[0]], first[1]
    todo = [c for c in candidates(cfg, given, nodes, model_mb) if c != dict(first[0].values)]
    # the options as given once more, last: how far two trials of one layout fall apart here
    todo.append(dict(first[0].values))
    for k, values in enumerate(todo, 1):
        if comm.rank == 0:
            log.info("hpcps tune: trial %d of %d: %s", k + 1, len(todo) + 1, " ".join(flags(values)))
        result = train(base.model_copy(update={**values, "out": str(folder / f"trial-{k}.h5")}), comm)
        if comm.rank == 0:
            step_s, workers = measured(result.path)
            trials.append(Trial(values, workers, step_s))
    if comm.rank != 0:
        return []
    again = trials.pop()
    return [Trial(trials[0].values, trials[0].workers, (trials[0].step_s + again.step_s) / 2, as_given=True,
                  repeats=(trials[0].step_s, again.step_s)), *trials[1:]]
