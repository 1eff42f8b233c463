"""Delayed Nesterov momentum (Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling"):
the outer sgd of asynchronous local SGD, its momentum updated once per ``period`` updates.

Applied on arrival, each worker's pseudo-gradient is an update of its own, and plain momentum compounds
stale directions update after update. Delayed Nesterov keeps the momentum buffer out of all but every
``period``-th update of a tensor: each update is a plain step ``lr * g``, and every ``period``-th also
folds the mean of the gradients since the last into the momentum and adds its Nesterov term::

    s += g                                      (the gradients since the last milestone)
    every period-th update:  m = momentum * m + s / period;  p -= lr * (g + momentum * m);  s = 0
    any other update:        p -= lr * g

With ``period`` 1 it is torch's sgd with Nesterov momentum (no dampening), update for update. The count
is kept per tensor (hpcps steps a shard's slice chunk by chunk: :class:`hpcps.training.optim.ShardOptimizer`).
"""

from __future__ import annotations

import torch


class DelayedNesterov(torch.optim.Optimizer):
    """sgd whose Nesterov momentum is updated once per ``period`` updates (module docstring); ``weight_decay``
    is L2 in the gradient, as torch's sgd has it."""

    def __init__(self, params, lr: float, momentum: float, period: int, weight_decay: float = 0.0) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"delayed Nesterov: momentum must be in [0, 1); got {momentum}")
        if period < 1:
            raise ValueError(f"delayed Nesterov: the period must be at least 1; got {period}")
        super().__init__(params, dict(lr=lr, momentum=momentum, period=period, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, period, decay = group["lr"], group["momentum"], group["period"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if not decay else p.grad.add(p, alpha=decay)
                state = self.state[p]
                if not state:
                    state["count"] = 0
                    state["since"] = torch.zeros_like(p)
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["count"] += 1
                state["since"].add_(g)
                if state["count"] % period == 0:
                    m = state["momentum_buffer"]
                    m.mul_(beta).add_(state["since"], alpha=1.0 / period)
                    state["since"].zero_()
                    p.add_(g.add(m, alpha=beta), alpha=-lr)
                else:
                    p.add_(g, alpha=-lr)
        return loss
