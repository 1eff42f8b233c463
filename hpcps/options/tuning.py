"""``hpcps tune``'s candidates and their ranking: the layouts one paradigm's job could run with (pure).

A layout is the shard count, how a round's values reach the workers, the partition size and the shards
a transfer reaches at once (``--servers``, ``--pull``, ``--partition-mb``, ``--shards-at-once``). Under
one paradigm and its flags they change how fast a step goes, not what it computes (under bsp, bit for
bit; tests/mpi/test_partitions_mpi.py, test_sent_pull_mpi.py), so a layout is judged by its measured
speed alone. What a user set is kept, never tuned. The trials themselves are
:mod:`hpcps.runtime.tune`'s.

Not tuned here: the paradigm (paradigms differ in what a step is worth, which a short trial cannot
measure) and ``--local-steps``.
"""

from __future__ import annotations

import itertools
import shlex
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from hpcps.errors import UserError
from hpcps.options.config import TrainConfig
from hpcps.options.planning import plan

#: the options a trial varies, in the order a command line names them
TUNED = ("servers", "pull", "partition_mb", "shards_at_once")
#: partition sizes tried (MB) where the model is at least twice as large: the box's best sizes
PARTITIONS_MB = (0.25, 1.0)


@dataclass(frozen=True)
class Trial:
    """One candidate's measured speed: ``values`` (the tuned options, as a run settled them), its
    ``workers``, and its mean step (the slowest worker's wall time over its timed steps, seconds)."""

    values: Mapping[str, Any]
    workers: int
    step_s: float
    as_given: bool = False  # the options as the user gave them (every auto settled)
    repeats: tuple[float, ...] = ()  # the mean steps of the trials it averages, where it was tried again

    @property
    def batches_per_s(self) -> float:
        """Batches the job trains a second: its workers over the mean step (what ranks the layouts, since
        a layout with fewer shards has more workers)."""
        return self.workers / self.step_s


def candidates(cfg: TrainConfig, given: Sequence[str], nodes: Sequence[int], model_mb: float) -> list[dict]:
    """The layouts to try for ``cfg`` on ranks whose nodes are ``nodes``: every combination of the tuned
    options the user did not set (``given``: the options set), that the run would accept. ``model_mb``:
    the model's size, which bounds the partition sizes worth a trial."""
    n_nodes = len(set(nodes))
    shard_counts = {1, n_nodes} if n_nodes > 1 else {1, 2}
    choices = {
        "servers": sorted(n for n in shard_counts if n < len(nodes)),
        "pull": ["get", "send"],
        "partition_mb": [0.0] + [mb for mb in PARTITIONS_MB if 2 * mb <= model_mb],
        "shards_at_once": [0, 1],
    }
    for name in given:
        if name in choices:
            choices[name] = [getattr(cfg, name)]
    found = []
    for values in itertools.product(*(choices[name] for name in TUNED)):
        update = dict(zip(TUNED, values))
        if update["shards_at_once"] and update["servers"] == 1 and "shards_at_once" not in given:
            continue  # (one shard: one at a time is every shard at once)
        try:
            plan(cfg.model_copy(update=update), len(nodes), nodes)
        except UserError:  # a combination the run refuses (--pull send with --shards-at-once, ...)
            continue
        found.append(update)
    return found


def ranked(trials: Sequence[Trial]) -> list[Trial]:
    """The trials, most batches a second first."""
    return sorted(trials, key=lambda t: -t.batches_per_s)


def flags(values: Mapping[str, Any]) -> list[str]:
    """``values`` as command-line flags (``--servers 4 --pull send ...``)."""
    words = []
    for name in TUNED:
        if name in values:
            value = values[name]
            words += ["--" + name.replace("_", "-"), f"{value:g}" if isinstance(value, float) else str(value)]
    return words


def command(launch: Sequence[str], train_words: Sequence[str], values: Mapping[str, Any]) -> str:
    """The command that runs the job with a trial's layout: ``launch`` (``mpiexec -n 8``), ``hpcps train``,
    the user's own words (``train_words``) and the layout's flags."""
    return shlex.join([*launch, "hpcps", "train", *train_words, *flags(values)])


def table(trials: Sequence[Trial]) -> list[str]:
    """The ranked trials as a Markdown table (one line each), the best first."""
    order = ranked(trials)
    best = order[0].batches_per_s if order else 1.0
    lines = ["| rank | layout | workers | mean step ms | batches/s | vs best |", "|---|---|---|---|---|---|"]
    for i, t in enumerate(order, 1):
        given = " (as given)" if t.as_given else ""
        lines.append(f"| {i} | {' '.join(flags(t.values))}{given} | {t.workers} | {t.step_s * 1e3:.1f} | "
                     f"{t.batches_per_s:.1f} | {t.batches_per_s / best:.2f} |")
    return lines
