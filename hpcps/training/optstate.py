"""The shards' optimizer state laid out over the flat vector, and in torch's layout (pure: no MPI).

A shard's torch optimizer keeps its state per *chunk* of its slice (:class:`hpcps.training.optim.ShardOptimizer`):
momentum buffers and Adam's moments, one value per parameter value, and per-chunk scalars (Adam's
``step``, the same on every chunk of a run). Three layouts meet here:

* a shard's: its optimizer's ``state_dict()``, chunk ``k`` at ``spans[k]`` of its slice;
* the flat vector's (:class:`FlatState`): per key, one tensor over the whole vector (what a
  checkpoint written by other shards is re-cut through, and what ``ps.optimizer`` gathers into);
* torch's, for the model's parameters: ``{"state": {i: {key: tensor shaped as parameter i}},
  "param_groups": [...]}``, parameter ``i`` counted over the param groups in order, as a torch
  optimizer over the model would save it. This is what ``ps.optimizer.state_dict()`` returns and
  ``load_state_dict`` takes, so a state moves between a plain torch run and hpcps, on any shard count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass
class FlatState:
    """Per-value optimizer state over a vector (a shard's slice, or the flat vector), and scalars.

    ``values[key]`` is the state ``key`` of every value (zero where none), ``filled[key]`` says which
    values have it (a group without momentum keeps no buffer); ``scalars`` are per-chunk scalars, the
    same on every chunk that has them (Adam's step count)."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)
    filled: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)

    def put(self, key: str, lo: int, value: torch.Tensor, length: int) -> None:
        """Write ``value`` (1-D) at ``lo:`` of ``key``'s tensor of ``length`` values."""
        if key not in self.values:
            self.values[key] = torch.zeros(length, dtype=value.dtype)
            self.filled[key] = torch.zeros(length, dtype=torch.bool)
        self.values[key][lo:lo + value.numel()] = value.detach().cpu().reshape(-1)
        self.filled[key][lo:lo + value.numel()] = True

    def covers(self, key: str, lo: int, hi: int) -> bool:
        """Whether every value in ``lo:hi`` has state ``key``."""
        return key in self.filled and bool(self.filled[key][lo:hi].all())

    def __bool__(self) -> bool:
        return bool(self.values or self.scalars)


def is_per_value(value: Any, n: int) -> bool:
    """Whether a state entry of a chunk of ``n`` values holds one number per value."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == n


def from_shard(state: dict, spans: Sequence[tuple[int, int]], length: int) -> FlatState:
    """A shard optimizer's ``state_dict()`` over its slice of ``length`` values (chunk ``k`` at ``spans[k]``)."""
    out = FlatState()
    for k, (a, b) in enumerate(spans):
        for key, value in (state.get("state") or {}).get(k, {}).items():
            if is_per_value(value, b - a):
                out.put(key, a, value, length)
            else:
                out.scalars[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
    return out


def to_shard(flat: FlatState, spans: Sequence[tuple[int, int]], built: dict) -> dict:
    """The shard optimizer state dict (``built``: its own ``state_dict()``, for the param groups) that holds
    ``flat`` (over the shard's slice): each chunk gets every key that any of its values has, zero where a
    value has none (a chunk that spans a parameter with state and one without: the state is kept, the other
    starts from zero), and the scalars only with per-value state (a chunk of ``step`` alone is a state
    torch's Adam cannot step from; a chunk with none starts afresh, as torch starts a parameter)."""
    state = dict(built)
    chunks = {}
    for k, (a, b) in enumerate(spans):
        entry = {key: values[a:b].clone() for key, values in flat.values.items() if flat.filled[key][a:b].any()}
        if entry:
            entry.update({key: v.clone() if torch.is_tensor(v) else v for key, v in flat.scalars.items()})
            chunks[k] = entry
    state["state"] = chunks
    return state


def to_torch(flat: FlatState, ranges: Sequence[tuple[int, int]], shapes: Sequence[torch.Size],
             param_groups: list[dict]) -> dict:
    """torch's layout of ``flat`` (over the flat vector) for parameters at ``ranges`` with ``shapes``
    (numbered over the groups in order), with ``param_groups`` (torch's, parameters as indices)."""
    state = {}
    for i, ((a, b), shape) in enumerate(zip(ranges, shapes)):
        entry = {key: values[a:b].clone().view(shape) for key, values in flat.values.items()
                 if flat.covers(key, a, b)}
        if entry:
            entry.update({key: v.clone() if torch.is_tensor(v) else v for key, v in flat.scalars.items()})
            state[i] = entry
    return {"state": state, "param_groups": param_groups}


#: the per-parameter scalars of torch's optimizers (Adam's and its kin's ``step``, NAdam's ``mu_product``, ASGD's
#: ``eta`` and ``mu``): what decides a key that only parameters of one value hold, whose per-value state and
#: scalars look alike (a 0-dim tensor either way)
TORCH_SCALARS = frozenset({"step", "mu_product", "eta", "mu"})


def per_value_keys(state: dict, ranges: Sequence[tuple[int, int]]) -> set[str]:
    """The keys of torch's per-parameter ``state`` that hold one number per parameter value, decided per key
    by size, not by dimension: a key is per value where every parameter holding it holds a tensor of as many
    values as the parameter has. A 0-dim parameter (a learnable scale) has 0-dim moments, as a 0-dim ``step``
    is: where only such parameters hold a key, :data:`TORCH_SCALARS` decides."""
    sized: dict[str, bool] = {}  # key -> every holder's value has the parameter's size
    wide: set[str] = set()  # keys held by a parameter of more than one value
    for i, entry in state.items():
        a, b = ranges[i]
        for key, value in entry.items():
            fits = torch.is_tensor(value) and value.numel() == b - a
            sized[key] = sized.get(key, True) and fits
            if b - a > 1:
                wide.add(key)
    return {key for key, fits in sized.items() if fits and (key in wide or key not in TORCH_SCALARS)}


def from_torch(state: dict, ranges: Sequence[tuple[int, int]], size: int) -> FlatState:
    """The flat vector's state (``size`` values) from torch's per-parameter ``state`` (keyed by the
    parameter's number, as :func:`to_torch` numbers them): the :func:`per_value_keys` go over the vector,
    anything else is a scalar."""
    out = FlatState()
    per_value = per_value_keys(state, ranges)
    for i, entry in state.items():
        a, b = ranges[i]
        for key, value in entry.items():
            if key in per_value:
                out.put(key, a, value, size)
            else:
                out.scalars[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
    return out


def cut(flat: FlatState, take) -> FlatState:
    """The part of ``flat`` a shard holds: ``take(tensor)`` cuts a flat-order tensor to the shard's slice
    (:meth:`hpcps.cluster.slices.Slices.take`)."""
    return FlatState({key: take(v) for key, v in flat.values.items()},
                     {key: take(v) for key, v in flat.filled.items()}, dict(flat.scalars))


def join(parts: Sequence[FlatState], put, size: int) -> FlatState:
    """The flat vector's state (``size`` values) from each shard's: ``put(s, local, flat)`` writes shard
    ``s``'s slice into a flat-order tensor (:meth:`hpcps.cluster.slices.Slices.put`)."""
    out = FlatState()
    for s, part in enumerate(parts):
        for key, values in part.values.items():
            if key not in out.values:
                out.values[key] = torch.zeros(size, dtype=values.dtype)
                out.filled[key] = torch.zeros(size, dtype=torch.bool)
            put(s, values, out.values[key])
            put(s, part.filled[key], out.filled[key])
        out.scalars.update(part.scalars)
    return out
