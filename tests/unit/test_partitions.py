"""Partitioned pulls' plan (pure) and hooks: what is pulled in which order, and what each layer waits for."""

import pytest
import torch

from hpcps.runtime.partitions import FIRST, PartitionedPulls, plan
from hpcps.training.flat import FlatParameters


def test_ranges_are_packed_in_order_split_where_too_large_and_merged_where_adjacent():
    p = plan([("a", [(0, 3)]), ("b", [(3, 10)]), ("c", [(20, 22)])], first=[(30, 32)], size=4)
    assert p.parts == [[(30, 32), (0, 2)], [(2, 6)], [(6, 10)], [(20, 22)]]  # (2, 3) and (3, 6) merged
    assert p.first == (0,) and p.needs[FIRST] == (0,)
    assert p.needs == {FIRST: (0,), "a": (0, 1), "b": (1, 2), "c": (3,)}
    covered = sorted(r for part in p.parts for r in part)
    assert sum(hi - lo for lo, hi in covered) == 3 + 7 + 2 + 2  # every element once
    assert all(sum(hi - lo for lo, hi in part) <= 4 for part in p.parts)


def test_a_shared_range_is_pulled_once_and_needed_by_both_owners():
    p = plan([("enc", [(0, 5)]), ("mid", [(5, 9)]), ("dec", [(0, 5)])], first=[], size=100)
    assert p.parts == [[(0, 9)]] and p.needs["dec"] == p.needs["enc"] == (0,)


def test_a_partition_holds_at_least_one_element():
    with pytest.raises(ValueError):
        plan([("a", [(0, 3)])], first=[], size=0)


class Swapped(torch.nn.Module):
    """Registered first, called last: the plan must follow the calls, not the registration."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 2)
        self.body = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


def test_after_one_pass_the_plan_follows_the_forward_order_buffers_and_uncalled_modules_first():
    model = Swapped()
    flat = FlatParameters(model)
    parts = PartitionedPulls(model, flat._spans, size=1 << 20)
    span = {id(p): (off, off + n) for p, _, _, off, n in flat._spans if p is not None}
    first_plan = [r for part in parts.plan.parts for r in part]
    # the buffers, then the parameters in registration order (which is the flat vector's) until a pass is seen
    assert first_plan == [(flat.n_params, flat.size), (0, flat.n_params)]
    model(torch.randn(3, 4))
    parts.settle()  # no pull in flight: only learns the order
    assert parts.learned
    order = [r for part in parts.plan.parts for r in part]
    body = span[id(model.body.weight)][0]
    head = span[id(model.head.weight)][0]
    unused = span[id(model.unused.weight)][0]
    buffers = [off for p, _, _, off, n in flat._spans if p is None]

    def position(offset):
        return next(i for i, (lo, hi) in enumerate(order) if lo <= offset < hi)

    assert position(min(buffers)) == 0  # the BatchNorm statistics first
    assert position(unused) < position(body) < position(head)  # then the uncalled layer, then the calls' order
    assert sum(hi - lo for lo, hi in order) == flat.size
    parts.remove()
    assert not model.head._forward_pre_hooks


def test_a_pass_waits_for_each_layers_partitions_before_it_runs():
    model = Swapped()
    flat = FlatParameters(model)
    parts = PartitionedPulls(model, flat._spans, size=16)
    model(torch.randn(3, 4))
    parts.settle()

    class FakePull:
        n_parts = len(parts.plan.parts)

        def __init__(self):
            self.done, self.log = [False] * self.n_parts, []

        def versions(self):
            return torch.zeros(1).numpy(), False

        def wait_part(self, k):
            self.log.append(k)
            self.done[k] = True

        def wait(self):
            self.log.append("rest")

    pull = FakePull()
    parts.start(pull)
    assert pull.log == list(parts.plan.first)
    calls = []
    model.body.register_forward_pre_hook(lambda m, a: calls.append(("body", list(pull.log))))
    model.head.register_forward_pre_hook(lambda m, a: calls.append(("head", list(pull.log))))
    model(torch.randn(3, 4))
    assert set(parts.plan.needs[id(model.body)]) <= set(calls[0][1])  # body's partitions came before it ran
    assert set(parts.plan.needs[id(model.head)]) <= set(calls[1][1])
    assert not set(parts.plan.needs[id(model.head)]) <= set(calls[0][1])  # ... and head's only after body ran
    parts.settle()
    assert pull.log[-1] == "rest" and parts.pull is None


def test_on_a_gpu_each_partition_goes_up_once_as_it_comes_before_its_layer_runs():
    model = Swapped()
    flat = FlatParameters(model)
    uploads = []
    parts = PartitionedPulls(model, flat._spans, size=16, upload=lambda ranges: uploads.append(list(ranges)))
    model(torch.randn(3, 4))
    parts.settle()

    class FakePull:
        n_parts = len(parts.plan.parts)
        ranges = parts.plan.parts

        def __init__(self):
            self.done = [False] * self.n_parts

        def versions(self):
            return torch.zeros(1).numpy(), False

        def wait_part(self, k):
            self.done[k] = True

        def wait(self):
            pass

    parts.start(FakePull())
    assert uploads == [parts.plan.parts[k] for k in parts.plan.first]  # what the pass wants first
    seen = []
    model.head.register_forward_pre_hook(lambda m, a: seen.append([tuple(map(tuple, u)) for u in uploads]))
    model(torch.randn(3, 4))
    assert {tuple(map(tuple, parts.plan.parts[k])) for k in parts.plan.needs[id(model.head)]} <= set(seen[0])
    parts.settle()  # the rest (the uncalled layer's), each partition once
    assert sorted(map(str, uploads)) == sorted(map(str, parts.plan.parts))
