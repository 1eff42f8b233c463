"""Momentum under staleness (hpcps.training.momentum): the rule's closed form, and a shard's updates
against a torch.optim replay at the momentum and rate the rule gives."""

from __future__ import annotations

import pytest
import torch

from hpcps.training.momentum import StaleMomentum
from hpcps.training.optim import ShardOptimizer, builtin_optimizer


def test_no_staleness_leaves_the_momentum_and_the_rate_exactly_as_set():
    rule = StaleMomentum()
    for _ in range(50):
        rule.observe(0)
    for momentum in (0.0, 0.3, 0.9, 0.99):
        assert rule.adjusted(momentum) == (momentum, 1.0)


@pytest.mark.parametrize("momentum, staleness, explicit", [(0.9, 3, 0.6), (0.9, 5, 0.4), (0.9, 9, 0.0),
                                                           (0.9, 20, 0.0), (0.5, 1, 0.0), (0.99, 4, 0.95)])
def test_the_explicit_momentum_keeps_the_total_and_the_rate_keeps_the_step(momentum, staleness, explicit):
    rule = StaleMomentum()
    for _ in range(3000):  # (past the ramp: both momentum buffers full)
        rule.observe(staleness)
    assert rule.mean == pytest.approx(staleness)
    got, factor = rule.adjusted(momentum)
    assert got == pytest.approx(explicit)
    assert factor == pytest.approx((1 - explicit) / (1 - momentum))
    if explicit > 0:  # 1 - total = (1 - explicit)(1 - s/(1+s)): the user's momentum
        assert (1 - got) * (1 - staleness / (1 + staleness)) == pytest.approx(1 - momentum)
    assert 1.0 * factor / (1 - got) == pytest.approx(1.0 / (1 - momentum))  # rate / (1 - momentum) kept


@pytest.mark.parametrize("momentum, staleness", [(0.9, 3), (0.9, 6), (0.9, 20), (0.99, 4), (0.5, 0.5)])
def test_under_a_steady_gradient_every_update_moves_as_far_as_the_users_optimizers(momentum, staleness):
    """torch's SGD from a fresh buffer at the user's momentum and rate, and at the rule's momentum and raised
    rate, under a constant gradient: the same step at every update, the first (where the raise is 1) and
    the 1500th (the full raise, 0.99's buffer full too) included, so the first updates are never larger than the user's."""
    g = torch.ones(3, dtype=torch.float64)
    plain = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    ruled = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    user = torch.optim.SGD([plain], lr=0.1, momentum=momentum)
    ours = torch.optim.SGD([ruled], lr=0.1, momentum=momentum)
    rule = StaleMomentum()
    factors = []
    for _ in range(1500):
        rule.observe(staleness)
        explicit, factor = rule.adjusted(momentum)
        factors.append(factor)
        ours.param_groups[0].update(momentum=explicit, lr=0.1 * factor)
        before_plain, before_ruled = plain.detach().clone(), ruled.detach().clone()
        for p, opt in ((plain, user), (ruled, ours)):
            p.grad = g.clone()
            opt.step()
        assert (ruled.detach() - before_ruled) == pytest.approx(plain.detach() - before_plain, rel=1e-9)
    assert factors[0] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx((1 - explicit) / (1 - momentum), rel=1e-4)


def test_the_mean_forgets_the_start_and_counts_the_first_update_at_once():
    rule = StaleMomentum(memory=10)
    rule.observe(4)
    assert rule.mean == 4.0
    for _ in range(200):
        rule.observe(1)
    assert rule.mean == pytest.approx(1.0, abs=1e-6)
    rule.observe(-1)  # a dropped gradient's -1 never lowers it below what was applied
    assert rule.mean == pytest.approx(0.9 * 1.0, abs=1e-6)


def test_a_shards_updates_equal_torch_sgd_at_the_rules_momentum_and_rate_and_keep_the_users_momentum():
    torch.manual_seed(0)
    start = torch.randn(40)
    grads = [torch.randn(40) for _ in range(12)]
    stalenesses = [0, 2, 5, 1, 3, 7, 0, 4, 4, 2, 6, 1]
    shard = ShardOptimizer(start.clone(), builtin_optimizer("sgd", lr=0.1, momentum=0.9),
                           lambda v: 1.0, chunk=16)
    shard.stale = StaleMomentum(memory=5)
    replay_param = torch.nn.Parameter(start.clone())
    replay = torch.optim.SGD([replay_param], lr=0.1, momentum=0.9)
    rule = StaleMomentum(memory=5)
    params = shard.chunks
    for version, (g, s) in enumerate(zip(grads, stalenesses)):
        shard.step([g], [1.0], version=version, factor=1.0, staleness=s)
        rule.observe(s)
        momentum, factor = rule.adjusted(0.9)
        replay.param_groups[0].update(momentum=momentum, lr=0.1 * factor)
        replay_param.grad = g.clone()
        replay.step()
        assert shard.momentum == pytest.approx(momentum) and shard.rate_factor == pytest.approx(factor)
    assert torch.allclose(torch.cat([p.detach() for p in params]), replay_param.detach(), atol=1e-6)
    assert shard.optimizer.param_groups[0]["momentum"] == 0.9  # the user's, for edits and state_dict


def test_a_resumed_rule_goes_on_with_the_ramp_where_the_run_was():
    """A shard resumed at version k (its momentum buffers restored full) takes its next update's raise as
    the uninterrupted shard does, not the ramp's first (which is 1)."""
    going = StaleMomentum()
    for _ in range(50):
        going.observe(3)
    resumed = StaleMomentum(updates=49)
    resumed.observe(3)  # (the mean is not saved: bias-corrected, one observation of a steady staleness is it)
    assert resumed.adjusted(0.9) == pytest.approx(going.adjusted(0.9))
    fresh = StaleMomentum()
    fresh.observe(3)
    assert fresh.adjusted(0.9)[1] == pytest.approx(1.0)
    assert going.adjusted(0.9)[1] > 3.5  # (1 - 0.6) / (1 - 0.9) = 4 once both buffers are full
