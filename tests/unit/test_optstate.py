"""The shards' optimizer state between layouts: torch's per parameter, the flat vector's, each shard's chunks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcps.cluster.slices import Slices
from hpcps.training.optim import ShardOptimizer
from hpcps.training.optstate import cut, from_shard, from_torch, join, per_value_keys, to_shard, to_torch
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


# -- models with 0-dim and unused parameters: a round trip, then one more step, against torch's replay ----------

SHAPES = [(), (1,), (3,), (2, 3), (4, 1)]


def _adam_replay(shapes, unused, n_shards, stripe, chunk):
    """torch's Adam over parameters of ``shapes`` (those in ``unused`` never get a gradient) for 2 steps; its
    ``state_dict`` through the flat layout onto ``n_shards`` shard optimizers; one more step on both with the
    same gradients. Returns torch's parameters and the shards' (flat, in the same order)."""
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = torch.optim.Adam(params, lr=0.1)
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = None if i in unused else grads[step][i].clone()
        opt.step()
    ranges, at = [], 0
    for p in params:
        ranges.append((at, at + p.numel()))
        at += p.numel()
    size = at
    flat = from_torch(opt.state_dict()["state"], ranges, size)
    slices = Slices.plan(size, size, n_shards, stripe)
    values = torch.cat([p.detach().reshape(-1) for p in params])
    grad = torch.cat([torch.zeros(p.numel()) if i in unused else grads[2][i].reshape(-1)
                      for i, p in enumerate(params)])
    groups = [Group({}, tuple((f"p{i}", *ranges[i]) for i in range(len(params))))]
    out = torch.empty(size)
    for s in range(n_shards):
        master = slices.take(s, values).clone()
        shard = ShardOptimizer(master, lambda g: torch.optim.Adam(g, lr=0.1), lambda v: 1.0, chunk=chunk,
                               groups=shard_groups(groups, slices.pieces[s]))
        shard.load_state_dict(to_shard(cut(flat, lambda v, s=s: slices.take(s, v)), shard.spans, shard.state_dict()))
        shard.step([slices.take(s, grad)], [1.0], version=2, factor=1.0)
        slices.put(s, master, out)
    for i, p in enumerate(params):
        p.grad = None if i in unused else grads[2][i].clone()
    opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params]), out


def test_a_0dim_parameters_moments_stay_its_own():
    """Regression: a learnable scalar's ``exp_avg`` (a 0-dim tensor, as ``step`` is) was taken for a scalar of
    the whole state and replaced every chunk's moments; the weights reached 2.4e23 after the round trip."""
    expected, got = _adam_replay([(8,), (), (1,)], unused=set(), n_shards=1, stripe=None, chunk=1 << 18)
    assert torch.equal(got, expected)


def test_a_parameter_that_never_had_a_gradient_leaves_no_chunk_with_step_alone():
    """Regression: torch's Adam keeps no state for a parameter without gradients; its chunk got ``step`` and no
    moments, and the shard's next update raised ``KeyError: 'exp_avg'``."""
    expected, got = _adam_replay([(3,), (2, 3)], unused={1}, n_shards=2, stripe=None, chunk=3)
    assert torch.equal(got, expected)


def test_a_chunk_across_a_parameter_with_state_and_one_without_keeps_the_state():
    """Regression: one chunk over both parameters (chunk 1 << 18) lost the first's moments silently."""
    expected, got = _adam_replay([(3,), (2, 3), (4,)], unused={1}, n_shards=1, stripe=None, chunk=1 << 18)
    assert torch.equal(got, expected)


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.sampled_from(SHAPES), min_size=1, max_size=5), data=st.data(),
       n_shards=st.integers(1, 3), stripe=st.sampled_from([None, 1, 2, 5]), chunk=st.sampled_from([1, 2, 3, 1 << 18]))
def test_optimizer_state_round_trips_then_steps_as_torch_does(shapes, data, n_shards, stripe, chunk):
    """Any model of 0-dim, one-value and wider parameters, some never used, on 1-3 shards, striped or not,
    in chunks of any size: after the round trip one more Adam step gives torch's parameters bit for bit."""
    unused = data.draw(st.sets(st.integers(0, len(shapes) - 1), max_size=len(shapes) - 1))
    expected, got = _adam_replay(shapes, unused, n_shards, stripe, chunk)
    assert torch.equal(got, expected)


def test_per_value_keys_are_decided_by_size():
    ranges = [(0, 1), (1, 5)]
    state = {0: {"step": torch.tensor(2.0), "exp_avg": torch.tensor(0.5)},
             1: {"step": torch.tensor(2.0), "exp_avg": torch.zeros(2, 2)}}
    assert per_value_keys(state, ranges) == {"exp_avg"}
    # only one-value parameters hold the keys: torch's scalar names decide
    assert per_value_keys({0: state[0]}, ranges[:1]) == {"exp_avg"}
