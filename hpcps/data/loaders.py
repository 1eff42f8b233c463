"""Loading the in-memory data sets (``--dataset digits`` or an HDF5 file of ``/x`` and ``/y``) into
training and held-out arrays, split as :func:`hpcps.data.sharding.split_indices` says.

``digits`` is bundled with scikit-learn (1797 8x8 images of ten digits); an HDF5 file holds ``/x``
(samples along the first axis) and ``/y`` (integer class labels).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from hpcps.data.sharding import split_indices
from hpcps.errors import UserError


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    n_classes: int

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _digits() -> tuple[np.ndarray, np.ndarray]:
    images, target = _digits_file()
    x = (images / 16.0).astype(np.float32)[:, None, :, :]
    return x, target.astype(np.int64)


def _digits_file() -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 images (0-16) and labels of ``sklearn.datasets.load_digits``, read from the CSV file
    scikit-learn ships, without importing scikit-learn: its import (scipy's included) took ~1.5 s a rank
    alone and ~5 s with five ranks on two cores, the largest part of a small run's start-up. Where the
    file is not where scikit-learn 1.x keeps it, ``load_digits`` itself."""
    import gzip
    from importlib.util import find_spec

    spec = find_spec("sklearn")  # finds the package without running its __init__
    roots = spec.submodule_search_locations if spec is not None else None
    path = os.path.join(roots[0], "datasets", "data", "digits.csv.gz") if roots else ""
    if not os.path.isfile(path):
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def _hdf5(path: str) -> tuple[np.ndarray, np.ndarray]:
    import h5py

    if not os.path.exists(path):
        raise UserError(f"--dataset {path}: no such file (and not a known data set name: digits)")
    try:
        with h5py.File(path, "r") as f:
            missing = [k for k in ("x", "y") if k not in f]
            if missing:
                raise UserError(f"--dataset {path}: missing dataset(s) {', '.join('/' + k for k in missing)}")
            x, y = f["x"][()], f["y"][()]
    except OSError as exc:
        raise UserError(f"--dataset {path}: not a readable HDF5 file ({exc})") from None
    if len(x) != len(y):
        raise UserError(f"--dataset {path}: /x has {len(x)} samples but /y has {len(y)} labels")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
        raise UserError(f"--dataset {path}: /y must be a 1-d array of non-negative integer labels")
    if x.ndim == 1:
        x = x[:, None]
    return x.astype(np.float32), y.astype(np.int64)


def load_dataset(spec: str, *, test_fraction: float = 0.2) -> Dataset:
    """Load ``spec`` and split it into training and held-out samples."""
    x, y = _digits() if spec == "digits" else _hdf5(spec)
    train, test = split_indices(len(x), test_fraction, spec)
    return Dataset(spec, x[train], y[train], x[test], y[test], int(y.max()) + 1)
