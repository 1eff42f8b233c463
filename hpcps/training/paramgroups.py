"""Parameter groups on the server shards (pure: no MPI).

The user gives groups as torch.optim takes them: a list of dicts, each with
``params`` (tensors of the model, or their names) and the options that
group overrides (``weight_decay``, ``lr``, ``betas``, ...). A shard holds a
contiguous slice of the flat vector (:mod:`hpcps.training.flat`), which may cut
through groups and parameters; :func:`shard_groups` cuts the slice at group
boundaries, so each shard's optimizer has the groups' options on exactly
its elements. Every torch.optim rule is elementwise given its options, so
S shards stepping their pieces make the update that one optimizer with
these groups makes on the whole model, for any S.

A user optimizer factory receives the shard's groups as torch.optim param
groups: ``{"params": [1-D float32 tensors], "names": [...], "ranges":
[(name, lo, hi), ...], **options}``: which parameters (and which elements
of their flattened values, ``lo:hi``) the shard holds, so a factory may
still treat them by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

#: what the user gives: torch.optim's list of group dicts, or a function of the model returning one
GroupsSpec = list[dict[str, Any]] | Callable[[torch.nn.Module], list[dict[str, Any]]]


@dataclass(frozen=True)
class Group:
    """One group over the flat vector: its options and the ``(name, lo, hi)`` ranges of its parameters."""

    options: dict[str, Any]
    ranges: tuple[tuple[str, int, int], ...]


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's rule: weight decay on tensors of two or more dimensions (weights of linear layers,
    embeddings), none on the others (biases, LayerNorm gains)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [n for n, p in named if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [n for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


def resolve_groups(model: torch.nn.Module, spec: GroupsSpec | None) -> list[Group]:
    """The groups over ``model``'s flat vector (trainable parameters in ``model.parameters()`` order).

    Parameters no group names form a last group with the optimizer's defaults; a parameter in two
    groups, or a name the model does not have, is a ValueError.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    offsets, at = {}, 0
    for name, p in named:
        offsets[name] = (at, at + p.numel())
        at += p.numel()
    by_tensor = {id(p): n for n, p in named}
    given = spec(model) if callable(spec) else (spec or [])
    owner: dict[str, int] = {}
    groups = []
    for k, group in enumerate(given):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"param group {k}: expected a dict with 'params', as torch.optim takes")
        members = group["params"]
        members = [members] if isinstance(members, (str, torch.Tensor)) else list(members)
        names = []
        for m in members:
            name = m if isinstance(m, str) else by_tensor.get(id(m))
            if name not in offsets:
                raise ValueError(f"param group {k}: {m if isinstance(m, str) else 'a tensor'} is not a trainable "
                                 f"parameter of the model")
            if name in owner:
                raise ValueError(f"param group {k}: {name} is in group {owner[name]} already")
            owner[name] = k
            names.append(name)
        options = {key: value for key, value in group.items() if key != "params"}
        groups.append((options, names))
    rest = [n for n, _ in named if n not in owner]
    if rest or not groups:
        groups.append(({}, rest))
    return [Group(options, tuple((n, *offsets[n]) for n in sorted(names, key=lambda n: offsets[n][0])))
            for options, names in groups]


def group_breaks(groups: Sequence[Group]) -> tuple[int, ...]:
    """Where the flat vector passes from one group's parameters to another's (each such run's start but
    the first): where a shard's optimizer tensors end whatever the slicing (:func:`hpcps.cluster.slices.aligned`)."""
    owned = sorted((lo, k) for k, group in enumerate(groups) for _, lo, _ in group.ranges)
    return tuple(lo for (lo, k), (_, before) in zip(owned[1:], owned) if k != before)


def shard_groups(groups: Sequence[Group], pieces: Sequence[tuple[int, int]]) -> list[
        tuple[dict[str, Any], list[tuple[int, int]], list[tuple[str, int, int]]]]:
    """The groups' pieces in a shard's slice, which holds the flat vector's ranges ``pieces`` one after
    the other (one range ``[(lo, hi)]``, or a striped shard's several: :mod:`hpcps.cluster.slices`): per
    group with any, its options, its segments in slice coordinates (``0`` is the first piece's start;
    a segment's values are adjacent in the flat vector as well as in the slice), and the ``(name, lo, hi)``
    parts of its parameters the shard holds (in the parameter's own flattened coordinates)."""
    out = []
    for group in groups:
        segments, parts = [], []
        at, flat_end = 0, None  # flat_end: where the last segment ends in the flat vector
        for lo, hi in pieces:
            for name, a, b in group.ranges:
                s, e = max(a, lo), min(b, hi)
                if s >= e:
                    continue
                x, y = at + s - lo, at + e - lo
                # values adjacent in the flat vector (so in the slice too, whose pieces are in flat order): one
                # segment. Two ranges that only meet in the slice (a striped shard's pieces) stay two: their
                # chunks start where one shard holding it all starts them, on the grid of
                # hpcps.cluster.slices.ALIGN, and so round alike.
                if segments and flat_end == s:
                    segments[-1] = (segments[-1][0], y)
                else:
                    segments.append((x, y))
                flat_end = e
                if parts and parts[-1][0] == name and parts[-1][2] == s - a:  # a parameter on adjacent pieces
                    parts[-1] = (name, parts[-1][1], e - a)
                else:
                    parts.append((name, s - a, e - a))
            at += hi - lo
        if segments:
            out.append((group.options, segments, parts))
    return out


def shard_group_indices(groups: Sequence[Group], pieces: Sequence[tuple[int, int]]) -> list[int]:
    """The index in ``groups`` of each group :func:`shard_groups` gives for these pieces."""
    return [k for k, group in enumerate(groups) if shard_groups([group], pieces)]


def describe_groups(groups: Sequence[Group]) -> list[dict[str, Any]]:
    """What the run file records of the groups: each one's options and how many values it holds."""
    return [{**{k: v for k, v in g.options.items() if isinstance(v, (int, float, str, bool, list, tuple))},
             "values": sum(b - a for _, a, b in g.ranges), "tensors": len(g.ranges)} for g in groups]
