"""The shards' optimizer state between layouts: torch's per parameter, the flat vector's, each shard's chunks."""

from __future__ import annotations

import pytest
import torch

from hpcps.cluster.slices import Slices
from hpcps.training.optim import ShardOptimizer
from hpcps.training.optstate import cut, from_shard, from_torch, join, to_shard, to_torch
from hpcps.training.paramgroups import Group, shard_groups


def _model_state(shapes, groups_momentum):
    """A torch SGD over parameters of ``shapes``, in groups with the given momenta, after 2 steps."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    half = len(params) // 2
    opt = torch.optim.SGD([{"params": params[:half], "momentum": groups_momentum[0]},
                           {"params": params[half:], "momentum": groups_momentum[1]}], lr=0.1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


@pytest.mark.parametrize("n_shards,stripe,chunk", [(1, None, 1 << 18), (2, None, 5), (3, 7, 4)])
@pytest.mark.parametrize("momenta", [(0.9, 0.9), (0.9, 0.0)])
def test_a_state_through_shards_comes_back_as_it_was(n_shards, stripe, chunk, momenta):
    """torch's state -> flat -> each shard's optimizer (cut in chunks) -> its state_dict -> flat -> torch's:
    the same tensors, shaped as the parameters; a group without momentum keeps none."""
    shapes = [(3, 4), (5,), (2, 3), (7,)]
    params, opt = _model_state(shapes, momenta)
    sizes = [p.numel() for p in params]
    ranges, at = [], 0
    for n in sizes:
        ranges.append((at, at + n))
        at += n
    size, half = at, len(params) // 2
    groups = [Group({"momentum": momenta[0]}, tuple((f"p{i}", *ranges[i]) for i in range(half))),
              Group({"momentum": momenta[1]}, tuple((f"p{i}", *ranges[i]) for i in range(half, len(params))))]
    saved = opt.state_dict()
    flat = from_torch(saved["state"], ranges, size)
    slices = Slices.plan(size, size, n_shards, stripe)
    parts = []
    for s in range(n_shards):
        master = torch.zeros(slices.length(s))
        shard = ShardOptimizer(master, lambda g: torch.optim.SGD(g, lr=0.1), lambda v: 1.0, chunk=chunk,
                               groups=shard_groups(groups, slices.pieces[s]))
        shard.load_state_dict(to_shard(cut(flat, lambda v, s=s: slices.take(s, v)), shard.spans, shard.state_dict()))
        parts.append(from_shard(shard.state_dict(), shard.spans, slices.length(s)))
    back = to_torch(join(parts, slices.put, size), ranges, [p.shape for p in params], saved["param_groups"])
    assert sorted(back["state"]) == sorted(saved["state"])
    for i, entry in saved["state"].items():
        assert torch.equal(back["state"][i]["momentum_buffer"], entry["momentum_buffer"])
    if momenta[1] == 0.0:
        assert all(i < half for i in back["state"])


def test_scalars_travel_with_every_parameter_that_has_state():
    """Adam's step count (a scalar per chunk) comes back on every parameter."""
    p = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2, 2))]
    opt = torch.optim.Adam(p)
    for _ in range(3):
        for q in p:
            q.grad = torch.randn_like(q)
        opt.step()
    flat = from_torch(opt.state_dict()["state"], [(0, 4), (4, 8)], 8)
    assert float(flat.scalars["step"]) == 3.0
    back = to_torch(flat, [(0, 4), (4, 8)], [q.shape for q in p], [])
    assert all(float(back["state"][i]["step"]) == 3.0 for i in (0, 1))
    assert torch.equal(back["state"][1]["exp_avg"], opt.state_dict()["state"][1]["exp_avg"])
