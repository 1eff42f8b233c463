"""Models by name (``--model``): small networks for the bundled data sets, the 1-D CNN of the
MNIST-1D paper, CIFAR-style ResNets, and torchvision's models (``torchvision:NAME``) where
torchvision imports.

Every factory takes ``in_shape`` (one sample's shape), ``n_classes`` and
``hidden``, as plug-in factories may (:mod:`hpcps.training.workload`).
"""

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


def cnn1d(in_shape: tuple[int, ...], n_classes: int, hidden: int = 64) -> nn.Module:
    """The MNIST-1D paper's CNN layout (Greydanus 2020): three strided 1-D convolutions of ``hidden``
    channels each and a linear layer, for (channels, length) inputs.

    The paper's network has 25 channels (5210 parameters, ``--hidden 25``) and reaches its 94%
    after 6000 steps of batch 100. The default of 64 channels (about 28k parameters) learns faster
    per step: with momentum SGD (lr 0.05, 0.9) and batches of 4 x 32, 1000 steps reach 0.91-0.93
    held-out accuracy over six seeds, where 25 channels reach 0.90-0.92 and fall below 0.90 on some.
    """
    if len(in_shape) != 2:
        raise UserError(f"--model cnn1d needs inputs of shape (channels, length); the data set's are {in_shape}")
    length = in_shape[1]
    channels = hidden
    for kernel in (5, 3, 3):  # stride 2, padding 1
        length = (length + 2 - kernel) // 2 + 1
    if length < 1:
        raise UserError(f"--model cnn1d needs signals of at least 8 samples; the data set's have {in_shape[1]}")
    return nn.Sequential(
        nn.Conv1d(in_shape[0], channels, 5, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * length, n_classes),
    )


class _Basic(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, and the shortcut."""

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width))
        self.shortcut = _shortcut(c_in, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class _Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1x1, 3x3, 1x1 convolutions with BatchNorm, widened 4x, and the shortcut."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out))
        self.shortcut = _shortcut(c_in, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _shortcut(c_in: int, c_out: int, stride: int) -> nn.Module:
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))


def _resnet(block: type[nn.Module], depths: tuple[int, ...], name: str):
    def factory(in_shape: tuple[int, ...], n_classes: int, hidden: int = 128) -> nn.Module:
        """CIFAR-style: a 3x3 stem without max-pooling, four stages of 64-512 channels, global pooling."""
        if len(in_shape) != 3:
            raise UserError(f"--model {name} needs inputs of shape (channels, height, width); "
                            f"the data set's are {in_shape}")
        layers: list[nn.Module] = [nn.Conv2d(in_shape[0], 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                                   nn.ReLU(inplace=True)]
        c_in = 64
        for stage, depth in enumerate(depths):
            width = 64 * 2 ** stage
            for i in range(depth):
                layers.append(block(c_in, width, 2 if stage > 0 and i == 0 else 1))
                c_in = width * block.expansion
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, n_classes)]
        return nn.Sequential(*layers)

    factory.__name__ = factory.__qualname__ = name
    return factory


resnet18 = _resnet(_Basic, (2, 2, 2, 2), "resnet18")
resnet50 = _resnet(_Bottleneck, (3, 4, 6, 3), "resnet50")


def torchvision_model(name: str) -> Callable[..., nn.Module]:
    """``--model torchvision:NAME``: ``torchvision.models.get_model(NAME, num_classes=n_classes)``."""
    try:
        import torchvision
    except Exception as exc:  # not installed, or (as a CUDA wheel against a CPU torch) broken
        raise UserError(f"--model torchvision:{name}: torchvision does not import here "
                        f"({type(exc).__name__}: {exc}); install a torchvision built for this torch, "
                        f"or use --model resnet18/resnet50") from None
    if name not in torchvision.models.list_models():
        raise UserError(f"--model torchvision:{name}: torchvision has no model {name!r}")

    def factory(in_shape: tuple[int, ...], n_classes: int) -> nn.Module:
        return torchvision.models.get_model(name, num_classes=n_classes)

    return factory


MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": mlp, "cnn": cnn, "cnn1d": cnn1d,
                                               "resnet18": resnet18, "resnet50": resnet50}


def build_model(name: str, in_shape: tuple[int, ...], n_classes: int, *, seed: int,
                hidden: int | None = None) -> nn.Module:
    """The model ``name`` of width ``hidden`` (None: its default), identical on every rank (``seed``)."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise UserError(f"--model: unknown model {name!r} (known: {', '.join(sorted(MODELS))})") from None
    torch.manual_seed(seed)
    return factory(tuple(in_shape), n_classes) if hidden is None else factory(tuple(in_shape), n_classes, hidden)
