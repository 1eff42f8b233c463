"""Train your own network with hpcps: a complete script.

A small CNN with BatchNorm and dropout on scikit-learn's digits, AdamW on
the server shards with a warm-up and a cosine schedule, under DSSP. Launch
it like ``hpcps train``:

    mpiexec -n 5 python examples/train_script.py --steps 300

Rank 0 (the server that also evaluates) gets the result: the metrics file,
the summary and the trained model, saved as a plain ``state_dict``.
"""

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import hpcps


class Net(nn.Module):
    """Two conv blocks with BatchNorm, dropout, a linear head: 8x8 digits to 10 classes."""

    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 2 * 2, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def digits() -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """Digits as (training, held-out) TensorDatasets: 1497 and 300 images of 1x8x8."""
    bunch = load_digits()
    x = torch.from_numpy((bunch.images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(bunch.target.astype(np.int64))
    return torch.utils.data.TensorDataset(x[300:], y[300:]), torch.utils.data.TensorDataset(x[:300], y[:300])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--paradigm", default="dssp")
    parser.add_argument("--out", default=None, help="metrics file (the model goes beside it, as .pt)")
    args = parser.parse_args()

    train_set, test_set = digits()
    result = hpcps.train(
        model=Net,                    # called on every rank after torch.manual_seed(seed)
        data=train_set,               # sharded among the workers, a new permutation each epoch
        test_data=test_set,           # evaluated by rank 0, in eval mode, in batches
        optimizer="adamw", lr=3e-3, weight_decay=0.01, lr_schedule="cosine", warmup_steps=40,
        paradigm=args.paradigm, steps=args.steps, batch_size=32, out=args.out,
    )
    if result is not None:  # rank 0
        print(f"final accuracy {result.summary['final_accuracy']:.4f}; metrics in {result.path}; "
              f"model in {result.saved}")


if __name__ == "__main__":
    main()
