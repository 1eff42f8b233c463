"""Delayed Nesterov against closed forms: period 1 is torch's Nesterov sgd; period N holds the momentum to
every N-th update, fed with the mean of those N gradients."""

from __future__ import annotations

import pytest
import torch

from hpcps.options.config import make_config
from hpcps.errors import UserError
from hpcps.training.delayed import DelayedNesterov
from hpcps.training.optim import builtin_optimizer


def grads(n: int, size: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(size, generator=g) for _ in range(n)]


def test_period_one_is_torchs_nesterov_sgd_update_for_update():
    a, b = torch.ones(5, requires_grad=True), torch.ones(5, requires_grad=True)
    ours = DelayedNesterov([a], lr=0.1, momentum=0.9, period=1, weight_decay=0.01)
    ref = torch.optim.SGD([b], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    for g in grads(12):
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        assert torch.allclose(a, b, atol=1e-6)


def test_a_period_of_three_updates_the_momentum_every_third_update_with_their_mean():
    p = torch.zeros(5, requires_grad=True)
    opt = DelayedNesterov([p], lr=0.5, momentum=0.8, period=3)
    expected, m, since = torch.zeros(5), torch.zeros(5), torch.zeros(5)
    for k, g in enumerate(grads(9), start=1):
        p.grad = g
        opt.step()
        since += g
        if k % 3 == 0:
            m = 0.8 * m + since / 3
            since = torch.zeros(5)
            expected -= 0.5 * (g + 0.8 * m)
        else:
            expected -= 0.5 * g
        assert torch.allclose(p.detach(), expected, atol=1e-6), k


def test_the_option_builds_it_and_needs_nesterov_sgd():
    cfg = make_config({"paradigm": "asp", "momentum": 0.9, "nesterov": True, "momentum_period": 4})
    opt = builtin_optimizer("sgd", lr=cfg.lr, momentum=cfg.momentum, nesterov=True,
                            momentum_period=cfg.momentum_period)([torch.zeros(3, requires_grad=True)])
    assert isinstance(opt, DelayedNesterov) and opt.defaults["period"] == 4
    with pytest.raises(UserError, match="--momentum-period is Delayed Nesterov's"):
        make_config({"momentum": 0.9, "momentum_period": 4})
