"""Where a worker's batches come from, and the held-out batches of evaluation.

Three kinds of training data, one interface (:class:`DataSource`):

:class:`ArrayData`
    the built-in data sets (``digits``, an HDF5 file): numpy arrays, moved
    to the worker's device once; batches by :func:`hpcps.data.sharding.batch_indices`.
:class:`TorchData`
    a ``torch.utils.data.Dataset`` the user gives: sharded as
    ``DistributedSampler`` would (every epoch a permutation seeded with
    ``(seed, epoch)``; worker ``w`` of ``N`` owns every N-th sample of it),
    on the same schedule, :func:`~hpcps.data.sharding.batch_indices`, and collated
    with torch's ``default_collate``.
:class:`FactoryData`
    a factory ``(index, n_workers, seed, epoch) -> iterable of batches``
    the user gives: the worker takes batches from epoch 0's iterable, then
    epoch 1's, and so on.

A batch is whatever the loss takes: a tensor, or a tuple, list or dict of
them (numpy arrays are turned into tensors); :func:`to_device` moves it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np
import torch
from torch.utils.data import default_collate

from hpcps.data.sharding import Redeal, batch_indices, redealt_batches, resumed_batch_indices
from hpcps.data.loaders import Dataset
from hpcps.errors import UserError

BatchFactory = Callable[[int, int, int, int], Iterable[Any]]


class BatchSource(Protocol):
    def batch(self, step: int) -> Any:
        """The worker's batch of iteration ``step`` (steps are asked for in increasing order)."""


class DataSource(Protocol):
    name: str
    #: training samples (None: unknown, a batch factory)
    n_train: int | None
    n_test: int | None

    #: what the data are, recorded as the run's ``dataset_kind``: builtin, hdf5, synthetic, dataset, factory
    kind: str

    def for_worker(self, index: int, n_workers: int, *, batch_size: int, seed: int,
                   device: torch.device, steps: int | None = None, redeal: Redeal | None = None) -> BatchSource:
        """The batches of worker ``index`` of ``n_workers`` (who will ask for ``steps`` of them); ``redeal``:
        a run resumed on another worker count (:func:`hpcps.data.sharding.redealt_batches`)."""

    def test_batches(self, batch_size: int) -> Iterable[Any] | None:
        """The held-out batches (re-iterable), or None when there is nothing to evaluate on."""


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor (and numpy array) on ``device``, its structure kept."""
    if isinstance(batch, np.ndarray):
        batch = torch.from_numpy(batch)
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True) if batch.device != device else batch
    if isinstance(batch, (list, tuple)):
        moved = [to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class OrderedBatches:
    """Re-iterable batches of ``batch_size`` from ``take(lo, hi)`` over ``n`` items, in order."""

    def __init__(self, n: int, batch_size: int, take: Callable[[int, int], Any]) -> None:
        self.n, self.batch_size, self.take = n, batch_size, take

    def __iter__(self) -> Iterator[Any]:
        for lo in range(0, self.n, self.batch_size):
            yield self.take(lo, min(lo + self.batch_size, self.n))

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)


class ArrayData:
    """Built-in data sets: training arrays indexed on the worker's device."""

    kind = "builtin"

    def __init__(self, data: Dataset) -> None:
        self.data = data
        self.name = data.name
        self.n_train, self.n_test = len(data.y_train), len(data.y_test)
        self.in_shape, self.n_classes = data.in_shape, data.n_classes

    def for_worker(self, index: int, n_workers: int, *, batch_size: int, seed: int,
                   device: torch.device, steps: int | None = None, redeal: Redeal | None = None) -> BatchSource:
        return IndexedBatches(self.n_train, index, n_workers, batch_size, seed, _ArrayTake(self.data, device),
                              redeal)

    def test_batches(self, batch_size: int) -> Iterable[Any]:
        x, y = torch.from_numpy(self.data.x_test), torch.from_numpy(self.data.y_test)
        return OrderedBatches(self.n_test, batch_size, lambda lo, hi: (x[lo:hi], y[lo:hi]))


class _ArrayTake:
    def __init__(self, data: Dataset, device: torch.device) -> None:
        self.x = torch.from_numpy(data.x_train).to(device)
        self.y = torch.from_numpy(data.y_train).to(device)
        self.device = device

    def __call__(self, idx: np.ndarray) -> Any:
        i = torch.from_numpy(idx).to(self.device)
        return self.x[i], self.y[i]


class TorchData:
    """A user's torch ``Dataset`` (and held-out set: a Dataset, an iterable of batches, or None)."""

    kind = "dataset"

    def __init__(self, train: torch.utils.data.Dataset, test: Any = None, *, name: str = "dataset") -> None:
        self.train, self.test, self.name = train, test, name
        self.n_train = len(train)
        self.n_test = _size(test)

    def for_worker(self, index: int, n_workers: int, *, batch_size: int, seed: int,
                   device: torch.device, steps: int | None = None, redeal: Redeal | None = None) -> BatchSource:
        def take(idx: np.ndarray) -> Any:
            return default_collate([self.train[int(i)] for i in idx])
        return IndexedBatches(self.n_train, index, n_workers, batch_size, seed, take, redeal)

    def test_batches(self, batch_size: int) -> Iterable[Any] | None:
        return held_out_batches(self.test, batch_size)


class FactoryData:
    """A user's batch factory ``(index, n_workers, seed, epoch) -> iterable of batches``."""

    kind = "factory"

    def __init__(self, factory: BatchFactory, test: Any = None, *, name: str = "batches") -> None:
        self.factory, self.test, self.name = factory, test, name
        self.n_train = None
        self.n_test = _size(test)

    def for_worker(self, index: int, n_workers: int, *, batch_size: int, seed: int,
                   device: torch.device, steps: int | None = None, redeal: Redeal | None = None) -> BatchSource:
        if redeal is not None:
            raise UserError("--resume: a batch factory's batches cannot be dealt again to another worker count; "
                            "resume on the checkpoint's worker count")
        return _FactoryBatches(self.factory, index, n_workers, seed)

    def test_batches(self, batch_size: int) -> Iterable[Any] | None:
        return held_out_batches(self.test, batch_size)


class IndexedBatches:
    """Batches from the sample schedule of :func:`hpcps.data.sharding.batch_indices`, taken by ``take(indices)``."""

    def __init__(self, n_train: int, index: int, n_workers: int, batch_size: int, seed: int,
                 take: Callable[[np.ndarray], Any], redeal: Redeal | None = None) -> None:
        """``redeal``: a run resumed on another worker count finishes the interrupted epochs first
        (:func:`hpcps.data.sharding.redealt_batches`)."""
        self.n_train, self.index, self.n_workers = n_train, index, n_workers
        self.batch_size, self.seed, self.take = batch_size, seed, take
        self.redeal = redeal
        self._dealt = None if redeal is None else redealt_batches(
            n_train, batch_size=batch_size, redeal=redeal, n_workers=n_workers, worker=index, seed=seed)

    def indices(self, step: int) -> np.ndarray:
        if self.redeal is not None:
            return resumed_batch_indices(self.n_train, batch_size=self.batch_size, n_workers=self.n_workers,
                                         worker=self.index, step=step, seed=self.seed, redeal=self.redeal,
                                         dealt=self._dealt)
        return batch_indices(self.n_train, batch_size=self.batch_size, n_workers=self.n_workers,
                             worker=self.index, step=step, seed=self.seed)

    def batch(self, step: int) -> Any:
        return self.take(self.indices(step))


class _FactoryBatches:
    """Steps through the factory's epochs; a step asked for out of order restarts from epoch 0."""

    _END = object()

    def __init__(self, factory: BatchFactory, index: int, n_workers: int, seed: int) -> None:
        self.factory, self.index, self.n_workers, self.seed = factory, index, n_workers, seed
        self.it: Iterator[Any] | None = None
        self.next_step = 0

    def _start(self, epoch: int) -> None:
        self.epoch, self.in_epoch = epoch, 0
        self.it = iter(self.factory(self.index, self.n_workers, self.seed, epoch))

    def batch(self, step: int) -> Any:
        if self.it is None or step < self.next_step:
            self._start(0)
            self.next_step = 0
        while True:
            b = next(self.it, self._END)
            if b is self._END:
                if self.in_epoch == 0:
                    raise ValueError(f"the batch factory gave worker {self.index} no batches in epoch {self.epoch}")
                self._start(self.epoch + 1)
                continue
            self.in_epoch += 1
            self.next_step += 1
            if self.next_step > step:
                return b


def held_out_batches(test: Any, batch_size: int) -> Iterable[Any] | None:
    """Batches of a held-out Dataset, in order; an iterable of batches (a DataLoader) as it is; or None."""
    if test is None or not is_dataset(test):
        return test
    return OrderedBatches(len(test), batch_size, lambda lo, hi: default_collate([test[i] for i in range(lo, hi)]))


def _size(test: Any) -> int | None:
    """Samples in a held-out Dataset (None for batches or nothing: not known in advance)."""
    return len(test) if test is not None and is_dataset(test) else None


def is_dataset(obj: Any) -> bool:
    """A map-style dataset: indexable and sized (a torch Dataset, or anything shaped like one)."""
    return isinstance(obj, torch.utils.data.Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")
                                                         and not isinstance(obj, (list, tuple)))
