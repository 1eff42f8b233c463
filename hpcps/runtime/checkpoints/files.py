"""Checkpoints: the global parameters of one consistent version, and exact resume (no MPI).

Files of the checkpoint of version v (format 2)::

    step-000020.h5          written by rank 0
    ├── params   float32[n]: the flat vector (parameters, then float buffers), every shard at ``version``
    └── attrs: format, hpcps_version, paradigm, version, worker_clocks (int64[N]),
               n_params, n_workers, n_servers, config (JSON)
    step-000020.optim-0.pt  shard 0's optimizer state (torch.save of its state_dict)
    step-000020.optim-1.pt  shard 1's, ... one per shard, each written by its shard
    step-000020.user.pt     worker 0's loop (:class:`LoopState`): the step API's ``ps.state``,
                            ``ps.optimizer``'s hyperparameters as the loop left them, the
                            model's integer buffers; written by worker 0 at its next training
                            pass after a periodic bsp checkpoint (whatever it holds: that
                            checkpoint, attribute ``loop_part``, is complete only with it),
                            and at a stop where it has any
    inner/worker-3.round-20.pt  under --local-steps: worker 3's inner optimizer state after its round 20,
                            one file per worker and round (hpcps.training.local.InnerFiles)

Each file is written atomically: to ``<name>.tmp``, then renamed; a
checkpoint is complete when all ``1 + n_servers`` files exist (and the loop's part where
the checkpoint's ``loop_part`` says one is due). BSP
checkpoints periodically (``--checkpoint-every``) at a round's close, where
every shard and every worker are at one version; the other paradigms take
a consistent cut while the run goes on (:mod:`hpcps.runtime.checkpoints.cut`),
with no moment at which worker 0's loop belongs to it (no ``user.pt``).
Every paradigm writes one when a signal stops it (:mod:`hpcps.runtime.signals`):
by then every pushed gradient has been applied, and the checkpoint holds
each shard's version (``shard_versions``) and each worker's clock, where its
resumed run starts; the resumed run continues, it does not replay. Nothing
else is needed for an exact BSP resume: the batch
schedule is a pure function of (seed, step), workers pull parameters and
buffers after every round, and the optimizer state comes back. A BSP run
resumed from its step-k checkpoint therefore ends with exactly the
parameters of the uninterrupted run, under any optimizer. (Models that
draw random numbers in training, e.g. dropout, continue with other draws.)
Format-1 checkpoints (plain SGD, no optimizer files) still resume.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from dataclasses import dataclass, field
from typing import Sequence

import h5py
import numpy as np
import torch

import hpcps
from hpcps.cluster.slices import ALIGN, stripe_elements
from hpcps.errors import UserError

FORMAT = 2
#: options that must match between the checkpointed run and the resuming one
#: (not the shard or worker count: a checkpoint resumes on another shape of job, see :func:`reshaped`)
MUST_MATCH = ("paradigm", "model", "hidden", "dataset", "loss", "batch_size", "lr", "seed", "test_fraction",
              "optimizer", "momentum", "nesterov", "weight_decay", "betas", "eps", "lr_schedule",
              "warmup_steps", "lr_step_every", "lr_gamma", "clip_norm")
#: the config key a checkpoint records its shards' grid of cuts under (:data:`hpcps.cluster.slices.ALIGN`)
SLICE_ALIGN = "slice_align"
#: torch.optim options that choose an implementation, not the update: a resume may change them
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")
#: of those, the ones that describe the optimizer and schedule: a checkpoint that records what ran
#: (``optimizer_ran``, ``lr_schedule_values``) is compared on that instead (see check_same_optimizer)
OPTIMIZER_KEYS = ("lr", "optimizer", "momentum", "nesterov", "weight_decay", "betas", "eps", "lr_schedule",
                  "warmup_steps", "lr_step_every", "lr_gamma")


@dataclass(frozen=True)
class Checkpoint:
    params: np.ndarray
    version: int
    worker_clocks: np.ndarray
    config: dict
    n_servers: int
    format: int = FORMAT
    shard_versions: np.ndarray | None = None  # a stopped run's shards may differ; None: all at ``version``
    #: a checkpoint resumed on another shape (:func:`reshaped`): the shard count and worker clocks it was
    #: written with (None: the same shape)
    written_servers: int | None = None
    written_clocks: np.ndarray | None = None
    #: and the stripe its shards' slices were dealt in (None: contiguous; see hpcps.cluster.slices)
    written_stripe: int | None = None
    #: and the grid their cuts were aligned to (:data:`hpcps.cluster.slices.ALIGN`; 1: a checkpoint of
    #: an hpcps that cut where the values fell)
    written_align: int = ALIGN
    #: the stripe this run deals its slices in, where they are cut again (None: contiguous, or not resliced)
    run_stripe: int | None = None
    #: a checkpoint another paradigm wrote, which this run goes on from (:func:`for_paradigm`): that
    #: paradigm's name (None: this run's own)
    written_paradigm: str | None = None
    #: whether the shards' optimizers start afresh, their written state left behind: it was of updates of
    #: another batch of gradients (:func:`for_paradigm`)
    optimizer_afresh: bool = False

    def shard_version(self, shard: int) -> int:
        """The version shard ``shard`` resumes at."""
        return int(self.shard_versions[shard]) if self.shard_versions is not None else self.version

    @property
    def resharded(self) -> bool:
        return self.written_servers is not None

    @property
    def redealt(self) -> bool:
        return self.written_clocks is not None

    def describe_shape(self) -> str:
        """What changed from the checkpoint's shape to this run's ('' for nothing), for the log and run file."""
        changes = []
        if self.resharded and self.written_servers != self.n_servers:
            changes.append(f"{self.written_servers} shard(s) -> {self.n_servers}")
        elif self.resharded:  # the same shards, their slices cut otherwise: say each reason there is
            why = ["dealt again (--partition-mb)"] if self.written_stripe != self.run_stripe else []
            if self.written_align != ALIGN:
                why.append("cut again (written by an hpcps that cut them elsewhere)")
            changes.append("the shards' slices " + " and ".join(why))
        if self.redealt:
            changes.append(f"{len(self.written_clocks)} worker(s) at clocks {self.written_clocks.tolist()} -> "
                           f"{len(self.worker_clocks)} at clock {int(self.worker_clocks[0])}")
        if self.written_paradigm is not None:
            changes.append(f"written by {self.written_paradigm}, its versions counted in this paradigm's updates")
        if self.optimizer_afresh:
            changes.append("the optimizer's state left behind (it was of updates from another batch of gradients)")
        return "; ".join(changes)


def for_paradigm(ckpt: Checkpoint, *, written_per_step: int, per_step: int) -> Checkpoint:
    """``ckpt``, written under another paradigm, as a run under this one goes on from it (``--paradigm
    auto``'s trials, each from the last, and the run after them).

    A version counts updates, and paradigms apply a different number of them per step of every worker
    (``written_per_step`` and ``per_step``: :meth:`hpcps.policies.base.Policy.updates_per_step`: 1 for a
    round bsp averages, one per worker where each gradient is an update). Each shard's version becomes
    the one this paradigm is at after as many steps, so a schedule over the run's horizon (``cosine``,
    ``step``: the version's share of it) goes on where it was; a warm-up's ``--warmup-steps`` count each
    paradigm's own versions, as they do in a run of it. Exact where every worker
    stopped at one clock (a trial's end: each ran its steps); the paradigm's own state (clocks, bounds)
    starts afresh. The parameters and each worker's clock are kept.

    The optimizer's state is kept where both paradigms apply updates of the same batch (``written_per_step ==
    per_step``), and left behind where they do not: an update of asp's is one worker's gradient, bsp's the
    mean of N, and an adaptive optimizer's statistics of one are wrong for the other. Adam's second moments
    of single gradients are about N times those of their mean where noise dominates them, and with
    ``beta2 = 0.999`` they fade over a thousand updates: every step of the run after an asp trial was a
    fraction of its rate (a language model on AdamW sat on its start's plateau for 275 of the run's steps).
    """
    def mapped(version: int) -> int:
        return int(version) // written_per_step * per_step

    shard_versions = None if ckpt.shard_versions is None else \
        np.array([mapped(v) for v in ckpt.shard_versions], np.int64)
    return dataclasses.replace(ckpt, version=mapped(ckpt.version), shard_versions=shard_versions,
                               written_paradigm=ckpt.config["paradigm"], optimizer_afresh=written_per_step != per_step)


def reshaped(ckpt: Checkpoint, *, n_servers: int, n_workers: int, stripe: int | None = None) -> Checkpoint:
    """``ckpt`` as a run of ``n_servers`` shards and ``n_workers`` workers resumes it.

    Another shard count: every shard resumes at shard 0's version, and its optimizer state is cut from
    the written shards' (:func:`resliced_optimizer_state`). Another worker count: every worker starts at
    the slowest written worker's clock, and the data of the interrupted epochs is dealt again
    (:func:`hpcps.data.sharding.redealt_batches`). A paradigm's own state (clocks per worker, per shard)
    starts afresh on either change. ``stripe``: the run's shard slices are striped so (``--partition-mb``,
    :mod:`hpcps.cluster.slices`); slices cut otherwise than the checkpoint's (another stripe, or cuts not
    on :data:`~hpcps.cluster.slices.ALIGN`'s grid) count as another shard count.
    """
    changes = {}
    written_stripe = stripe_elements(ckpt.config.get("partition_mb")) if ckpt.n_servers > 1 else None
    written_align = int(ckpt.config.get(SLICE_ALIGN, 1))  # checkpoints before the grid say nothing
    if n_servers != ckpt.n_servers or written_stripe != (stripe if n_servers > 1 else None) or \
            (n_servers > 1 and written_align != ALIGN):
        changes.update(written_servers=ckpt.n_servers, n_servers=n_servers, written_stripe=written_stripe,
                       written_align=written_align, shard_versions=np.full(n_servers, ckpt.version, np.int64),
                       run_stripe=stripe if n_servers > 1 else None)
    if n_workers != len(ckpt.worker_clocks):
        changes.update(written_clocks=ckpt.worker_clocks,
                       worker_clocks=np.full(n_workers, int(ckpt.worker_clocks.min()), np.int64))
    return dataclasses.replace(ckpt, **changes) if changes else ckpt


def checkpoint_path(directory: str, version: int) -> str:
    return os.path.join(directory, f"step-{version:06d}.h5")


def write_checkpoint(path: str, params: np.ndarray, *, version: int, worker_clocks, config: dict,
                     n_servers: int, shard_versions=None, loop_part: bool = False) -> str:
    """Write atomically (temporary file, then rename); return ``path``. ``loop_part``: worker 0's loop
    writes its part (``user.pt``) later, at its next training pass (bsp's periodic checkpoints): the
    checkpoint is complete only with it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        f.create_dataset("params", data=params)
        f.attrs.update({"format": FORMAT, "hpcps_version": hpcps.__version__, "paradigm": config["paradigm"],
                        "version": version, "worker_clocks": np.asarray(worker_clocks, np.int64),
                        "n_params": len(params), "n_workers": len(worker_clocks), "n_servers": n_servers,
                        "config": json.dumps(config, sort_keys=True)})
        if shard_versions is not None:
            f.attrs["shard_versions"] = np.asarray(shard_versions, np.int64)
        if loop_part:
            f.attrs["loop_part"] = 1
    os.replace(tmp, path)
    return path


def optimizer_state_path(path: str, shard: int) -> str:
    """The file of shard ``shard``'s optimizer state in the checkpoint ``path``."""
    return f"{os.path.splitext(path)[0]}.optim-{shard}.pt"


#: the key of a shard part that holds its paradigm's own state (hpcps.policies.base.Policy.state_dict)
POLICY_KEY = "hpcps_policy"

#: the key of a shard part that says at which chunks of the slice its optimizer state is cut
#: (:attr:`hpcps.training.optim.ShardOptimizer.spans`); a part without it was cut without pieces (``uncut_spans``)
SPANS_KEY = "hpcps_spans"


def write_optimizer_state(path: str, shard: int, state: dict, policy: dict | None = None,
                          spans: Sequence[tuple[int, int]] | None = None) -> str:
    """Write shard ``shard``'s part of the checkpoint ``path`` atomically (its optimizer's state, its
    paradigm's under :data:`POLICY_KEY`, and the chunks the state is cut at under :data:`SPANS_KEY`);
    return its file."""
    part = optimizer_state_path(path, shard)
    os.makedirs(os.path.dirname(os.path.abspath(part)), exist_ok=True)
    extra = {**({POLICY_KEY: policy} if policy else {}), **({SPANS_KEY: [list(s) for s in spans]} if spans else {})}
    torch.save({**state, **extra} if extra else state, part + ".tmp")
    os.replace(part + ".tmp", part)
    return part


def user_state_path(path: str) -> str:
    """The file of the training loop's own fields (the step API's ``ps.state``) in the checkpoint ``path``."""
    return f"{os.path.splitext(path)[0]}.user.pt"


#: marks a loop file that holds more than the loop's fields (the format of :func:`write_user_state`)
LOOP_KEY = "__hpcps_loop__"


@dataclass
class LoopState:
    """What a checkpoint holds of worker 0's loop: its own fields (``ps.state``), ``ps.optimizer``'s
    param groups' hyperparameters as the loop left them (None where it never made ``ps.optimizer``),
    and the model's integer buffers (BatchNorm's ``num_batches_tracked``), by name."""

    fields: dict = field(default_factory=dict)
    param_groups: list | None = None
    int_buffers: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.fields or self.param_groups or self.int_buffers)


def write_user_state(path: str, loop: LoopState) -> str:
    """Write worker 0's loop state beside the checkpoint ``path`` atomically; return its file."""
    part = user_state_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(part)), exist_ok=True)
    torch.save({LOOP_KEY: 2, "fields": dict(loop.fields), "param_groups": loop.param_groups,
                "int_buffers": dict(loop.int_buffers)}, part + ".tmp")
    os.replace(part + ".tmp", part)
    return part


def read_loop_state(path: str) -> LoopState:
    """The loop's state saved with the checkpoint ``path`` (empty when it has none; a file written before
    the loop's optimizer and buffers were saved holds its fields only). The file is the user's own
    pickle, read in full (``weights_only=False``): resume only checkpoints you trust."""
    part = user_state_path(path)
    if not os.path.exists(part):
        return LoopState()
    saved = torch.load(part, weights_only=False)
    if isinstance(saved, dict) and saved.get(LOOP_KEY) == 2:
        return LoopState(saved["fields"], saved["param_groups"], saved["int_buffers"])
    return LoopState(saved)


def read_user_state(path: str) -> dict:
    """The loop's own fields (``ps.state``) saved with the checkpoint ``path``."""
    return read_loop_state(path).fields


def restore_int_buffers(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Put a checkpointed loop's integer buffers (BatchNorm's ``num_batches_tracked``, which each rank
    counts on its own) back into ``model``, by name."""
    buffers = dict(model.named_buffers())
    for name, value in saved.items():
        if name in buffers and not buffers[name].is_floating_point():
            buffers[name].copy_(value)


def read_optimizer_state(path: str, shard: int) -> dict:
    """Shard ``shard``'s optimizer state (empty for a format-1 checkpoint: plain SGD had none)."""
    part = optimizer_state_path(path, shard)
    if not os.path.exists(part):
        return {}
    state = torch.load(part, weights_only=True)
    state.pop(POLICY_KEY, None)
    return state  # (SPANS_KEY, where written, stays: the reader cuts the state where it was cut)


def read_policy_state(path: str, shard: int) -> dict:
    """Shard ``shard``'s paradigm state (empty where it kept none, or the checkpoint predates it)."""
    part = optimizer_state_path(path, shard)
    if not os.path.exists(part):
        return {}
    return torch.load(part, weights_only=True).get(POLICY_KEY) or {}


def checkpoint_files(directory: str) -> tuple[str, ...]:
    """The names of every checkpoint's files in ``directory`` (``step-*``): they change exactly when a
    checkpoint is begun, completed or removed."""
    return tuple(sorted(glob.glob(os.path.join(directory, "step-*"))))


def missing_parts(path: str, n_servers: int, fmt: int, loop_part: bool) -> list[str]:
    """The files the checkpoint ``path`` still lacks: a shard's part, and worker 0's loop part where it is due."""
    if fmt < 2:
        return []
    missing = [optimizer_state_path(path, s) for s in range(n_servers) if not os.path.exists(optimizer_state_path(path, s))]
    if loop_part and not os.path.exists(user_state_path(path)):
        missing.append(user_state_path(path))
    return missing


def newest_complete(directory: str) -> tuple[str, np.ndarray] | None:
    """The newest complete checkpoint in ``directory`` (every shard's part written, and worker 0's loop part
    where one is due) and its worker clocks, read from its attributes only; None where it holds none."""
    for path in sorted(glob.glob(os.path.join(directory, "step-*.h5")), reverse=True):
        try:
            with h5py.File(path, "r", locking=False) as f:
                clocks, n_servers = np.asarray(f.attrs["worker_clocks"]), int(f.attrs["n_servers"])
                fmt, loop_part = int(f.attrs["format"]), bool(f.attrs.get("loop_part", 0))
        except (OSError, KeyError):
            continue
        if not missing_parts(path, n_servers, fmt, loop_part):
            return path, clocks
    return None


def newest_clocks(directory: str) -> np.ndarray | None:
    """The worker clocks of the newest complete checkpoint in ``directory``, or None where it holds none."""
    found = newest_complete(directory)
    return None if found is None else found[1]


def read_checkpoint(path: str, complete: bool = False) -> Checkpoint:
    """Read the checkpoint ``path``; ``complete``: insist that every shard's part is there."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            ckpt = Checkpoint(f["params"][()], int(f.attrs["version"]), np.asarray(f.attrs["worker_clocks"]),
                              json.loads(f.attrs["config"]), int(f.attrs["n_servers"]), int(f.attrs["format"]),
                              np.asarray(f.attrs["shard_versions"]) if "shard_versions" in f.attrs else None)
            loop_part = bool(f.attrs.get("loop_part", 0))
    except FileNotFoundError:
        raise UserError(f"--resume {path}: no such file") from None
    except (OSError, KeyError) as exc:
        raise UserError(f"--resume {path}: not an hpcps checkpoint ({exc})") from None
    if complete:
        missing = missing_parts(path, ckpt.n_servers, ckpt.format, loop_part)
        if missing:
            raise UserError(f"--resume {path}: incomplete checkpoint, missing {', '.join(missing)}")
    return ckpt


def check_compatible(ckpt: Checkpoint, path: str, config: dict, *, n_params: int, any_paradigm: bool = False) -> None:
    """UserError naming every way ``ckpt`` does not fit this run; ``any_paradigm``: another paradigm's
    checkpoint fits too (:func:`for_paradigm`)."""
    from hpcps.options.config import TrainConfig, local_steps_of

    defaults = TrainConfig().as_json_dict()  # options an older checkpoint predates had their defaults
    keys = [k for k in MUST_MATCH if ("optimizer_ran" not in ckpt.config or k not in OPTIMIZER_KEYS)
            and not (any_paradigm and k == "paradigm")]
    theirs = {key: ckpt.config.get(key, defaults.get(key)) for key in keys}
    problems = [f"{key} is {config.get(key)!r} here but {theirs[key]!r} in the checkpoint"
                for key in keys if config.get(key) != theirs[key]]
    # a worker's clock counts outer rounds under local steps: another H would resume it at another batch
    mine = local_steps_of(config.get("paradigm"), config.get("local_steps"))
    before = local_steps_of(ckpt.config.get("paradigm"), ckpt.config.get("local_steps"))
    if mine != before:
        problems.append(f"local steps per round are {mine or 'none'} here but {before or 'none'} in the checkpoint "
                        f"(a worker's clock counts its rounds)")
    if len(ckpt.params) != n_params:
        problems.append(f"the model has {n_params} parameters, the checkpoint {len(ckpt.params)}")
    if problems:
        raise UserError(f"--resume {path} does not fit this run: " + "; ".join(problems))


def check_same_optimizer(ckpt: Checkpoint, path: str, optimizer: dict, schedule) -> None:
    """UserError unless this run's optimizer (class, options, param groups: what ran, a factory's
    included) and its schedule (``version -> multiplier``, at the versions the checkpoint recorded)
    are the checkpoint's. Checkpoints that predate this record were compared on their options by
    :func:`check_compatible`."""
    if "optimizer_ran" not in ckpt.config:
        return
    problems = []
    theirs = ckpt.config["optimizer_ran"]
    if optimizer.get("class") != theirs.get("class"):
        problems.append(f"the optimizer is {optimizer.get('class')} here but {theirs.get('class')} in the checkpoint")
    mine, saved = optimizer.get("defaults", {}), theirs.get("defaults", {})
    problems += [f"the optimizer's {key} is {mine.get(key)!r} here but {saved.get(key)!r} in the checkpoint"
                 for key in sorted(set(mine) | set(saved))
                 if key not in IMPLEMENTATION_KEYS and mine.get(key) != saved.get(key)]
    if optimizer.get("param_groups") != theirs.get("param_groups"):
        problems.append(f"the param groups are {optimizer.get('param_groups')} here but "
                        f"{theirs.get('param_groups')} in the checkpoint")
    # (another paradigm's samples are at its versions: its schedule is this one's by construction, the same options)
    recorded = ckpt.config.get("lr_schedule_values", []) if ckpt.written_paradigm is None else []
    differ = [(int(v), m, float(schedule(int(v)))) for v, m in recorded if float(schedule(int(v))) != m]
    if differ:
        problems.append("the learning-rate schedule differs: " + ", ".join(
            f"x{here:g} here but x{there:g} in the checkpoint at version {v}" for v, there, here in differ[:3]))
    if problems:
        raise UserError(f"--resume {path} does not fit this run: " + "; ".join(problems))
