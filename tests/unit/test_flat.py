"""Model parameters and gradients are views into the flat buffers."""

import numpy as np
import torch
import torch.nn.functional as F

from hpcps.flat import FlatParameters
from hpcps.models import build_model


def test_parameters_are_views_into_one_buffer():
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    flat = FlatParameters(model)
    assert flat.size == sum(p.numel() for p in before) == 64 * 128 + 128 + 128 * 10 + 10
    assert np.array_equal(flat.params, np.concatenate([b.reshape(-1).numpy() for b in before]))
    flat.params[:] = 0.5  # a pull writes here ...
    assert all(torch.all(p == 0.5) for p in model.parameters())  # ... and the model sees it


def test_backward_writes_the_flat_gradient_buffer():
    model = build_model("cnn", (1, 8, 8), 10, seed=1)
    flat = FlatParameters(model)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    F.cross_entropy(model(x), y).backward()
    expected = np.concatenate([p.grad.reshape(-1).numpy() for p in model.parameters()])
    assert np.abs(flat.grads).sum() > 0 and np.array_equal(flat.grads, expected)
    flat.zero_grad()
    assert all(torch.all(p.grad == 0) for p in model.parameters())


def test_a_model_that_does_not_fit_the_data_is_a_clear_error():
    import pytest

    from hpcps.errors import UserError

    with pytest.raises(UserError, match=r"--model cnn needs inputs of shape \(channels, height, width\)"):
        build_model("cnn", (64,), 10, seed=0)
    with pytest.raises(UserError, match=r"--model: unknown model 'resnet'"):
        build_model("resnet", (1, 8, 8), 10, seed=0)
