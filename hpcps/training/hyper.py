"""The loop's edits of ``ps.optimizer``'s hyperparameters, on their way to the server shards (pure: no MPI).

``ps.optimizer`` holds the param groups of the servers' optimizer: the same groups, with the
hyperparameters the shards' torch optimizer was built with (:func:`template`). A loop edits them as it
edits a torch optimizer's, by hand (``ps.optimizer.param_groups[0]["lr"] = 1e-3``) or through any
``torch.optim.lr_scheduler``. Before each push the worker asks its :class:`EditTracker` whether they
changed since it last sent them; if so they go to every shard ahead of the push (wire ``HYPER``), and
the shards apply that gradient, and the worker's later ones, with them: *a gradient is applied with the
hyperparameters its worker's optimizer held when it pushed*, as eager's staleness-scaled rate already
travels with its gradient. Under the asynchronous paradigms each worker's edits therefore govern its own
gradients; an update that sums several workers' gradients (a bsp round) is applied with the first one's,
and a warning says once if they differ.

The learning rate is the group's base rate: ``--lr-schedule`` and the staleness factor still multiply it
(keep ``lr_schedule`` at ``constant``, the default, when the loop schedules its own rate).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger("hpcps")

#: what a torch optimizer's param group holds that is not a hyperparameter of its update
NOT_HYPER = frozenset({"params", "names", "ranges"})

#: what torch's lr schedulers write into param groups for their own bookkeeping (never sent)
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr",
                            "base_lr"})


def servers_template(make, groups, n_params: int) -> tuple[list[dict[str, Any]], str]:
    """The hyperparameters of each of the run's param groups as the shards' optimizer has them, and its
    class name: ``make`` (the optimizer factory) called as a shard's would be, over the whole vector.
    ``groups``: :func:`hpcps.training.paramgroups.resolve_groups`'s."""
    from hpcps.training.optim import ShardOptimizer
    from hpcps.training.paramgroups import shard_groups

    probe = ShardOptimizer(torch.zeros(n_params), make, lambda v: 1.0, groups=shard_groups(groups, [(0, n_params)]))
    return template(probe.optimizer.param_groups), type(probe.optimizer).__name__


def template(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hyperparameters of each of a torch optimizer's param groups."""
    return [{k: _plain(v) for k, v in g.items() if k not in NOT_HYPER} for g in param_groups]


def _plain(value: Any) -> Any:
    """A value as it travels: a one-element tensor (a capturable rate) as a float, tuples kept."""
    if torch.is_tensor(value) and value.numel() == 1:
        return float(value)
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    return copy.deepcopy(value)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def eq(x, y):
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            return True
        return x == y
    return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)


class EditTracker:
    """What a worker's loop changed in its optimizer's param groups since the last push.

    ``sent``: the hyperparameters the shards start with (:func:`template` of their optimizer);
    ``warn(message)``: called once per key that no shard optimizer has (an edit with no effect), and
    once if the loop adds param groups.
    """

    def __init__(self, sent: list[dict[str, Any]], warn: Callable[[str], None], optimizer_name: str = "") -> None:
        self.sent = [dict(g) for g in sent]
        self.keys = [set(g) for g in sent]
        self.warn, self.name = warn, optimizer_name or "optimizer"
        self.warned: set[Any] = set()

    def edits(self, param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """Every group's hyperparameters if any changed since the last call that returned some, else None."""
        if len(param_groups) != len(self.keys) and "groups" not in self.warned:
            self.warned.add("groups")
            self.warn(f"ps.optimizer has {len(param_groups)} param groups, the servers' {self.name} "
                      f"{len(self.keys)}: groups added in the loop have no effect on the servers")
        current = []
        for k, (group, keys) in enumerate(zip(param_groups, self.keys)):
            for key in group:
                if key in keys or key in NOT_HYPER or key in SCHEDULER_KEYS or (k, key) in self.warned:
                    continue
                self.warned.add((k, key))
                self.warn(f"ps.optimizer.param_groups[{k}][{key!r}]: the servers' {self.name} has no such "
                          f"hyperparameter, so setting it has no effect (it has {', '.join(sorted(keys))})")
            current.append({key: _plain(group[key]) for key in keys if key in group})
        if all(_same(c, s) for c, s in zip(current, self.sent)):
            return None
        self.sent = current
        return current


class ShardHypers:
    """A shard's record of each worker's optimizer hyperparameters as its loop last set them (``edits``, by
    worker index), and of those in force in the run file. An update takes those its first worker's loop held
    when it pushed (those the optimizer was built with, for a worker whose loop never set any, once another's
    did); a mix is said once. ``worker_ranks``: each worker's rank, for that line."""

    def __init__(self, shard: int, worker_ranks: Sequence[int]) -> None:
        self.shard, self.worker_ranks = shard, worker_ranks
        self.edits: dict[int, list[dict]] = {}
        self._mixed_told = False
        self._in_force: dict[tuple[int, str], float] = {}  # (group, name): the value last recorded

    def use(self, workers: Sequence[int], optimizer,
            record: Callable[[int, list[tuple[int, str, float]]], None]) -> None:
        """Set ``optimizer`` (a :class:`~hpcps.training.optim.ShardOptimizer`) to the hyperparameters of an
        update of ``workers``' gradients; ``record(worker, rows)``: the ``(group, name, value)`` in force that
        changed since the last update (rows of ``servers/hypers``)."""
        if not self.edits:
            return
        if not self._in_force:  # the first edit: what the optimizer was built with is no change (its rows would
            self._changed(optimizer)  # say amsgrad, fused, ... at the first version though no loop set them)
        values = self.edits.get(workers[0])
        if any(self.edits.get(w) != values for w in workers[1:]) and not self._mixed_told:
            self._mixed_told = True
            log.warning("shard %d: one update sums gradients whose workers' loops set different optimizer "
                        "hyperparameters; it is applied with worker rank %d's (said once)", self.shard,
                        self.worker_ranks[workers[0]])
        if values is None:
            optimizer.reset_hyper()
        else:
            optimizer.set_hyper(values)
        record(workers[0], self._changed(optimizer))

    def _changed(self, optimizer) -> list[tuple[int, str, float]]:
        """Each hyperparameter in force that changed since the last update (an edit of a worker's loop, or back
        to the optimizer's own for a worker that made none), as ``(group, name, value)``."""
        rows = []
        for local, group in enumerate(optimizer.optimizer.param_groups):
            g = optimizer.indices[local]
            for key, value in group.items():
                if key in NOT_HYPER or key in SCHEDULER_KEYS:
                    continue
                value = optimizer.base_lrs[local] if key == "lr" else value
                for name, number in _numbers(key, value):
                    if self._in_force.get((g, name)) != number:
                        self._in_force[(g, name)] = number
                        rows.append((g, name, number))
        return rows


def _numbers(key: str, value) -> list[tuple[str, float]]:
    """A hyperparameter as the run file records it: a number (or bool) as itself, a tuple's numbers as
    ``key[i]``; anything else (``foreach``'s None) not at all."""
    if isinstance(value, (bool, int, float)):
        return [(key, float(value))]
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value):
        return [(f"{key}[{i}]", float(v)) for i, v in enumerate(value)]
    return []
