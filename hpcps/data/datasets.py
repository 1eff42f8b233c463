"""Built-in data sets by name (``--dataset``), each a :class:`~hpcps.data.batches.DataSource`.

``digits``
    scikit-learn's 1797 8x8 digits, in memory (:func:`hpcps.data.loaders.load_dataset`).
``mnist1d`` or ``mnist1d:SAMPLES``
    MNIST-1D (Greydanus 2020), generated offline by the ``mnist1d`` package
    (``make_dataset``; never its download URL) with its standard arguments:
    SAMPLES in all (default 5000), 80% of them for training, its own
    held-out 20%, signals of length 40.
    Rank 0 generates it once into a cache file (``$HPCPS_CACHE_DIR``, else
    ``~/.cache/hpcps``), which every other rank then reads.
``synthetic:CxHxW:CLASSES:SAMPLES``
    for throughput work, e.g. ``synthetic:3x32x32:10:50000``: sample i is
    drawn from a generator seeded with i (class ``i % CLASSES``, a class
    template plus noise, so it can be learnt), made when a batch needs it,
    never held. Runs on it are marked ``dataset_kind = "synthetic"``.
``FILE.h5`` or ``FILE.h5:/X,/Y``
    an HDF5 file with samples along the first axis of ``/x`` and integer
    labels in ``/y`` (or the datasets named), *streamed*: a worker reads only
    its own samples, batch by batch (one read of the batch's rows in file
    order), the next batch prefetched by a helper thread while it computes;
    only the evaluating rank reads held-out samples. Labels are read whole
    (8 bytes per sample) to split and count classes.

Every source but MNIST-1D (which has its own held-out set) is split into
training and held-out samples by the fixed permutation of
:data:`hpcps.data.sharding.SPLIT_SEED`, the same whatever ``--seed`` says.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

import numpy as np
import torch

from hpcps.data.batches import ArrayData, BatchSource, IndexedBatches, OrderedBatches
from hpcps.data.sharding import SPLIT_SEED, Redeal, split_indices
from hpcps.data.loaders import Dataset, load_dataset
from hpcps.errors import RunAborted, UserError

MNIST1D_SAMPLES = 5000  # the package's (and the paper's) standard: 4000 training, 1000 held-out
_SYNTHETIC = re.compile(r"^synthetic:(\d+(?:x\d+)*):(\d+):(\d+)$")
_H5_NAMES = re.compile(r"^(.+\.(?:h5|hdf5)):(/.*)$")  # FILE.h5:/SAMPLES,/LABELS


def is_builtin_name(spec: str) -> bool:
    return spec == "digits" or spec == "mnist1d" or spec.startswith(("mnist1d:", "synthetic:"))


def builtin_dataset(spec: str, test_fraction: float) -> tuple[Callable[[], Any], Callable[[], None] | None]:
    """``(load, prepare)`` for ``--dataset spec``: ``prepare`` (or None) runs on rank 0 before any
    rank calls ``load``, which builds the data source where data are needed."""
    if spec == "digits":
        return (lambda: ArrayData(load_dataset(spec, test_fraction=test_fraction))), None
    if spec == "mnist1d" or spec.startswith("mnist1d:"):
        samples = _count(spec.partition(":")[2] or str(MNIST1D_SAMPLES), spec, "SAMPLES")
        return (lambda: ArrayData(read_mnist1d(samples))), (lambda: cache_mnist1d(samples))
    if spec.startswith("synthetic:"):
        match = _SYNTHETIC.match(spec)
        if not match:
            raise UserError(f"--dataset {spec}: expected synthetic:CxHxW:CLASSES:SAMPLES, "
                            f"e.g. synthetic:3x32x32:10:50000")
        shape = tuple(int(d) for d in match.group(1).split("x"))
        classes, samples = int(match.group(2)), int(match.group(3))
        if min(shape) < 1 or classes < 2 or samples < 2:
            raise UserError(f"--dataset {spec}: sizes must be at least 1, with 2 classes and 2 samples or more")
        return (lambda: SyntheticData(shape, classes, samples, test_fraction=test_fraction, name=spec)), None
    named = _H5_NAMES.match(spec)
    path, names = (named.group(1), named.group(2)) if named else (spec, "")
    return (lambda: H5Data(path, names, test_fraction=test_fraction, spec=spec)), None


def _count(text: str, spec: str, what: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"--dataset {spec}: {what} must be a positive whole number (got {text!r})")
    return int(text)


# -- MNIST-1D -------------------------------------------------------------------------------------

def cache_dir() -> str:
    return os.environ.get("HPCPS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hpcps")


def mnist1d_path(samples: int) -> str:
    return os.path.join(cache_dir(), f"mnist1d-{samples}.npz")


def cache_mnist1d(samples: int) -> str:
    """Generate MNIST-1D with ``samples`` samples into the cache, unless it is there; return its path."""
    path = mnist1d_path(samples)
    if os.path.exists(path):
        return path
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise UserError("--dataset mnist1d needs the mnist1d package (pip install mnist1d)") from None
    args = get_dataset_args()
    args.num_samples = samples
    d = make_dataset(args)  # generated from templates, offline
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, x=d["x"].astype(np.float32), y=d["y"].astype(np.int64),
                 x_test=d["x_test"].astype(np.float32), y_test=d["y_test"].astype(np.int64))
        os.replace(tmp, path)  # atomic: concurrent jobs see the whole file or none
    except OSError as exc:
        raise UserError(f"--dataset mnist1d: cannot write the cache {path} ({exc}); "
                        f"set HPCPS_CACHE_DIR to a writable directory") from None
    return path


def read_mnist1d(samples: int) -> Dataset:
    """The cached MNIST-1D as (N, 1, 40) float32 signals, its own training/held-out split."""
    path = mnist1d_path(samples)
    try:
        with np.load(path) as f:
            return Dataset("mnist1d" if samples == MNIST1D_SAMPLES else f"mnist1d:{samples}",
                           f["x"][:, None, :], f["y"], f["x_test"][:, None, :], f["y_test"], 10)
    except OSError as exc:
        raise UserError(f"--dataset mnist1d: cannot read the cache {path} ({exc}); is $HPCPS_CACHE_DIR "
                        f"({cache_dir()}) on a file system every node sees?") from None


# -- synthetic ------------------------------------------------------------------------------------

class SyntheticData:
    """``synthetic:CxHxW:CLASSES:SAMPLES``: each sample made from its index when a batch needs it."""

    kind = "synthetic"

    def __init__(self, shape: tuple[int, ...], classes: int, samples: int, *, test_fraction: float,
                 name: str) -> None:
        self.shape, self.classes, self.name = shape, classes, name
        self.train_idx, self.test_idx = split_indices(samples, test_fraction, name)
        self.n_train, self.n_test = len(self.train_idx), len(self.test_idx)
        self.in_shape, self.n_classes = shape, classes
        g = torch.Generator().manual_seed(SPLIT_SEED)
        self.templates = torch.randn((classes, *shape), generator=g)

    def samples(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.empty((len(index), *self.shape))
        g = torch.Generator()
        for k, i in enumerate(index.tolist()):
            g.manual_seed(int(i) + 1)
            torch.randn(self.shape, generator=g, out=x[k])
        y = torch.from_numpy(index % self.classes).long()
        return x.mul_(2.0).add_(self.templates[y]), y  # signal-to-noise 1:2

    def for_worker(self, index: int, n_workers: int, *, batch_size: int, seed: int,
                   device: torch.device, steps: int | None = None, redeal: Redeal | None = None) -> BatchSource:
        return IndexedBatches(self.n_train, index, n_workers, batch_size, seed,
                               lambda idx: self.samples(self.train_idx[idx]), redeal)

    def test_batches(self, batch_size: int) -> Iterable[Any]:
        return OrderedBatches(self.n_test, batch_size, lambda lo, hi: self.samples(self.test_idx[lo:hi]))


# -- HDF5, streamed -------------------------------------------------------------------------------

class H5Data:
    """An HDF5 file's samples, read batch by batch by the rank that needs them (module docstring)."""

    kind = "hdf5"

    def __init__(self, path: str, names: str = "", *, test_fraction: float, spec: str) -> None:
        import h5py

        self.path, self.name = path, spec
        self.x_name, self.y_name = _names(names, spec)
        if not os.path.exists(path):
            raise UserError(f"--dataset {spec}: no such file (and not a known data set name: digits, mnist1d, "
                            f"synthetic:CxHxW:CLASSES:SAMPLES)")
        try:
            with h5py.File(path, "r", locking=False) as f:
                missing = [k for k in (self.x_name, self.y_name) if k not in f]
                if missing:
                    raise UserError(f"--dataset {spec}: missing dataset(s) {', '.join('/' + k for k in missing)}")
                x, y = f[self.x_name], f[self.y_name][()]
                self.in_shape = tuple(x.shape[1:]) or (1,)
                n_x = len(x)
        except OSError as exc:
            raise UserError(f"--dataset {spec}: not a readable HDF5 file ({exc})") from None
        if n_x != len(y):
            raise UserError(f"--dataset {spec}: /{self.x_name} has {n_x} samples but /{self.y_name} has "
                            f"{len(y)} labels")
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
            raise UserError(f"--dataset {spec}: /{self.y_name} must be a 1-d array of non-negative integer labels")
        self.labels = y.astype(np.int64)
        self.n_classes = int(y.max()) + 1
        self.train_idx, self.test_idx = split_indices(n_x, test_fraction, spec)
        self.n_train, self.n_test = len(self.train_idx), len(self.test_idx)
        self._file = None
        self.samples_read = 0  # rows of x this rank has read (tests count them)

    def read(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``rows`` of the file, in the order given: one read of the sorted rows."""
        if self._file is None:
            import h5py

            self._file = h5py.File(self.path, "r", locking=False)
        order = np.argsort(rows, kind="stable")
        try:
            x = self._file[self.x_name][rows[order]]
        except OSError as exc:  # a damaged chunk, a file truncated or changed under the run
            raise RunAborted(f"--dataset {self.name}: cannot read samples {int(rows.min())}-{int(rows.max())} "
                             f"of /{self.x_name} in {self.path} (HDF5: {str(exc).strip()}); is the file damaged, "
                             f"or was it changed during the run?") from None
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        self.samples_read += len(rows)
        x = torch.from_numpy(np.ascontiguousarray(x[back], dtype=np.float32))
        return (x if x.ndim > 1 else x[:, None]), torch.from_numpy(self.labels[rows])

    def for_worker(self, index: int, n_workers: int, *, batch_size: int, seed: int,
                   device: torch.device, steps: int | None = None, redeal: Redeal | None = None) -> BatchSource:
        return _Prefetched(IndexedBatches(self.n_train, index, n_workers, batch_size, seed,
                                           lambda idx: self.read(self.train_idx[idx]), redeal), steps)

    def test_batches(self, batch_size: int) -> Iterable[Any]:
        return OrderedBatches(self.n_test, batch_size, lambda lo, hi: self.read(self.test_idx[lo:hi]))


def _names(names: str, spec: str) -> tuple[str, str]:
    """``/images,/labels`` -> ("images", "labels"); empty -> ("x", "y")."""
    if not names:
        return "x", "y"
    parts = [p.strip().lstrip("/") for p in names.split(",")]
    if len(parts) != 2 or not all(parts):
        raise UserError(f"--dataset {spec}: expected FILE.h5:/SAMPLES,/LABELS, e.g. data.h5:/images,/labels")
    return parts[0], parts[1]


class _Prefetched:
    """Reads batch ``step + 1`` on a helper thread while the caller computes on batch ``step``."""

    def __init__(self, source: IndexedBatches, steps: int | None = None) -> None:
        self.source, self.steps = source, steps  # no read past the last step
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hpcps-prefetch")
        self.ahead: tuple[int, Future] | None = None

    def batch(self, step: int) -> Any:
        if self.ahead is not None and self.ahead[0] == step:
            batch = self.ahead[1].result()
        else:
            batch = self.source.batch(step)
        self.ahead = None
        if self.steps is None or step + 1 < self.steps:
            self.ahead = (step + 1, self.pool.submit(self.source.batch, step + 1))
        return batch
