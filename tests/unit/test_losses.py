"""The loss of a step the loop did not name: the scalars backward ran from since the last step."""

from __future__ import annotations

import math

import torch

from hpcps.runtime.losses import LossCapture


def test_accumulated_scaled_and_plain_backwards_sum_to_the_loss_pushed():
    w = torch.nn.Parameter(torch.tensor([2.0, -1.0]))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    capture = LossCapture().open()
    try:
        losses = [(w * k).sum() / 4 for k in (1.0, 2.0, 3.0, 4.0)]  # nanoGPT's accumulation: each over 4
        for loss in losses[:2]:
            loss.backward()
        for loss in losses[2:]:
            scaler.scale(loss).backward()  # counts the loss, not 1024 times it
        assert capture.take() == sum(float(v) for v in losses)
        assert capture.take() is None  # nothing since: unknown
        w.pow(2).backward(torch.ones(2))  # from a non-scalar (a gradient given): the step's loss is unknown
        (w.sum() * 0).backward()
        assert capture.take() is None
        torch.autograd.backward(w.sum())  # torch's function, as Tensor.backward calls it
        assert math.isclose(capture.take(), 1.0)
        before = w.grad.clone()
        torch.autograd.backward(t for t in [w.sum(), 2 * w.sum()])  # a generator: noted, and not used up
        assert math.isclose(capture.take(), 3.0) and torch.equal(w.grad - before, torch.full((2,), 3.0))
    finally:
        capture.close()
    w.sum().backward()  # closed: nothing taken
    assert capture.take() is None
