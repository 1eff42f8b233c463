"""A model plug-in for ``hpcps train --model examples/cnn_plugin.py:cnn``, and an HDF5 data set to try it on.

hpcps calls the factory on every rank with the keyword arguments it takes of
``in_shape`` (one sample's shape, from the data set), ``n_classes`` and
``hidden`` (``--hidden``)::

    python examples/cnn_plugin.py digits.h5        # writes scikit-learn's digits as /x, /y
    mpiexec -n 5 hpcps train --dataset digits.h5 --model examples/cnn_plugin.py:cnn \\
        --optimizer sgd --momentum 0.9 --weight-decay 5e-4 --lr-schedule cosine --warmup-steps 50

Any HDF5 file with ``/x`` (samples first, here channels x height x width)
and ``/y`` (integer labels) works the same way.
"""

import sys

import numpy as np
from torch import nn


def cnn(in_shape: tuple[int, ...], n_classes: int, hidden: int = 64) -> nn.Module:
    """Conv-BatchNorm-ReLU twice, global average pooling, a hidden layer: any (C, H, W) input."""
    channels = in_shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, n_classes),
    )


def write_digits(path: str) -> None:
    """scikit-learn's digits as an HDF5 file: ``/x`` float32 (1797, 1, 8, 8), ``/y`` int64."""
    import h5py
    from sklearn.datasets import load_digits

    bunch = load_digits()
    with h5py.File(path, "w") as f:
        f["x"] = (bunch.images / 16.0).astype(np.float32)[:, None]
        f["y"] = bunch.target.astype(np.int64)


if __name__ == "__main__":
    write_digits(sys.argv[1] if len(sys.argv) > 1 else "digits.h5")
