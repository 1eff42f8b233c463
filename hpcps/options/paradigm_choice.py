"""``--paradigm auto``: the paradigms a job may be given, and which one its trials choose (pure: no MPI).

A run under ``--paradigm auto`` first runs ``--trial-steps`` steps of each paradigm of ``--paradigms``
on the job's own model, data and ranks, each going on from the last (:func:`hpcps.runtime.tune.choose_paradigm`),
then trains under the one that trained the most batches a second, as if the user had typed it, going
on from the trials' steps.

Why batches a second is time to a loss here: under ``--lr-scaling auto`` (the default) every paradigm
takes the same step per training sample (bsp's ``--lr`` over a round, each asynchronous gradient its
share), and ``--stale-momentum auto`` lowers the momentum by what staleness adds. With both, bsp, asp,
ssp and dssp reached the same accuracy per sample on MNIST-1D's CNN (0.916-0.933, three seeds), and
their order by iterations a second was their order by time to 85% accuracy, in both scenarios
measured: dssp, ssp, asp, bsp without a straggler (156, 141, 138, 112 iterations/s; 3.00, 3.30, 3.49,
3.52 s) and asp, bsp, ssp, dssp with a 3x straggler (173, 90, 87, 83; 2.97, 4.32, 4.61, 5.17 s)
(docs/results.md, *asp reads its own writes*). Where the trials cannot tell two paradigms apart
(:data:`MARGIN`), the less stale one is chosen: fewer stale gradients, less to lose on a model no one
tuned.

Not every trial need run (:func:`trial_order`, :func:`skip`): asp's goes first, and a paradigm that holds
its workers near the slowest one's clock (:data:`BOUNDED`) is not tried where it cannot be chosen. In a
long run each of its workers goes at most at the slowest one's pace, one step per that worker's compute,
so its batches a second are at most the workers over the slowest one's compute a step
(:func:`ceiling`); below the fastest trial's less the margin, it could not be chosen. And ssp and dssp are
asp with waits added, no faster than asp: where bsp is within the margin of the fastest, bsp (the least
stale) is chosen whatever their trials would say. With a 3x straggler in the box, asp's trial alone
settled it (bsp, ssp, dssp at most 0.65-0.68x of asp); with workers alike, asp's and bsp's did
(docs/results.md, *Choosing the paradigm by trial*).

With Adam or AdamW on the shards the rule is not measured to hold (a language model trained less per
sample under the asynchronous paradigms): auto chooses from bsp alone unless told (:func:`choices`).

Not among the choices: the local-SGD family and ``--local-steps`` presets (a push is worth H steps),
eager (its staleness-scaled rates end lower at the same flags: 0.79 against bsp's 0.92 there), hsp
(its extra gradients are updates beyond bsp's), grouped (it changes the ranks' roles) and plug-ins
(their worth per step is their own).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

from hpcps.errors import UserError
from hpcps.options.config import CHOOSABLE, TrainConfig
from hpcps.options.words import without_options
from hpcps.policies import policy_class

AUTO = "auto"
#: options read only by ``--paradigm auto`` (and ``--trial-steps`` by ``hpcps tune``)
AUTO_OPTIONS = frozenset({"paradigms", "trial_steps"})
#: a paradigm is chosen over a less stale one only with this many more batches a second (a share): two
#: trials of one layout fell 1-9% apart in the box (docs/results.md, *No flags against every layout*)
MARGIN = 0.05
#: the paradigms that keep every worker within a bound of the slowest one's clock (a round; a staleness bound)
BOUNDED = ("bsp", "ssp", "dssp")
#: the paradigms that are asp with waits added: each worker's step is asp's or longer
WAITING_ASP = ("ssp", "dssp")


@dataclass(frozen=True)
class ParadigmTrial:
    """One paradigm's trial: its worker count, their mean steps (s, each worker's wall time over its timed
    steps), the mean staleness of the gradients applied, and whether it stopped on its own
    (``stopped_by``: diverged, not learning), and the slowest worker's mean compute a step (s: its
    forward, backward and any ``--compute-time``, no waits; 0: not measured), which bounds what a
    bounded paradigm can reach on these workers (:func:`ceiling`)."""

    paradigm: str
    workers: int
    batches_per_s: float
    mean_step_s: float  # the slowest worker's
    staleness: float
    stopped_by: str = ""
    slowest_compute_s: float = 0.0
    #: the most gradients a worker was ahead of the slowest one (hpcps.runtime.tune.trial_lead; -1: not
    #: measured), which ssp's and dssp's waits would have compared with their bound
    max_lead: int = -1


def check_auto(cfg: TrainConfig) -> None:
    """One :class:`UserError` for ``--paradigm auto`` with options under which its rule does not hold."""
    if cfg.lr_scaling != "auto":
        raise UserError("--paradigm auto ranks the paradigms by batches a second, which is time to a loss only "
                        "where each takes the same step per sample: drop --lr-scaling none, or name a paradigm")
    if cfg.resume:
        raise UserError("--paradigm auto with --resume: resume under the paradigm the first run chose "
                        "(its run file's paradigm attribute, and its first log lines, name it)")
    if cfg.paradigm_option:
        raise UserError("--paradigm-option is for a paradigm of your own, which --paradigm auto does not choose")


def _single(paradigms: Sequence[str]) -> list[str]:
    """Those of ``paradigms`` whose update is one worker's gradient, not a round's mean: where the trials hand
    over between them and bsp the shards' optimizer starts afresh
    (hpcps.runtime.checkpoints.files.for_paradigm's test)."""
    bsp = policy_class("bsp").updates_per_step(2)
    return [p for p in paradigms if policy_class(p).updates_per_step(2) != bsp]


def choices(cfg: TrainConfig) -> tuple[str, ...]:
    """The paradigms ``cfg``'s trials choose from: ``--paradigms`` where the user gave them or the shards run
    sgd, else (Adam, AdamW) bsp's kind alone. On a language model on AdamW the asynchronous paradigms
    trained less per sample than bsp at every rate tried, so a trial's batches a second overrated them and
    auto chose one 1.78x slower to the target (docs/results.md, *A third workload*): where the rule is not
    measured to hold, auto does not bet on it unasked."""
    if cfg.optimizer == "sgd" or "paradigms" in cfg.model_fields_set:
        return cfg.paradigms
    single = _single(cfg.paradigms)
    return tuple(p for p in cfg.paradigms if p not in single) or cfg.paradigms


def left_out(cfg: TrainConfig) -> dict[str, str]:
    """The default choices :func:`choices` left out, each with why in a few words (empty: none), as the run
    file keeps them beside the trials (:func:`record`)."""
    chosen = choices(cfg)
    return {p: f"--optimizer {cfg.optimizer}: trains less per sample than bsp on a language model, which a "
               f"trial's batches a second do not see; --paradigms to try it" for p in cfg.paradigms if p not in chosen}


def narrowing(cfg: TrainConfig) -> str | None:
    """The line that says which default choices :func:`choices` left out and why (None: none left out)."""
    out = list(left_out(cfg))
    if not out:
        return None
    chosen = [p for p in cfg.paradigms if p not in out]  # (choices(cfg), once something is left out)
    return (f"--paradigm auto with --optimizer {cfg.optimizer}: {', '.join(chosen)} alone; with Adam a "
            f"language model trained less per sample under {', '.join(out)}, which a trial's batches a "
            f"second do not see (--paradigms {' '.join(cfg.paradigms)} to try them too)")


def caution(cfg: TrainConfig) -> str | None:
    """What to warn of where the rule's ground is not measured to hold (None: nothing): an adaptive
    optimizer on the shards with bsp and a paradigm of single gradients among the choices the user gave."""
    chosen = choices(cfg)
    single = _single(chosen)
    if cfg.optimizer == "sgd" or "bsp" not in chosen or not single:
        return None
    return (f"--paradigm auto with --optimizer {cfg.optimizer}: batches a second rank time to a loss where each "
            f"paradigm trains as much per sample; with Adam a language model trained less per sample under "
            f"{', '.join(single)} than under bsp, and auto then chose a slower one. If yours is such a model, "
            f"give --paradigms bsp (or the ones you trust)")


#: the trials' steps where ``--trial-steps`` is not given: each trial at most this long, all of them at most
#: :data:`TRIALS_SHARE` of ``--steps``, and none shorter than :data:`MIN_TRIAL_STEPS`
TRIAL_STEPS: int = TrainConfig.model_fields["trial_steps"].default
TRIALS_SHARE = 0.25
#: a trial's shortest default: its first quarter untimed, 8 steps timed
MIN_TRIAL_STEPS = 10


def trial_steps(cfg: TrainConfig, n_trials: int) -> tuple[int, str | None]:
    """Steps a worker in each of up to ``n_trials`` trials, and the line that says why where they are fewer
    than :data:`TRIAL_STEPS` (None: not fewer, or the user's ``--trial-steps``). A fixed 30 is a second on a
    small model but a minute on ResNet-18 at 2 s a step, where four trials of 30 steps outlast a run of 80:
    the trials then cannot train, and the run starts over after them. So, unless given, the trials take at
    most a quarter of ``--steps`` (at least 10 steps each), the run the rest."""
    if "trial_steps" in cfg.model_fields_set or cfg.steps is None:
        return cfg.trial_steps, None
    fit = max(MIN_TRIAL_STEPS, int(cfg.steps * TRIALS_SHARE) // max(n_trials, 1))
    if fit >= TRIAL_STEPS:
        return TRIAL_STEPS, None
    return fit, (f"--paradigm auto: trials of {fit} steps, not {TRIAL_STEPS}: {n_trials} trial(s) of "
                 f"{TRIAL_STEPS} would take {n_trials * TRIAL_STEPS} of --steps {cfg.steps}, more than a quarter "
                 f"(--trial-steps N to set them)")


def candidates(cfg: TrainConfig) -> list[TrainConfig]:
    """``cfg`` under each paradigm of :func:`choices`, as if the user had typed it (:func:`as_chosen`)."""
    check_auto(cfg)
    return [as_chosen(cfg, p) for p in choices(cfg)]


def as_chosen(cfg: TrainConfig, paradigm: str) -> TrainConfig:
    """The options the user set, less ``--paradigms`` and ``--trial-steps``, under ``paradigm``: the run the
    same command with ``--paradigm PARADIGM`` would be (every default derived anew from it)."""
    given = {name: getattr(cfg, name) for name in cfg.model_fields_set - AUTO_OPTIONS - {"paradigm"}}
    return TrainConfig(**given, paradigm=paradigm)


def without_auto(words: Sequence[str]) -> list[str]:
    """Command-line ``words`` less ``--paradigm auto``, ``--paradigms ...`` and ``--trial-steps N`` (a
    command printed for one paradigm)."""
    return without_options(words, one=("--paradigm", "--trial-steps"), many=("--paradigms",))


def choose(trials: Sequence[ParadigmTrial]) -> ParadigmTrial:
    """The trial to train as: the most batches a second among those that did not stop on their own, or a
    less stale one within :data:`MARGIN` of it."""
    live = [t for t in trials if not t.stopped_by]
    if not live:
        said = "; ".join(f"{t.paradigm}: {t.stopped_by}" for t in trials)
        raise UserError(f"--paradigm auto: every paradigm's trial stopped on its own ({said}); lower --lr, or "
                        f"add a warm-up (--warmup-steps)")
    fastest = max(t.batches_per_s for t in live)
    close = [t for t in live if t.batches_per_s >= (1 - MARGIN) * fastest]
    return min(close, key=lambda t: (t.staleness, CHOOSABLE.index(t.paradigm)))


def trial_order(paradigms: Sequence[str]) -> list[str]:
    """The order the trials run in: asp first (its trial bounds what the others can reach), then the others
    as given."""
    return sorted(paradigms, key=lambda p: p in BOUNDED)


def ceiling(trial: ParadigmTrial) -> float:
    """The most batches a second a paradigm of :data:`BOUNDED` can train on ``trial``'s workers in a long run:
    each of them at the slowest one's pace, at most one step per its compute (inf: compute not measured)."""
    return trial.workers / trial.slowest_compute_s if trial.slowest_compute_s > 0 else float("inf")


def skip(paradigm: str, trials: Sequence[ParadigmTrial], bound: int | None = None) -> str | None:
    """Why ``paradigm``'s trial need not run after ``trials`` (None: it must run): it could not be chosen,
    since :func:`choose` takes the most batches a second or a less stale one within :data:`MARGIN` of it,
    or it would replay a trial that diverged.

    - ssp or dssp (``bound``: their clock-gap bound, dssp's lower one) where asp's trial diverged with no
      worker more than ``bound`` gradients ahead of the slowest: their waits would not have come into
      play, and their updates would have been asp's. ResNet-18 at bsp's settings in the box: asp's
      trials diverged with its workers at most 2 ahead, and ssp's and dssp's after them did too (about
      20 s each, for nothing), as did their own runs, at most 1-2 ahead.

    - A :data:`BOUNDED` paradigm whose :func:`ceiling`, at the highest any trial measured, is below the
      fastest trial's batches a second less the margin.
    - ssp or dssp (asp with waits: at most asp's batches a second) where asp's trial ran and bsp's, the
      least stale, is within the margin of the fastest: bsp is chosen whatever their trials say.
    """
    asp = next((t for t in trials if t.paradigm == "asp"), None)
    if paradigm in WAITING_ASP and asp is not None and asp.stopped_by == "diverged" and bound is not None \
            and 0 <= asp.max_lead <= bound:
        return (f"asp's trial diverged with no worker more than {asp.max_lead} gradient(s) ahead of the slowest, "
                f"within {paradigm}'s bound of {bound}: its waits would not have come into play, and its updates "
                f"would have been asp's")
    live = [t for t in trials if not t.stopped_by]
    if not live or paradigm not in BOUNDED:
        return None
    fastest = max(live, key=lambda t: t.batches_per_s)
    bar = (1 - MARGIN) * fastest.batches_per_s
    top = max(live, key=ceiling)
    if ceiling(top) < bar:
        return (f"at most {ceiling(top):.1f} batches/s, its workers at the slowest one's pace "
                f"({top.slowest_compute_s * 1e3:.1f} ms of compute a step in {top.paradigm}'s trial), more than "
                f"{MARGIN:.0%} short of {fastest.paradigm}'s {fastest.batches_per_s:.1f}")
    tried = {t.paradigm: t for t in live}
    if paradigm in WAITING_ASP and "asp" in tried and "bsp" in tried and tried["bsp"].batches_per_s >= bar:
        bsp = f"bsp's {tried['bsp'].batches_per_s:.1f} batches/s " + (
            "are the most" if fastest is tried["bsp"] else
            f"are within {MARGIN:.0%} of {fastest.paradigm}'s {fastest.batches_per_s:.1f}")
        return (f"{bsp}, and {paradigm}, asp with waits, would be no faster than asp's "
                f"{tried['asp'].batches_per_s:.1f}: bsp, the least stale, is chosen")
    return None


def table(trials: Sequence[ParadigmTrial], chosen: ParadigmTrial) -> list[str]:
    """The trials as a Markdown table, most batches a second first, the chosen one marked."""
    lines = ["| paradigm | workers | batches/s | slowest worker's mean step ms | mean staleness | |",
             "|---|---|---|---|---|---|"]
    for t in sorted(trials, key=lambda t: -t.batches_per_s):
        mark = "chosen" if t is chosen else f"stopped: {t.stopped_by}" if t.stopped_by else ""
        lines.append(f"| {t.paradigm} | {t.workers} | {t.batches_per_s:.1f} | {t.mean_step_s * 1e3:.1f} | "
                     f"{t.staleness:.2f} | {mark} |")
    return lines


def record(trials: Sequence[ParadigmTrial], chosen: ParadigmTrial, trial_steps: int, seconds: float,
           trained: int = 0, skipped: dict[str, str] | None = None, left: dict[str, str] | None = None) -> str:
    """The choice as the run file keeps it (JSON): the trials, how long they took in all (``seconds``: the
    wait before the run), the steps per worker they trained that the run went on from (``trained``), the
    paradigms not tried and why (``skipped``: :func:`skip`, after the trials before; ``left``: :func:`left_out`,
    before any), the one chosen and what it predicts of the run (its batches a second and mean step); the
    run's own measure is added at its end (:func:`with_measure`)."""
    return json.dumps({"chosen": chosen.paradigm, "trial_steps": trial_steps, "trials_s": seconds,
                       "trained_steps": trained, "skipped": skipped or {}, "left_out": left or {},
                       "predicted": {"batches_per_s": chosen.batches_per_s, "mean_step_s": chosen.mean_step_s},
                       "trials": [asdict(t) for t in trials]}, sort_keys=True)


def with_measure(choice: str, batches_per_s: float, mean_step_s: float) -> str:
    """``choice`` (:func:`record`'s JSON) with the run's own batches a second and mean step beside the
    prediction."""
    values = json.loads(choice)
    values["measured"] = {"batches_per_s": batches_per_s, "mean_step_s": mean_step_s}
    return json.dumps(values, sort_keys=True)


def describe(choice: dict) -> str:
    """One line for a run file's recorded choice (``hpcps report``): what it chose of what, the prediction
    and the run's measure."""
    tried = ", ".join(f"{t['paradigm']} {t['batches_per_s']:.1f}" for t in choice["trials"])
    trained = f", the run going on from their {choice['trained_steps']} steps" if choice.get("trained_steps") else ""
    untried = f", not tried: {', '.join(choice['skipped'])}" if choice.get("skipped") else ""
    left = f", left out: {', '.join(choice['left_out'])}" if choice.get("left_out") else ""
    line = (f"auto: {choice['chosen']} (trials of {choice['trial_steps']} steps in {choice['trials_s']:.1f} s, "
            f"batches/s: {tried}{untried}{left}{trained}); "
            f"predicted {choice['predicted']['batches_per_s']:.1f} batches/s")
    if "measured" in choice:
        line += f", measured {choice['measured']['batches_per_s']:.1f}"
    return line
