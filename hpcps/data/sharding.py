"""Which samples go where, as pure index arithmetic: the fixed split of a data set into training and
held-out samples, and the deterministic batch schedule of every worker (the loaders are
:mod:`hpcps.data.loaders` and :mod:`hpcps.data.datasets`).

A data set is split once, with a fixed seed, into a training set and a held-out test set, so runs with
different ``--seed`` values are evaluated on the same samples.

Batches: in epoch ``e`` the training set is permuted with seed ``(seed, e)``;
worker ``w`` of ``N`` owns every N-th sample of that permutation and takes
its batches from it in order. :func:`batch_indices` is that schedule as a
pure function, so a test can rebuild exactly what each worker saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hpcps.errors import UserError

SPLIT_SEED = 20190701


def split_indices(n: int, test_fraction: float, spec: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) indices of ``n`` samples: the one fixed split every data set uses (a
    permutation seeded with :data:`SPLIT_SEED`, whatever ``--seed`` says); ``spec`` names it in errors."""
    n_test = int(round(n * test_fraction))
    if n - n_test < 1 or n_test < 1:
        where = f"--dataset {spec}: " if spec is not None else ""
        raise UserError(f"{where}{n} samples are too few to hold {test_fraction:.0%} out for testing")
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    return order[n_test:], order[:n_test]


def batches_per_epoch(n_train: int, *, batch_size: int, n_workers: int) -> int:
    """Batches each worker takes from one epoch (its share, whole batches only)."""
    return (n_train // n_workers) // batch_size


@lru_cache(maxsize=4)
def _epoch_order(n_train: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_train)


def batch_indices(n_train: int, *, batch_size: int, n_workers: int, worker: int,
                  step: int, seed: int) -> np.ndarray:
    """Training-set indices of worker ``worker``'s batch at ``step`` (see module docstring)."""
    per_epoch = batches_per_epoch(n_train, batch_size=batch_size, n_workers=n_workers)
    epoch, b = divmod(step, per_epoch)
    share = _epoch_order(n_train, seed, epoch)[worker::n_workers]
    return share[b * batch_size:(b + 1) * batch_size]


@dataclass(frozen=True)
class Redeal:
    """A run resumed on another worker count: its checkpoint's workers stopped at ``clocks``, and every
    worker of the new run starts at clock ``start`` (the slowest old worker's)."""

    clocks: tuple[int, ...]
    start: int


def redealt_batches(n_train: int, *, batch_size: int, redeal: Redeal, n_workers: int, worker: int,
                    seed: int) -> tuple[list[np.ndarray], int]:
    """The batches with which new worker ``worker`` of ``n_workers`` finishes the interrupted epochs, and
    the epoch the schedule goes on with after them.

    What each old worker had not yet taken of its share of its current epoch (whole batches, as the
    schedule deals them) is put together in old-worker order and dealt again, every ``n_workers``-th
    sample to each new worker, in whole batches, as many as every new worker gets: so no sample of an
    interrupted epoch is taken twice, and none is skipped but the few that do not fill a batch for every
    worker (as an epoch's tail is). The schedule then goes on, with the new worker count, at the epoch
    after the latest interrupted one.
    """
    old_n = len(redeal.clocks)
    per_old = batches_per_epoch(n_train, batch_size=batch_size, n_workers=old_n)
    rest, last = [], 0
    for w, clock in enumerate(redeal.clocks):
        epoch, taken = divmod(int(clock), per_old)
        share = _epoch_order(n_train, seed, epoch)[w::old_n][:per_old * batch_size]
        rest.append(share[taken * batch_size:])
        last = max(last, epoch)
    remainder = np.concatenate(rest) if rest else np.zeros(0, np.int64)
    n_batches = len(remainder) // n_workers // batch_size
    mine = remainder[worker::n_workers]
    return [mine[k * batch_size:(k + 1) * batch_size] for k in range(n_batches)], last + 1


def resumed_batch_indices(n_train: int, *, batch_size: int, n_workers: int, worker: int, step: int, seed: int,
                          redeal: Redeal, dealt: tuple[list[np.ndarray], int] | None = None) -> np.ndarray:
    """Worker ``worker``'s batch at ``step`` (>= ``redeal.start``) in a run resumed on another worker
    count: the re-dealt remainder first (:func:`redealt_batches`, passed as ``dealt`` when known), then
    the usual schedule from the epoch after it."""
    pre, epoch = dealt or redealt_batches(n_train, batch_size=batch_size, redeal=redeal, n_workers=n_workers,
                                          worker=worker, seed=seed)
    k = step - redeal.start
    if k < len(pre):
        return pre[k]
    per_epoch = batches_per_epoch(n_train, batch_size=batch_size, n_workers=n_workers)
    return batch_indices(n_train, batch_size=batch_size, n_workers=n_workers, worker=worker,
                         step=epoch * per_epoch + k - len(pre), seed=seed)
