"""RoundSum: a BSP round summed as it arrives, in worker order, whatever the arrival order (hsp: in arrival order)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcps.runtime.rounds import RoundSum


def _grads(n: int, size: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) * 10 ** k for k in range(n)]  # magnitudes apart: order shows


def _in_order(grads, factors, n_params):
    acc = torch.zeros_like(grads[0])
    for g, f in zip(grads, factors):
        acc[:n_params].add_(g[:n_params], alpha=f)
        acc[n_params:].add_(g[n_params:])
    return acc


def test_sum_is_in_worker_order_whatever_the_arrival_order():
    n, size, p = 4, 33, 30
    grads, factors = _grads(n, size), [1.0, 0.5, 2.0, 1.0]
    r = RoundSum(size, p, n, active=set(range(n)))
    taken: list[int] = []

    def take(w):
        taken.append(w)
        return grads[w], factors[w]

    for w in (3, 1, 2):  # worker 0 last: nothing can be added before it
        r.arrive(w)
        assert r.add_ready(take) == []
    r.arrive(0)
    assert r.add_ready(take) == [0, 1, 2, 3]
    assert taken == [0, 1, 2, 3]
    assert torch.equal(r.acc, _in_order(grads, factors, p))  # bit for bit, not approximately


def test_the_expected_worker_is_the_lowest_active_one_not_yet_added():
    r = RoundSum(4, 4, 3, active={0, 1, 2})
    assert r.expected() == 0
    r.active.discard(0)  # left before pushing this round
    assert r.expected() == 1
    r.arrive(1)
    r.add_ready(lambda w: (torch.ones(4), 1.0))
    assert r.expected() == 2


def test_workers_that_left_are_skipped_and_nonfinite_gradients_not_added():
    grads = _grads(4, 5)
    r = RoundSum(5, 5, 4, active={0, 2, 3})  # worker 1 left and sent nothing this round
    for w in (0, 2, 3):
        r.arrive(w)
    done = r.add_ready(lambda w: (None, 1.0) if w == 2 else (grads[w], 1.0))
    assert done == [0, 2, 3]
    assert r.finite == {0: True, 2: False, 3: True}
    assert torch.equal(r.acc, _in_order([grads[0], grads[3]], [1.0, 1.0], 5))
    assert r.expected() is None


def test_a_leaver_that_already_pushed_is_still_added():
    grads = _grads(2, 3)
    r = RoundSum(3, 3, 2, active={0, 1})
    r.arrive(1)
    r.active.discard(1)  # it pushed, then said goodbye before worker 0's gradient came
    r.arrive(0)
    assert r.add_ready(lambda w: (grads[w], 1.0)) == [0, 1]


def test_close_starts_the_next_round_from_zero():
    grads = _grads(2, 3)
    r = RoundSum(3, 3, 2, active={0, 1})
    r.arrive(0)
    r.arrive(1)
    r.add_ready(lambda w: (grads[w], 1.0))
    r.close()
    assert torch.count_nonzero(r.acc) == 0 and r.expected() == 0 and not r.arrived and not r.finite


def test_unordered_adds_each_gradient_as_it_arrives():
    n, size, p = 3, 7, 5
    grads, factors = _grads(n, size, seed=1), [1.0, 3.0, 0.5]
    r = RoundSum(size, p, n, active=set(range(n)), ordered=False)
    for w in (2, 0, 1):  # arrival order
        r.arrive(w)
        assert r.add_ready(lambda k: (grads[k], factors[k])) == [w]  # at once, not when its turn comes
    order = [2, 0, 1]
    assert torch.equal(r.acc, _in_order([grads[w] for w in order], [factors[w] for w in order], p))
    assert r.finite == {0: True, 1: True, 2: True}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_round_completed_a_range_at_a_time_sums_bit_for_bit_as_the_whole_round(data):
    """Ranges completed over the round (hpcps.runtime.release) in any order, between whole gradients arriving
    in any order: every value's sum runs in worker order, so the round's sum is bit for bit the one summed
    whole (magnitudes 10^k apart: any other order shows), and a whole gradient added later leaves the completed
    ranges alone."""
    n = data.draw(st.integers(2, 4), label="workers")
    p, size = 40, 48  # 8 buffer values after the trainable ones
    cuts = sorted(data.draw(st.sets(st.sampled_from(range(8, size, 8)), max_size=4), label="cuts"))
    ranges = list(zip([0, *cuts], [*cuts, size]))
    grads, factors = _grads(n, size, seed=1), [1.0, 0.5, 2.0, 0.25][:n]
    r = RoundSum(size, p, n, active=set(range(n)))
    arrivals = data.draw(st.permutations(range(n)), label="arrivals")
    order = data.draw(st.permutations(range(len(ranges))), label="ranges")
    when = data.draw(st.lists(st.integers(0, n), min_size=len(ranges), max_size=len(ranges)), label="after")
    take = lambda w: (grads[w], factors[w])  # noqa: E731
    done = 0
    for step in range(n + 1):
        for k in [k for k in order if when[k] == step]:  # ranges completed after `step` arrivals
            lo, hi = ranges[k]
            r.complete(lo, hi, [(w, grads[w], factors[w]) for w in range(n)])
            done += 1
        if step < n:
            r.arrive(arrivals[step])
            r.add_ready(take)
    assert done == len(ranges) and sorted(r.done) == ranges
    assert torch.equal(r.acc, _in_order(grads, factors, p))
    r.close()
    assert r.done == [] and not r.acc.any()
