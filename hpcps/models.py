"""Models by name (``--model``): small networks for the bundled data sets."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hpcps.errors import UserError


def mlp(in_shape: tuple[int, ...], n_classes: int, hidden: int = 128) -> nn.Module:
    """Two-layer perceptron on the flattened input (digits: 64-128-10 by default)."""
    n_in = int(torch.tensor(in_shape).prod())
    return nn.Sequential(nn.Flatten(), nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))


def cnn(in_shape: tuple[int, ...], n_classes: int, hidden: int = 128) -> nn.Module:
    """Two conv+pool blocks and a linear head, for (channels, height, width) inputs."""
    if len(in_shape) != 3:
        raise UserError(f"--model cnn needs inputs of shape (channels, height, width); the data set's are {in_shape}")
    c, h, w = in_shape
    if h < 4 or w < 4:
        raise UserError(f"--model cnn needs images of at least 4x4 pixels; the data set's are {h}x{w}")
    return nn.Sequential(
        nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (h // 4) * (w // 4), hidden), nn.ReLU(), nn.Linear(hidden, n_classes),
    )


MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": mlp, "cnn": cnn}


def build_model(name: str, in_shape: tuple[int, ...], n_classes: int, *, seed: int, hidden: int = 128) -> nn.Module:
    """The model ``name`` with ``hidden`` units in its hidden layer, identical on every rank (``seed``)."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise UserError(f"--model: unknown model {name!r} (known: {', '.join(sorted(MODELS))})") from None
    torch.manual_seed(seed)
    return factory(tuple(in_shape), n_classes, hidden)
