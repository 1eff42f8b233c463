"""``hpcps train`` configuration: one validated object from TOML and flags.

Precedence: built-in defaults < ``--config FILE`` (TOML) < command-line
flags. Keys in the file are the long option names, with ``-`` or ``_``
(``batch-size = 64`` or ``batch_size = 64``). Validation happens once, here,
and every message names the option it is about.
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hpcps.errors import UserError
from hpcps.options.faults import Fault, parse_fault
from hpcps.options.targets import Target

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_STEPS = 500
DEFAULT_LR = {"sgd": 0.1, "adam": 1e-3, "adamw": 1e-3}
DEFAULT_STALENESS = 2
#: the local-SGD family (:mod:`hpcps.policies.local`): ``--local-steps`` when the user gives none
DEFAULT_LOCAL_STEPS = 8
#: the outer optimizer a preset of the family takes where the user sets none (``--lr``, ``--momentum``,
#: ``--nesterov``): localsgd averages (sgd at rate 1), diloco steps with Nesterov sgd (Douillard et al. 2023)
FAMILY_OUTER = {"localsgd": {"lr": 1.0, "momentum": 0.0, "nesterov": False},
                "diloco": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}
#: ``--lr`` of an outer sgd under ``--local-steps`` with another paradigm: the round's change as it is, localsgd's
OUTER_SGD_LR = FAMILY_OUTER["localsgd"]["lr"]
AUTO_GROUPS = 2  # --groups auto
#: the paradigms --paradigm auto may choose (hpcps.options.paradigm_choice), least stale first
CHOOSABLE = ("bsp", "ssp", "dssp", "asp")
DEFAULT_STALL_ABORT = 600.0  # seconds: a hung rank must not burn a whole allocation


def local_steps_of(paradigm: str | None, local_steps: int | None) -> int | None:
    """Local steps per outer round: ``--local-steps``, else :data:`DEFAULT_LOCAL_STEPS` under a preset of the
    local-SGD family; None: no local steps (every step's gradient is pushed)."""
    if local_steps is not None:
        return local_steps
    return DEFAULT_LOCAL_STEPS if paradigm in FAMILY_OUTER else None


def outer_rounds(steps: int, every: int) -> int:
    """Outer rounds (pushes) of a worker that takes ``steps`` inner steps, ``every`` per round: the last
    round is shorter where ``every`` does not divide ``steps``."""
    return -(-steps // every)


class TrainConfig(BaseModel):
    """Everything a training run needs to know; see ``hpcps train --help``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    paradigm: str = "dssp"  # a built-in name, or your own: pkg.mod:Class, path/file.py:Class (hpcps.policies)
    paradigm_option: dict[str, Any] = Field(default_factory=dict)  # NAME=VALUE: your paradigm's own options
    paradigms: tuple[str, ...] = CHOOSABLE  # what --paradigm auto's trials choose from
    trial_steps: int = Field(30, ge=2)  # steps per worker in a trial (--paradigm auto, hpcps tune)
    #: "auto": one shard per node when the job spans nodes, else 1 (hpcps.options.defaults)
    servers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    groups: int = Field(0, ge=0)  # "auto" on input: 2 groups by speed
    spare_workers: int = Field(0, ge=0)  # the last ranks: idle until a worker dies (run-through), then in its place
    respawn: bool = False  # a worker's death (run-through) stops the run, which resumes with a spawned newcomer
    group_by: Literal["rank", "speed"] = "rank"
    placement: Literal["spread", "rank"] = "spread"
    model: str = "mlp"  # a built-in name, or a plug-in: pkg.mod:name, path/file.py:name
    hidden: int | None = Field(None, ge=1)  # None: the model's own default
    dataset: str = "digits"  # a built-in name, an HDF5 file, or a plug-in
    loss: str = "cross_entropy"  # a built-in name, or a plug-in
    steps: int | None = Field(None, ge=1)
    epochs: int | None = Field(None, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(0.1, gt=0)  # default by optimizer: see _default_lr
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    momentum: float = Field(0.0, ge=0)
    stale_momentum: Literal["auto", "none"] = "auto"  # auto: momentum less what staleness adds (training.momentum)
    nesterov: bool = False
    momentum_period: int = Field(1, ge=1)  # >1: Delayed Nesterov (hpcps.training.delayed)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    #: the built-in optimizers' kernel: None, torch's fused one where it has it (hpcps.training.optim.FUSED);
    #: False, torch's default (a plain torch.optim.AdamW(params)'s, to the last bit); True, fused or refused
    fused: bool | None = None
    lr_schedule: Literal["constant", "step", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    lr_step_every: int | None = Field(None, ge=1)
    lr_gamma: float = Field(0.1, gt=0)
    min_lr: float | None = Field(None, ge=0)  # cosine's floor, as a learning rate
    clip_norm: float | None = Field(None, gt=0)
    lr_scaling: Literal["auto", "none"] = "auto"  # auto: --lr is BSP's step per sample (Policy.lr_scale)
    lr_staleness: Literal["none", "inverse", "sqrt", "exp"] | None = None
    staleness: int | None = Field(None, ge=0)  # None: 2 for ssp/dssp, no bound for eager
    staleness_max: int | None = Field(None, ge=0)
    hsp_max_stale: int = Field(1, ge=0)
    local_steps: int | None = Field(None, ge=1)  # None: 8 under localsgd and diloco, else no local steps
    local_steps_by_speed: bool = False  # each worker's H from its speed, timed over the first round
    overlap_steps: int = Field(0, ge=0)  # inner steps of the next round taken while a round's outer step is under way
    inner_optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    inner_lr: float = Field(0.1, gt=0)  # default by --inner-optimizer, as --lr's by --optimizer
    inner_momentum: float = Field(0.0, ge=0)
    inner_weight_decay: float = Field(0.0, ge=0)
    slowdown: dict[int, float] = Field(default_factory=dict)
    compute_time: float | None = Field(None, gt=0)
    compute_forward: float = Field(0.0, ge=0, le=1)  # the share of compute_time spent in the forward pass
    compute_backward: float = Field(0.0, ge=0, le=1)  # and in the backward pass
    jitter: Literal["none", "uniform", "exponential", "lognormal"] = "none"
    jitter_cv: float = Field(0.1, ge=0)
    straggler_episodes: tuple[float, float] | None = None  # (FACTOR, SECONDS)
    seed: int = 0
    out: str | None = None
    target_accuracy: float | None = Field(None, gt=0, le=1)
    target: str | None = None  # METRIC<=VALUE or METRIC>=VALUE (hpcps.options.targets)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cuda_aware: Literal["auto", "yes", "no"] = "auto"
    server_device: Literal["host", "cpu", "cuda"] = "host"  # where central shards step (hpcps.runtime.residence)
    eval_interval: float = Field(0.1, gt=0)
    eval_every: int | None = Field(None, ge=1)  # versions; instead of eval_interval
    log_every: float = Field(5.0, gt=0)  # seconds between the evaluation's console lines
    eval_batch_size: int = Field(256, ge=1)
    save: str | None = None
    test_fraction: float = Field(0.2, gt=0, lt=1)
    threads: int = Field(1, ge=1)
    progress: bool = True
    progress_every: float = Field(30.0, gt=0)
    compress: str = "none"  # none, bf16, fp16, topk:RATIO (hpcps.transport.compress)
    #: 0: whole pulls; else partitioned pulls (hpcps.runtime.partitions); "auto": hpcps.options.defaults
    partition_mb: Annotated[float, Field(ge=0)] | Literal["auto"] = "auto"
    shards_at_once: int = Field(0, ge=0)  # 0: pushes and pulls reach every shard at once; K: K at a time (fan-in)
    #: bsp: workers read a round's values (get) or the shards send them (send); auto: hpcps.options.defaults
    pull: Literal["auto", "get", "send"] = "auto"
    timeline: bool = False  # record every rank's phase spans in /timeline (hpcps.metrics.timeline)
    tensorboard: str | None = None  # rank 0 writes the rows as TensorBoard scalars there too (hpcps.metrics.board)
    nonfinite: Literal["skip", "abort"] = "skip"
    divergence: Literal["stop", "ignore"] = "stop"  # hpcps.training.divergence
    stall_warn: float = Field(60.0, gt=0)
    stall_abort: float = Field(DEFAULT_STALL_ABORT, ge=0)  # 0: never
    checkpoint_every: int | None = Field(None, ge=1)  # versions
    checkpoint_interval: float | None = Field(None, gt=0)  # seconds (paradigms that apply on arrival)
    checkpoint_dir: str | None = None  # None: the run's own (hpcps.runtime.checkpoints.schedule.checkpoint_dir)
    resume: str | None = None
    fault: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _groups_auto(cls, values: Any) -> Any:
        """``--groups auto``: two groups formed by measured speed (the slow workers apart from the fast)."""
        if isinstance(values, dict) and values.get("groups") == "auto":
            if values.get("group_by", "speed") != "speed":
                raise ValueError("--groups auto forms groups by speed; drop --group-by rank")
            values = {**values, "groups": AUTO_GROUPS, "group_by": "speed"}
        return values

    @model_validator(mode="before")
    @classmethod
    def _default_lr(cls, values: Any) -> Any:
        """``--lr`` defaults to the optimizer's usual rate: 0.1 for sgd, 1e-3 for adam and adamw, but 1 for sgd
        as the outer optimizer of ``--local-steps``; under the
        local-SGD family's presets, sgd as the preset says (:data:`FAMILY_OUTER`), for each of ``--lr``,
        ``--momentum`` and ``--nesterov`` the user did not set. ``--inner-lr`` likewise, by ``--inner-optimizer``."""
        if not isinstance(values, dict):
            return values
        outer = FAMILY_OUTER.get(values.get("paradigm")) if values.get("optimizer", "sgd") == "sgd" else None
        if outer is not None:  # a preset of the local-SGD family: its outer optimizer, where the user set none
            given = {k: v for k, v in values.items() if v is not None}
            momentum = given.get("momentum", outer["momentum"])
            nesterov = given.get("nesterov", outer["nesterov"] and momentum > 0)
            values = {**values, "momentum": momentum, "nesterov": nesterov}
        local = local_steps_of(values.get("paradigm"), values.get("local_steps")) is not None
        if values.get("lr") is None:
            optimizer = values.get("optimizer", "sgd")
            if outer is not None:
                default = outer["lr"]
            elif local and optimizer == "sgd":
                # an outer sgd rate is in units of the round's change: 1 takes the workers' average (0.1, a
                # single worker's rate, took a tenth of it: 40 steps of asp --local-steps 2 ended at 21%)
                default = OUTER_SGD_LR
            else:
                default = DEFAULT_LR.get(optimizer, DEFAULT_LR["sgd"])
            values = {**values, "lr": default}
        if values.get("inner_lr") is None and local:  # (set only where read: else a warning would name it)
            values = {**values, "inner_lr": DEFAULT_LR.get(values.get("inner_optimizer", "sgd"), DEFAULT_LR["sgd"])}
        return values

    @field_validator("betas", mode="before")
    @classmethod
    def _parse_betas(cls, value: Any) -> Any:
        """``--betas 0.9,0.999`` (a string on the command line, a list in TOML)."""
        if isinstance(value, str):
            parts = value.split(",")
            if len(parts) != 2:
                raise ValueError(f"{value!r}: expected BETA1,BETA2, e.g. 0.9,0.999")
            return tuple(parts)
        return value

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"{value[0]},{value[1]}: each beta must be in [0, 1)")
        return value

    @field_validator("slowdown", mode="before")
    @classmethod
    def _parse_slowdown(cls, value: Any) -> Any:
        return _as_dict(value, parse_slowdown)

    @field_validator("paradigm_option", mode="before")
    @classmethod
    def _parse_paradigm_options(cls, value: Any) -> Any:
        """``--paradigm-option backups=1`` (repeatable): a number, true/false or a string each."""
        return _as_dict(value, parse_paradigm_option)

    @field_validator("paradigms", mode="before")
    @classmethod
    def _check_paradigms(cls, value: Any) -> Any:
        """``--paradigms bsp asp`` (TOML: a list, or one string with commas): built-ins --paradigm auto can
        rank by batches a second (hpcps.options.paradigm_choice says why not the others)."""
        names = value.replace(",", " ").split() if isinstance(value, str) else list(value)
        wrong = [n for n in names if n not in CHOOSABLE]
        if wrong or not names:
            raise ValueError(f"{' '.join(map(str, wrong)) or 'none given'}: --paradigm auto chooses among "
                             f"{', '.join(CHOOSABLE)} (paradigms that take the same step per sample; "
                             f"the others, or your own, name with --paradigm)")
        return tuple(dict.fromkeys(names))

    @field_validator("straggler_episodes", mode="before")
    @classmethod
    def _parse_episodes(cls, value: Any) -> Any:
        if isinstance(value, str):
            factor, sep, seconds = value.partition(":")
            try:
                if not sep:
                    raise ValueError
                value = (float(factor), float(seconds))
            except ValueError:
                raise ValueError(f"{value!r}: expected FACTOR:SECONDS, e.g. 3:2") from None
        if value is not None and not (value[0] >= 1.0 and value[1] > 0):
            raise ValueError(f"{value!r}: FACTOR must be >= 1 and SECONDS > 0")
        return value

    @field_validator("slowdown")
    @classmethod
    def _check_factors(cls, value: dict[int, float]) -> dict[int, float]:
        for rank, factor in value.items():
            if not factor >= 1.0:
                raise ValueError(f"{rank}={factor}: FACTOR must be a number >= 1 (how many times slower)")
        return value

    @field_validator("target")
    @classmethod
    def _check_target(cls, value: str | None) -> str | None:
        if value is not None:
            Target.parse(value)
        return value

    @field_validator("compress")
    @classmethod
    def _check_compress(cls, value: str) -> str:
        from hpcps.transport.compress import CHOICES, make_codec

        try:
            return make_codec(value).name
        except UserError:
            raise ValueError(f"expected {CHOICES}") from None

    @field_validator("fault")
    @classmethod
    def _check_faults(cls, value: list[str]) -> list[str]:
        for spec in value:
            parse_fault(spec)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "TrainConfig":
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give --steps or --epochs, not both")
        if self.staleness_max is not None and self.staleness_max < self.s_lo:
            raise ValueError(f"--staleness-max {self.staleness_max} must be >= --staleness {self.s_lo}")
        if self.jitter != "none" and self.compute_time is None:
            raise ValueError("--jitter needs --compute-time (it varies the emulated compute time)")
        if self.compute_forward and self.compute_time is None:
            raise ValueError("--compute-forward needs --compute-time (it is a share of the emulated compute)")
        if self.compute_backward and self.compute_time is None:
            raise ValueError("--compute-backward needs --compute-time (it is a share of the emulated compute)")
        if self.compute_forward + self.compute_backward > 1:
            raise ValueError(f"--compute-forward {self.compute_forward} and --compute-backward "
                             f"{self.compute_backward} add up to more than the whole compute time (1)")
        if self.straggler_episodes is not None and self.compute_time is None:
            raise ValueError("--straggler-episodes needs --compute-time (it slows the emulated compute)")
        if self.nesterov and (self.optimizer != "sgd" or self.momentum <= 0):
            raise ValueError("--nesterov needs --optimizer sgd and a --momentum above 0")
        if self.momentum_period > 1 and not (self.optimizer == "sgd" and self.nesterov):
            raise ValueError("--momentum-period is Delayed Nesterov's: it needs --optimizer sgd, a --momentum "
                             "and --nesterov")
        if self.inner_momentum and self.inner_optimizer != "sgd":
            raise ValueError(f"--inner-momentum is for --inner-optimizer sgd; got --inner-optimizer "
                             f"{self.inner_optimizer}")
        if self.momentum and self.optimizer != "sgd":
            raise ValueError(f"--momentum is for --optimizer sgd (adam and adamw take --betas); "
                             f"got --optimizer {self.optimizer}")
        if self.target is not None and self.target_accuracy is not None:
            raise ValueError("give --target or --target-accuracy, not both (--target-accuracy X is --target "
                             "accuracy>=X)")
        if self.min_lr is not None and self.lr_schedule != "cosine":
            raise ValueError(f"--min-lr is the cosine schedule's floor; got --lr-schedule {self.lr_schedule}")
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if self.jitter == "uniform" and self.jitter_cv > 1 / 3 ** 0.5:
            raise ValueError("--jitter-cv must be <= 0.577 for uniform jitter (times would go negative)")
        return self

    @property
    def faults(self) -> list[Fault]:
        """``--fault`` specs, parsed (validated above)."""
        return [parse_fault(spec) for spec in self.fault]

    @property
    def stop_target(self) -> Target | None:
        """``--target``, or ``--target-accuracy X`` as ``accuracy>=X``; None: run all the steps."""
        if self.target is not None:
            return Target.parse(self.target)
        return Target("accuracy", ">=", self.target_accuracy) if self.target_accuracy is not None else None

    @property
    def stall_limit(self) -> float | None:
        """``--stall-abort`` in seconds, None for never (0)."""
        return self.stall_abort or None

    @property
    def s_lo(self) -> int:
        """The ssp bound and dssp's lower bound: ``--staleness``, default 2."""
        return self.staleness if self.staleness is not None else DEFAULT_STALENESS

    @property
    def s_hi(self) -> int:
        """Upper staleness bound of dssp: ``--staleness-max``, or ``--staleness`` + 4."""
        return self.staleness_max if self.staleness_max is not None else self.s_lo + 4

    @property
    def inner_steps(self) -> int | None:
        """Local steps per outer round (``--local-steps``; 8 under localsgd and diloco), or None: no local
        steps, every step's gradient is pushed (:mod:`hpcps.training.local`)."""
        return local_steps_of(self.paradigm, self.local_steps)

    def as_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _as_dict(value: Any, parse) -> Any:
    """A repeatable ``NAME=VALUE`` option (a list of strings from the command line) as a dict, each item
    through ``parse``; a dict (TOML's table, a Python caller's) as it is."""
    return dict(parse(item) for item in value) if isinstance(value, (list, tuple)) else value


def parse_slowdown(spec: str) -> tuple[int, float]:
    """``"RANK=FACTOR"`` -> ``(rank, factor)``."""
    rank, sep, factor = str(spec).partition("=")
    try:
        if not sep:
            raise ValueError
        return int(rank), float(factor)
    except ValueError:
        raise ValueError(f"{spec!r}: expected RANK=FACTOR, e.g. 4=3") from None


def parse_paradigm_option(spec: str) -> tuple[str, Any]:
    """``"NAME=VALUE"`` -> ``(name, value)``: VALUE an int, a float, true/false, or else the string."""
    name, sep, text = str(spec).partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not name.isidentifier():
        raise ValueError(f"{spec!r}: expected NAME=VALUE, e.g. backups=1")
    if text.lower() in ("true", "false"):
        return name, text.lower() == "true"
    for kind in (int, float):
        try:
            return name, kind(text)
        except ValueError:
            pass
    return name, text


def _option(loc: tuple, python: bool = False) -> str:
    if not loc:
        return "config"
    return str(loc[0]) if python else "--" + str(loc[0]).replace("_", "-")


def _describe(exc: ValidationError, python: bool = False) -> str:
    lines = []
    union: dict[str, tuple[tuple, list[str], Any]] = {}  # an option of several types: one line saying them all
    for err in exc.errors():
        msg = err["msg"].removeprefix("Value error, ")
        if len(err["loc"]) == 2 and msg.startswith("Input should be "):  # (loc: the option, the type tried)
            expected = msg.removeprefix("Input should be ").split(",")[0]
            union.setdefault(str(err["loc"][0]), (err["loc"][:1], [], err.get("input")))[1].append(expected)
            continue
        if err["type"] == "extra_forbidden":
            name = str(err["loc"][0]) if err["loc"] else ""
            close = difflib.get_close_matches(name, TrainConfig.model_fields, n=1)
            hint = f" (did you mean {_option((close[0],), python)!r}?)" if close else ""
            what = "unknown keyword argument" if python else "unknown option"
            lines.append(f"{what} {_option(err['loc'], python)!r}{hint}")
        elif err["loc"]:
            lines.append(f"{_option(err['loc'], python)}: {msg} (got {err.get('input')!r})")
        else:
            lines.append(msg)
    for loc, expected, given in union.values():
        lines.append(f"{_option(loc, python)}: should be {' or '.join(expected)} (got {given!r})")
    return "; ".join(lines)


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a config file into option names with ``_`` (errors name the file)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"--config {path}: not valid TOML ({exc})") from None
    return {str(k).replace("-", "_"): v for k, v in raw.items()}


def make_config(flags: Mapping[str, Any], *, config_file: str | None = None, python: bool = False) -> TrainConfig:
    """Merge file and flags (flags win) and validate; errors name options as the command line spells
    them (``--batch-size``), or (``python``) as keyword arguments (``batch_size``)."""
    values: dict[str, Any] = read_toml(config_file) if config_file else {}
    values.update(flags)
    try:
        return TrainConfig(**values)
    except ValidationError as exc:
        where = f" (in {config_file} or on the command line)" if config_file else ""
        raise UserError(_describe(exc, python) + where) from None


def steps_for(cfg: TrainConfig, per_epoch: int) -> int:
    """Iterations each worker runs: ``--steps``, or ``--epochs`` times batches per epoch."""
    if cfg.steps is not None:
        return cfg.steps
    if cfg.epochs is not None:
        return cfg.epochs * per_epoch
    return DEFAULT_STEPS
