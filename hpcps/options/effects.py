"""Which options take effect in a run, checked once at start-up (pure: no MPI).

Each part of hpcps that reads options declares them here: a paradigm
(:meth:`hpcps.policies.base.Policy.reads_options`, built-in or plug-in), a
feature (a schedule, an optimizer, the emulated compute, group servers, the
progress line), the built-in loop. :func:`refuse` raises one
:class:`~hpcps.errors.UserError` for a combination that cannot work;
:func:`no_effect` lists, one line each, the options the user set that nothing
in this run reads. Those stay warnings: sweeping one set of flags over every
paradigm is how paradigms are compared.

:func:`hpcps.options.planning.plan` calls :func:`refuse` (so ``hpcps jobs
render`` refuses what ``hpcps train`` would), and rank 0 logs
:func:`no_effect`'s lines as the run starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hpcps.options.config import TrainConfig
from hpcps.errors import UserError

#: ``hpcps.init`` files the run's data as this (the loop brings its own batches)
OWN_LOOP = "own-loop"


def flag(option: str) -> str:
    """How the command line spells a config field (``--staleness-max``); the Python API's keyword is the field."""
    return "--" + option.replace("_", "-")


def own_loop(cfg: TrainConfig) -> bool:
    """Whether the workers run the user's own loop (``hpcps.init``) rather than hpcps's."""
    return cfg.dataset == OWN_LOOP


@dataclass(frozen=True)
class Reader:
    """A part of a run that reads ``options`` (config fields), and whether it runs in a given run."""

    name: str
    options: frozenset[str]
    runs: Callable[[TrainConfig], bool]


#: the features that read options of their own (a paradigm's are the policy class's: :func:`paradigm_readers`)
FEATURES: tuple[Reader, ...] = (
    Reader("the step schedule (--lr-schedule step)", frozenset({"lr_step_every", "lr_gamma"}),
           lambda cfg: cfg.lr_schedule == "step"),
    Reader("adam and adamw (--optimizer)", frozenset({"betas", "eps"}), lambda cfg: cfg.optimizer != "sgd"),
    # the rule acts on every param group with a momentum at an update: --momentum's, a param group's own
    # (param_groups), one the loop sets through ps.optimizer, or an optimizer factory's: only adam and adamw
    # (no momentum key) and Delayed Nesterov's period are known not to have one
    Reader("sgd with a momentum (--momentum, a param group's, ps.optimizer's; not with --momentum-period)",
           frozenset({"stale_momentum"}), lambda cfg: cfg.optimizer == "sgd" and cfg.momentum_period == 1),
    Reader("local steps (--local-steps; --paradigm localsgd, diloco)",
           frozenset({"inner_optimizer", "inner_lr", "inner_momentum", "inner_weight_decay", "local_steps_by_speed",
                      "overlap_steps"}),
           lambda cfg: cfg.inner_steps is not None),
    Reader("the emulated compute's jitter (--jitter)", frozenset({"jitter_cv"}), lambda cfg: cfg.jitter != "none"),
    # (the trials and the run under the paradigm chosen have neither set: hpcps.options.paradigm_choice.as_chosen)
    Reader("--paradigm auto, and hpcps tune", frozenset({"paradigms", "trial_steps"}), lambda cfg: cfg.paradigm == "auto"),
    Reader("group servers (--groups)", frozenset({"group_by"}), lambda cfg: cfg.groups > 0),
    Reader("the progress line (--progress)", frozenset({"progress_every"}), lambda cfg: cfg.progress),
    Reader("hpcps's timed evaluation (hpcps train, hpcps.train; not with --eval-every)", frozenset({"eval_interval"}),
           lambda cfg: not own_loop(cfg) and cfg.eval_every is None),
    Reader("hpcps's evaluation (hpcps train, hpcps.train; under hpcps.init the loop evaluates: ps.evaluated)",
           frozenset({"eval_every", "log_every"}), lambda cfg: not own_loop(cfg)),
)


def paradigm_readers(cfg: TrainConfig, paradigm: type) -> list[Reader]:
    """The run's paradigm (``paradigm``, the class ``cfg.paradigm`` names) as a reader, and the built-in ones
    as the readers that would read what it does not."""
    from hpcps.policies import paradigms

    readers = [Reader(f"--paradigm {cfg.paradigm}", paradigm.reads_options(), lambda _cfg: True)]
    for name, cls in paradigms().items():
        if name != cfg.paradigm:
            readers.append(Reader(name, cls.reads_options(), lambda _cfg: False))
    return readers


def no_effect(cfg: TrainConfig, paradigm: type) -> list[str]:
    """One line for each option the user set (on the command line, in the file, as a keyword) that no part
    of this run (of paradigm class ``paradigm``) reads, naming what would read it."""
    readers = [*paradigm_readers(cfg, paradigm), *FEATURES]
    lines = []
    for option in sorted(cfg.model_fields_set):
        readers_of = [r for r in readers if option in r.options]
        if not readers_of or any(r.runs(cfg) for r in readers_of):
            continue
        paradigms = [r.name for r in readers_of if r.name in _builtin_names()]
        if paradigms:
            lines.append(f"{flag(option)} has no effect under --paradigm {cfg.paradigm}: "
                         f"it is read by {_and(paradigms)}")
        else:
            names = _and([r.name for r in readers_of])
            lines.append(f"{flag(option)} has no effect in this run: it is read by {names}")
    return lines


def _builtin_names() -> tuple[str, ...]:
    from hpcps.policies import paradigms

    return tuple(paradigms())


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


@dataclass(frozen=True)
class Refusal:
    """A combination that cannot work: ``applies(cfg, paradigm class)`` says whether this run is one, and
    ``message(cfg)`` is its one line."""

    applies: Callable[[TrainConfig, type], bool]
    message: Callable[[TrainConfig], str]


def _periodic(cfg: TrainConfig) -> str | None:
    return "--checkpoint-every" if cfg.checkpoint_every else "--checkpoint-interval" if cfg.checkpoint_interval \
        else None


HALF_PULLS = ("bf16", "fp16")  # --compress values whose pulls read the window's 16-bit copies


def partitioned(cfg: TrainConfig) -> bool:
    """Whether the user asked for partitions of a size (``auto`` chooses only where they can run)."""
    return cfg.partition_mb != "auto" and cfg.partition_mb > 0


#: the combinations refused at start-up, in the order they are checked (the first that applies is the line)
REFUSALS: tuple[Refusal, ...] = (
    Refusal(lambda cfg, cls: bool(cfg.groups) and not cls.uses_groups,
            lambda cfg: f"--groups {cfg.groups}: paradigm {cfg.paradigm!r} does not use group servers"),
    Refusal(lambda cfg, cls: cls.uses_groups and not cfg.groups,
            lambda cfg: f"--paradigm {cfg.paradigm} needs --groups G (1 or more group servers)"),
    Refusal(lambda cfg, cls: _periodic(cfg) is not None and cls.periodic_cut() is None,
            lambda cfg: f"{_periodic(cfg)}: --paradigm {cfg.paradigm} holds gradients its own way, and periodic "
                        f"checkpoints cut only paradigms that hold rounds or apply every gradient on arrival "
                        f"(every built-in one); a run of it writes one when SIGUSR1, SIGTERM or Ctrl-C stops it"),
    Refusal(lambda cfg, cls: partitioned(cfg) and cls.eager_pull,
            lambda cfg: f"--partition-mb: --paradigm {cfg.paradigm} pulls behind its computation already (and "
                        f"swaps the whole pull in); partitioned pulls are for paradigms that pull between steps"),
    Refusal(lambda cfg, cls: bool(cfg.checkpoint_interval) and cls.checkpoints_at_publish(),
            lambda cfg: f"--checkpoint-interval: --paradigm {cfg.paradigm} checkpoints at a round's close, where "
                        f"every worker waits: give --checkpoint-every ROUNDS"),
    Refusal(lambda cfg, cls: cfg.inner_steps is not None and (cls.eager_pull or cls.extra_gradients or cls.uses_groups),
            lambda cfg: f"--local-steps: --paradigm {cfg.paradigm} does not take local steps; they are for the "
                        f"paradigms whose rule is over the workers' clocks, which then count outer rounds: bsp "
                        f"(lock-step), ssp and dssp (bounded), asp (free), localsgd and diloco"),
    Refusal(lambda cfg, cls: cfg.inner_steps is not None and cfg.overlap_steps >= cfg.inner_steps,
            lambda cfg: f"--overlap-steps {cfg.overlap_steps}: a worker takes the new parameters after that many "
                        f"steps of its next round, so it must be less than the round's {cfg.inner_steps} local "
                        f"steps (--local-steps)"),
    Refusal(lambda cfg, cls: cfg.pull == "send" and not cls.releases_rounds(),
            lambda cfg: f"--pull send: --paradigm {cfg.paradigm} does not release every worker at a round's close; "
                        f"the shards send a round's parameters under bsp and its presets (localsgd, diloco)"),
    Refusal(lambda cfg, cls: cfg.pull == "send" and cfg.compress in HALF_PULLS,
            lambda cfg: f"--pull send with --compress {cfg.compress}: the shards send fp32 values, and a 16-bit "
                        f"pull reads the window's 16-bit copies: give one or the other"),
    Refusal(lambda cfg, cls: cfg.pull == "send" and bool(cfg.shards_at_once),
            lambda cfg: f"--pull send with --shards-at-once {cfg.shards_at_once}: a shard sends a round to every "
                        f"worker at once, and a worker takes every shard's at once; the rotation is for reads and "
                        f"pushes: give one or the other"),
    Refusal(lambda cfg, cls: cfg.pull == "send" and cfg.inner_steps is not None and bool(cfg.overlap_steps),
            lambda cfg: "--pull send with --overlap-steps: a worker that overlaps takes its round's parameters "
                        "when its first steps are done, out of the window; give one or the other"),
    Refusal(lambda cfg, cls: bool(cfg.spare_workers) and not (cls.takes_spares and cls.runs_through),
            lambda cfg: f"--spare-workers: --paradigm {cfg.paradigm} does not take a spare in a dead worker's "
                        f"place mid-run; the asynchronous paradigms do (asp, ssp, dssp, eager): a round (bsp, "
                        f"localsgd, diloco) would not know which of its rounds the newcomer's first push is for"),
    Refusal(lambda cfg, cls: bool(cfg.spare_workers) and own_loop(cfg),
            lambda cfg: "--spare-workers: a spare takes a dead worker's place in hpcps's own loop (hpcps train, "
                        "hpcps.train); a loop of your own (hpcps.init) would have to start on a spare mid-run"),
    Refusal(lambda cfg, cls: bool(cfg.spare_workers) and cfg.local_steps_by_speed,
            lambda cfg: "--spare-workers with --local-steps-by-speed: the workers time their first round "
                        "together, which a spare that joins later cannot"),
    Refusal(lambda cfg, cls: cfg.respawn and not (cls.takes_spares and cls.runs_through),
            lambda cfg: f"--respawn: --paradigm {cfg.paradigm} does not resume a dead worker's place with a "
                        f"newcomer; the asynchronous paradigms do (asp, ssp, dssp, eager), as with --spare-workers"),
    Refusal(lambda cfg, cls: cfg.respawn and bool(cfg.spare_workers),
            lambda cfg: "--respawn with --spare-workers: a spare takes a dead worker's place without a stop, a "
                        "respawn after one; give one or the other"),
    Refusal(lambda cfg, cls: cfg.respawn and own_loop(cfg),
            lambda cfg: "--respawn: the job resumes hpcps's own loop (hpcps train) with a newcomer; a loop of "
                        "your own (hpcps.init) would have to be started on it"),
    Refusal(lambda cfg, cls: cfg.respawn and cfg.local_steps_by_speed,
            lambda cfg: "--respawn with --local-steps-by-speed: the workers time their first round together, "
                        "which a resumed run does not do again"),
    Refusal(lambda cfg, cls: own_loop(cfg) and cfg.group_by == "speed",
            lambda cfg: "groups by speed time hpcps's own loop; under hpcps.init give groups by rank"),
)


def refuse(cfg: TrainConfig, paradigm: type) -> None:
    """Raise one UserError for the first combination of ``cfg`` (of paradigm class ``paradigm``) that cannot
    work (see :data:`REFUSALS`)."""
    for refusal in REFUSALS:
        if refusal.applies(cfg, paradigm):
            raise UserError(refusal.message(cfg))
