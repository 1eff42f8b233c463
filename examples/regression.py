"""A regression with hpcps: float targets, a mean-squared-error loss, batches from a factory.

Each worker draws its own batches of a noisy 1-D function (no data set is
shared: the factory is given the worker's index, the worker count, the
seed and the epoch), an MLP learns it with Adam under ASP, and rank 0
reports the held-out mean squared and absolute errors. The learning rate is
one that stays stable at the staleness ASP brings (about twice the worker
count here): at 0.003 the held-out error of this run jumps to several times
that of predicting 0 before it settles, and where it settles is luck.

    mpiexec -n 5 python examples/regression.py --steps 400
"""

import argparse

import h5py
import torch
import torch.nn.functional as F
from torch import nn

import hpcps


def target(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(3 * x) + 0.5 * x


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def batches(index: int, n_workers: int, seed: int, epoch: int, per_epoch: int = 50, size: int = 32):
    """Worker ``index``'s batches of epoch ``epoch``: ``(x, y)`` with ``y = target(x) + noise``."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 1009 * index + epoch)
    for _ in range(per_epoch):
        x = torch.rand(size, 1, generator=g) * 4 - 2
        yield x, target(x) + 0.05 * torch.randn(size, 1, generator=g)


def mse(net: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(net(x), y)


def errors(net: nn.Module, held_out) -> dict[str, float]:
    """Mean squared and absolute error over the held-out batches (hpcps calls it in eval mode, no_grad)."""
    x, y = held_out[0]
    pred = net(x)
    return {"loss": float(F.mse_loss(pred, y)), "mae": float((pred - y).abs().mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    x = torch.linspace(-2, 2, 200).unsqueeze(1)
    result = hpcps.train(model=model, data=batches, test_data=[(x, target(x))], loss=mse, evaluate=errors,
                         optimizer="adam", lr=0.001, paradigm="asp", steps=args.steps, out=args.out)
    if result is not None:  # rank 0: the first and the last evaluation
        with h5py.File(result.path) as f:
            first = f["eval"][0]
        print(f"held-out mse {first['loss']:.4f} at version {first['version']} -> {result.metrics['loss']:.4f} "
              f"at the end, mae {result.metrics['mae']:.4f} (predicting 0 everywhere: "
              f"mse {float(target(x).pow(2).mean()):.4f}); metrics in {result.path}")


if __name__ == "__main__":
    main()
