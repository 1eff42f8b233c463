"""MNIST-1D (Greydanus 2020) as hpcps plug-ins: a data set and a 1-D CNN.

The ``mnist1d`` package generates the data offline (``pip install mnist1d``;
``make_dataset`` builds the 4000 training and 1000 test signals of length
40 from templates, nothing is downloaded)::

    mpiexec -n 5 hpcps train --dataset examples/mnist1d_plugin.py:load \\
        --model examples/mnist1d_plugin.py:cnn1d --optimizer sgd --momentum 0.9 --lr 0.05 --steps 1000

The paper's references: a CNN about 94% held-out accuracy, an MLP about
68%, logistic regression about 32%.
"""

import numpy as np
import torch
from torch import nn


def load(seed: int = 42) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """The standard MNIST-1D split: (training, held-out) TensorDatasets of (1, 40) signals, 10 classes."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = seed
    d = make_dataset(args)

    def tensors(x: np.ndarray, y: np.ndarray) -> torch.utils.data.TensorDataset:
        return torch.utils.data.TensorDataset(torch.from_numpy(x.astype(np.float32)).unsqueeze(1),
                                              torch.from_numpy(y.astype(np.int64)))

    train, test = tensors(d["x"], d["y"]), tensors(d["x_test"], d["y_test"])
    train.n_classes = 10  # hpcps offers it to model factories that take n_classes
    return train, test


def cnn1d(in_shape: tuple[int, ...] = (1, 40), n_classes: int = 10, channels: int = 25) -> nn.Module:
    """The paper's small CNN: three 1-D convolutions of 25 channels, then a linear layer (about 5k parameters)."""
    return nn.Sequential(
        nn.Conv1d(in_shape[0], channels, 5, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * _length(in_shape[-1]), n_classes),
    )


def _length(n: int) -> int:
    """The signal length after the three strided convolutions."""
    for kernel, padding in ((5, 1), (3, 1), (3, 1)):
        n = (n + 2 * padding - kernel) // 2 + 1
    return n
