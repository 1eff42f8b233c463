"""Short trials on a job's own model, data and ranks: ``hpcps tune``'s of its layouts, ranked by measured
speed, and ``--paradigm auto``'s of its paradigms (:func:`choose_paradigm`).

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
import time
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np
from mpi4py import MPI

from hpcps.analysis.report import applied_updates, compute_means, max_clock_gap, step_means
from hpcps.errors import UserError
from hpcps.options import paradigm_choice
from hpcps.options.config import TrainConfig
from hpcps.options.paradigm_choice import ParadigmTrial
from hpcps.options.tuning import TUNED, Trial, candidates, command, flags, ranked, table
from hpcps.runtime.plan import Leg
from hpcps.transport.failures import deaths_mark, deaths_since

log = logging.getLogger("hpcps")

#: what a trial changes of the user's options: its length and its outputs (none kept), no stop but its steps
TRIAL = {"epochs": None, "save": None, "tensorboard": None, "checkpoint_every": None, "checkpoint_interval": None,
         "target": None, "target_accuracy": None, "divergence": "ignore", "progress": False, "eval_interval": 1e6,
         "eval_every": None, "respawn": False}
#: options a trial cannot honour
REFUSED = ("resume", "fault")


#: steps left out at each worker's start (at most a quarter of its steps): start-up, torch's first passes
WARMUP_STEPS = 5


def settled(path: str) -> dict[str, Any]:
    """The tuned options as a run file's config keeps them (``auto`` settled)."""
    with h5py.File(path, "r") as f:
        config = json.loads(f.attrs["config"])
    return {name: config[name] for name in TUNED}


def run_tune(cfg: TrainConfig, given: Sequence[str], comm: MPI.Comm, *, top: int, train_words: Sequence[str],
             train) -> list | None:
    """Collective: the trials of ``cfg``'s layouts on ``comm`` (``given``: the options the user set, kept;
    ``train(cfg, comm, leg=...)``: a run, returning its result on rank 0), of ``--trial-steps`` steps each
    (trials: no held-out evaluation, :class:`~hpcps.runtime.plan.Leg`); under
    ``--paradigm auto``, of its paradigms instead (:func:`choose_paradigm`). Rank 0 prints the ranking and
    returns the trials; the others return None."""
    for name in REFUSED:
        if getattr(cfg, name):
            raise UserError(f"hpcps tune: --{name} is not tried in a trial; drop it")
    if cfg.paradigm == paradigm_choice.AUTO:
        return _tune_paradigms(cfg, comm, top, train_words, train)
    trial_steps = cfg.trial_steps
    cfg = paradigm_choice.as_chosen(cfg, cfg.paradigm)  # (--trial-steps read here, in no trial)
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

    def run_trial(k: int, values: dict):
        """Trial ``k + 1``: the run of ``values`` over the options as given (rank 0's result), no rank dead."""
        mark = deaths_mark()
        result = train(base.model_copy(update={**values, "out": str(folder / f"trial-{k}.h5")}), comm,
                       leg=Leg(trial=True))
        _no_death(mark, k + 1)
        return result

    if comm.rank == 0:
        log.info("hpcps tune: trial 1: the options as given, %d steps", steps)
    result = run_trial(0, {})
    first = None
    if comm.rank == 0:
        run = paradigm_trial(result.path, cfg.paradigm, 1)  # (a layout's trial: its rows' mean, one a row)
        first = (Trial(settled(result.path), run.workers, run.mean_step_s, as_given=True),
                 4 * result.params.size / 2**20)
    first = comm.bcast(first, root=0)
    trials, model_mb = [first[0]], first[1]
    todo = [c for c in candidates(cfg, given, nodes, model_mb) if c != dict(first[0].values)]
    # the options as given once more, last: how far two trials of one layout fall apart here
    todo.append(dict(first[0].values))
    for k, values in enumerate(todo, 1):
        if comm.rank == 0:
            log.info("hpcps tune: trial %d of %d: %s", k + 1, len(todo) + 1, " ".join(flags(values)))
        result = run_trial(k, values)
        if comm.rank == 0:
            run = paradigm_trial(result.path, cfg.paradigm, 1)
            trials.append(Trial(values, run.workers, run.mean_step_s))
    if comm.rank != 0:
        return []
    again = trials.pop()
    return [Trial(trials[0].values, trials[0].workers, (trials[0].step_s + again.step_s) / 2, as_given=True,
                  repeats=(trials[0].step_s, again.step_s)), *trials[1:]]


def _no_death(mark: int, k: int) -> None:
    """After layout trial ``k``, on every living rank: a rank that died in it (run-through) ends ``hpcps
    tune`` with one error, before the next trial would start on every rank, the dead one's included."""
    if deaths_since(mark):
        raise UserError(f"hpcps tune: a rank died in trial {k}, and every trial runs on every rank; nothing was "
                        f"ranked. Launch again on the living nodes")


def _tune_paradigms(cfg: TrainConfig, comm: MPI.Comm, top: int, train_words: Sequence[str], train) \
        -> list[ParadigmTrial] | None:
    """``hpcps tune --paradigm auto``: the paradigms' trials, ranked, and the command of the best ``top``."""
    options = paradigm_choice.candidates(cfg)
    cfg = _with_trial_steps(cfg, len(options), comm)
    said = paradigm_choice.caution(cfg)
    if said and comm.rank == 0:
        log.warning("%s", said)
    trials, skipped = _paradigm_trials(cfg, {o.paradigm: o for o in options}, comm, train,
                                       link_bps=_link(cfg, comm))
    chosen = paradigm_choice.choose(trials)
    if comm.rank != 0:
        return None
    print(f"hpcps tune: {len(trials)} of {len(options)} paradigms tried on {comm.size} ranks, {cfg.trial_steps} "
          f"steps each, ranked by batches a second (--paradigm auto trains as the one marked chosen):")
    print("\n".join(paradigm_choice.table(trials, chosen)))
    for paradigm, why in skipped.items():
        print(f"not tried: {paradigm}: {why}")
    for paradigm, why in paradigm_choice.left_out(cfg).items():
        print(f"left out: {paradigm}: {why}")
    print(f"\nthe best {min(top, len(trials))} (batches/s; your launcher's words in place of mpiexec's):")
    words = paradigm_choice.without_auto(train_words)
    order = [chosen] + [t for t in sorted(trials, key=lambda t: -t.batches_per_s) if t is not chosen]
    for t in [t for t in order if not t.stopped_by][:top]:
        print(f"  {t.batches_per_s:7.1f}  {command(['mpiexec', '-n', str(comm.size)], words, {})} "
              f"--paradigm {t.paradigm}")
    return trials


def paradigm_trial(path: str, paradigm: str, every: int) -> ParadigmTrial:
    """A trial's (or a run's) measure from its run file: its workers' batches a second (each worker's
    mean step after :data:`WARMUP_STEPS`; ``every``: batches a row, the local steps), the slowest worker's
    mean step, the applied gradients' mean staleness, and whether it stopped on its own."""
    with h5py.File(path, "r") as f:
        it, up = f["workers/iterations"][()], f["servers/updates"][()]
        stopped = str(f["summary"].attrs.get("stopped_by", ""))
    means = step_means(it, WARMUP_STEPS)
    applied = applied_updates(up)["staleness"]
    return ParadigmTrial(paradigm, len(means), sum(every / m for m in means.values()),
                         max(means.values()) / every, float(applied.mean()) if len(applied) else 0.0, stopped,
                         max(compute_means(it, WARMUP_STEPS).values()) / every, trial_lead(it, up))


def trial_lead(iterations: np.ndarray, updates: np.ndarray) -> int:
    """The largest lead of a worker over the slowest one still running in a trial (-1: no rows), the measure
    ssp's and dssp's bounds hold for (:func:`~hpcps.analysis.report.max_clock_gap`), its steps counted from
    the trial's first: a leg going on from the trial before starts every worker at that one's end."""
    if not len(iterations):
        return -1
    rows = iterations.copy()
    rows["step"] -= rows["step"].min()
    return max_clock_gap(rows, updates, steps=int(rows["step"].max()) + 1)


def run_chosen(cfg: TrainConfig, comm: MPI.Comm, train, trial=None) -> tuple[TrainConfig, Any]:
    """Collective: ``train(cfg, comm)`` (a run, its result on rank 0); under ``--paradigm auto`` the trials first
    (``trial(cfg, comm, leg=...)``, default ``train``), then the run under the paradigm chosen, going on from
    where the trials left the model (:func:`choose_paradigm`), its choice kept in its run file. Returns the
    options the run ran with (as typed: the paradigm chosen in place of auto), and its result."""
    if cfg.paradigm != paradigm_choice.AUTO:
        return cfg, train(cfg, comm)
    link_bps = _link(cfg, comm)  # (once for every leg)
    folder = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcps-auto-") if comm.rank == 0 else None, root=0))
    try:
        chosen, choice, start = choose_paradigm(cfg, comm, trial or train, folder, link_bps=link_bps)
        # from the trials' checkpoint, if they trained, read at the run's start: the folder goes once every
        # rank has started, as it has once rank 0's run is over (its end waits for every rank's last rows). No
        # barrier on comm here: under run-through it may hold a rank that died in the run (every living rank
        # failed in it), and under --respawn the job went on without it, on a grown communicator
        run = chosen if start is None else chosen.model_copy(update={"resume": start})
        result = train(run, comm, leg=Leg(link_bps=link_bps))
    finally:
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    if result is not None:  # (in every part's file of a run a death stopped and a newcomer resumed: --respawn)
        for k, path in enumerate((*result.earlier, result.path)):
            keep_choice(path, choice, chosen, went_on=start is not None and k == 0)
    return chosen, result


def _link(cfg: TrainConfig, comm: MPI.Comm) -> float | None:
    """Collective: the link between nodes, where the job spans nodes and the defaults read it
    (:func:`hpcps.check.probe.link_between_nodes`); else None."""
    from hpcps.check.probe import link_between_nodes
    from hpcps.cluster.placement import node_ids
    from hpcps.options.defaults import needs_link

    nodes = node_ids(comm)
    return link_between_nodes(comm, nodes) if needs_link(cfg, nodes) else None


def choose_paradigm(cfg: TrainConfig, comm: MPI.Comm, train, folder: Path | None = None, *,
                    link_bps: float | None = None) -> tuple[TrainConfig, str, str | None]:
    """Collective, for ``--paradigm auto``: a trial of ``--trial-steps`` steps under each paradigm of
    ``--paradigms`` that could be chosen (:func:`hpcps.options.paradigm_choice.skip`; ``train(cfg, comm,
    leg=...)``: a run, its result on rank 0), then ``cfg`` under the one chosen
    (:func:`hpcps.options.paradigm_choice.choose`), the choice as the run file keeps it (JSON), and the
    checkpoint the run goes on from (None: from the start). Rank 0 logs the trials' table. ``link_bps``:
    the link between nodes, measured once for every trial (None: each measures it where it needs it).

    With a ``folder`` for their files and ``--steps`` to spare, the trials train: each goes on from where
    the last one ended (:class:`~hpcps.runtime.plan.Leg`), on the run's own data schedule and learning-rate
    horizon, and the run goes on from the last one's end, so the trials' steps are steps of the training
    (:func:`_trials_that_train`). Otherwise each trial starts from the model's start and the run does too."""
    options = {o.paradigm: o for o in paradigm_choice.candidates(cfg)}
    cfg = _with_trial_steps(cfg, len(options), comm)
    said, narrowed = paradigm_choice.caution(cfg), paradigm_choice.narrowing(cfg)
    if said and comm.rank == 0:
        log.warning("%s", said)
    if narrowed and comm.rank == 0:
        log.info("%s", narrowed)
    began = time.monotonic()
    if folder is not None and _trains(cfg, len(options)):
        trials, skipped, start, trained = _trials_that_train(cfg, options, comm, train, folder, link_bps)
    else:
        if folder is not None and comm.rank == 0:
            log.info("--paradigm auto: the trials do not train (they start from the model's start, and so does the "
                     "run): %s", "the run's steps are not known before it starts (--epochs)" if cfg.steps is None
                     else f"--steps {cfg.steps} leave none to the run after {len(options)} trials of "
                          f"{cfg.trial_steps} steps")
        (trials, skipped), start, trained = _paradigm_trials(cfg, options, comm, train, folder, link_bps), None, 0
    seconds = time.monotonic() - began
    chosen = paradigm_choice.choose(trials)  # (the same trials on every rank: the same answer, or error)
    if comm.rank == 0:
        went_on = f"; the run goes on from the {trained} steps they trained" if trained else ""
        untried = f" (not tried: {', '.join(skipped)})" if skipped else ""
        log.info("--paradigm auto: %s, the most batches a second (or within %.0f%% of it and less stale); the "
                 "trials took %.1f s%s%s:\n%s", chosen.paradigm, paradigm_choice.MARGIN * 100, seconds, untried,
                 went_on, "\n".join(paradigm_choice.table(trials, chosen)))
    return (options[chosen.paradigm],
            paradigm_choice.record(trials, chosen, cfg.trial_steps, seconds, trained, skipped,
                                   paradigm_choice.left_out(cfg)), start)


def _with_trial_steps(cfg: TrainConfig, n_trials: int, comm: MPI.Comm) -> TrainConfig:
    """``cfg`` with the steps of each of up to ``n_trials`` trials (:func:`~hpcps.options.paradigm_choice.trial_steps`),
    rank 0 saying where they are fewer than the default."""
    steps, why = paradigm_choice.trial_steps(cfg, n_trials)
    if why and comm.rank == 0:
        log.info("%s", why)
    return cfg.model_copy(update={"trial_steps": steps})


def _trains(cfg: TrainConfig, n_trials: int) -> bool:
    """Whether ``cfg``'s trials can train: its steps known before the run (``--steps``), with some left to
    the run after every trial's."""
    return cfg.steps is not None and cfg.steps > n_trials * cfg.trial_steps


def _each_trial(options: dict[str, TrainConfig], comm: MPI.Comm, run_one) \
        -> tuple[list[ParadigmTrial], dict[str, str]]:
    """Collective: ``run_one(k, n, option)``, the ``k``-th trial of at most ``n`` (its measure, every rank
    alike), for each paradigm of ``options`` in :func:`~hpcps.options.paradigm_choice.trial_order`, but
    those that could not be chosen after the trials before (:func:`~hpcps.options.paradigm_choice.skip`),
    each said in one line. Returns the measures, and the paradigms not tried with why."""
    trials, skipped = [], {}
    for paradigm in paradigm_choice.trial_order(list(options)):
        why = paradigm_choice.skip(paradigm, trials, bound=options[paradigm].s_lo)  # (every rank alike)
        if why is None:
            trials.append(run_one(len(trials) + 1, len(options) - len(skipped), options[paradigm]))
            continue
        skipped[paradigm] = why
        if comm.rank == 0:
            log.info("--paradigm auto: no trial of %s: %s", paradigm, why)
    return trials, skipped


def _trials_that_train(cfg: TrainConfig, options: dict[str, TrainConfig], comm: MPI.Comm, train, folder: Path,
                       link_bps: float | None) -> tuple[list[ParadigmTrial], dict[str, str], str | None, int]:
    """Collective: each paradigm's trial (:func:`_each_trial`) as a leg of the training, going on from the last
    one's end (a trial that diverged leaves none: the next goes on from the one before). Returns the
    measures (every rank alike), the paradigms not tried, the last end's checkpoint and the steps per
    worker trained up to it."""
    start, done = None, 0

    def leg(k: int, n: int, option: TrainConfig) -> ParadigmTrial:
        nonlocal start, done
        if comm.rank == 0:
            log.info("--paradigm auto: trial %d of up to %d: %s, steps %d-%d of the training", k, n,
                     option.paradigm, done + 1, done + cfg.trial_steps)
        trial = _trial_options(option, folder, steps=cfg.steps, resume=start,
                               checkpoint_dir=str(folder / option.paradigm))
        mark = deaths_mark()
        result = train(trial, comm, leg=Leg(steps=done + cfg.trial_steps, keep_end=True,
                                                 link_bps=link_bps, trial=True))
        measure = _measure(result, option, comm, mark)
        if not measure.stopped_by:  # it ended at its steps, its checkpoint written
            start = comm.bcast(result.summary["checkpoint"] if comm.rank == 0 else None, root=0)
            done += cfg.trial_steps
        return measure

    trials, skipped = _each_trial(options, comm, leg)
    return trials, skipped, start, done


def _paradigm_trials(cfg: TrainConfig, options: dict[str, TrainConfig], comm: MPI.Comm, train,
                     folder: Path | None = None, link_bps: float | None = None) \
        -> tuple[list[ParadigmTrial], dict[str, str]]:
    """Collective: each paradigm's trial from the model's start (:func:`_each_trial`), its measure (every rank
    alike), and the paradigms not tried. Trials write their run files in ``folder`` (None: a temporary one
    of their own, removed at the end)."""
    own = folder is None
    if own:
        folder = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcps-auto-") if comm.rank == 0 else None, root=0))

    def from_start(k: int, n: int, option: TrainConfig) -> ParadigmTrial:
        if comm.rank == 0:
            log.info("--paradigm auto: trial %d of up to %d: %s, %d steps", k, n, option.paradigm, cfg.trial_steps)
        trial = _trial_options(option, folder, steps=cfg.trial_steps)
        mark = deaths_mark()
        return _measure(train(trial, comm, leg=Leg(link_bps=link_bps, trial=True)), option, comm, mark)

    try:
        trials = _each_trial(options, comm, from_start)
        comm.Barrier()  # (every rank done with the trials' files)
    finally:
        if own and comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return trials


def _trial_options(option: TrainConfig, folder: Path, **update: Any) -> TrainConfig:
    """A paradigm's trial of ``option`` (:data:`TRIAL`, its own divergence watch, no faults), its run file in
    ``folder``, with ``update`` (its steps; a leg's checkpoints)."""
    return option.model_copy(update={**TRIAL, "divergence": option.divergence, "fault": [],
                                      "out": str(folder / f"{option.paradigm}.h5"), **update})


def _measure(result, option: TrainConfig, comm: MPI.Comm, mark: int) -> ParadigmTrial:
    """Collective: a trial's measure from its run file (rank 0's ``result``), on every rank; a trial a
    signal or the loop stopped ends the job, and so does one in which a rank died (run-through; ``mark``:
    :func:`~hpcps.transport.failures.deaths_mark` before it, so that an earlier run's dead in this process
    do not count): the next trial's start would need it."""
    if deaths_since(mark):  # (on every living rank: the trial's end shrank its communicator and found the dead)
        raise UserError(f"--paradigm auto: a rank died in the trial of {option.paradigm}, and every trial runs "
                        f"on every rank; nothing was kept. Launch again, or name a paradigm: its run goes on "
                        f"without a dead worker where the paradigm allows")
    measure = paradigm_trial(result.path, option.paradigm, option.inner_steps or 1) if comm.rank == 0 else None
    measure = comm.bcast(measure, root=0)
    if measure.stopped_by not in ("", "diverged"):  # a signal, the loop: the job ends here
        raise UserError(f"--paradigm auto: stopped in the trial of {option.paradigm} "
                        f"({measure.stopped_by}); nothing was trained")
    return measure


#: a run file's ``resumed_from`` where the run went on from ``--paradigm auto``'s trials
FROM_TRIALS = "the trials of --paradigm auto (their checkpoint removed with them)"


def keep_choice(path: str, choice: str, cfg: TrainConfig, *, went_on: bool = False) -> None:
    """Rank 0, after a run under ``--paradigm auto``: ``choice`` in the run file (attribute
    ``paradigm_choice``), with the run's own batches a second and mean step beside the prediction.
    ``went_on``: the run went on from the trials' checkpoint, which is gone with their folder: its file
    says so (``resumed_from``), and its config resumes nothing (the same command trains from the start)."""
    run = paradigm_trial(path, cfg.paradigm, cfg.inner_steps or 1)
    with h5py.File(path, "a") as f:
        f.attrs["paradigm_choice"] = paradigm_choice.with_measure(choice, run.batches_per_s, run.mean_step_s)
        if went_on:
            config = json.loads(f.attrs["config"])
            config["resume"] = None
            f.attrs["config"] = json.dumps(config, sort_keys=True)
            f.attrs["resumed_from"] = FROM_TRIALS
