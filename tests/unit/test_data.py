"""Data sets and the deterministic batch schedule."""

import h5py
import numpy as np
import pytest

from hpcps.data.sharding import batch_indices, batches_per_epoch, load_dataset
from hpcps.errors import UserError


def test_digits_split_is_fixed_and_disjoint():
    a, b = load_dataset("digits"), load_dataset("digits")
    assert a.x_train.shape == (1438, 1, 8, 8) and a.x_test.shape == (359, 1, 8, 8) and a.n_classes == 10
    assert np.array_equal(a.y_test, b.y_test)
    assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0


def test_workers_see_disjoint_batches_within_an_epoch():
    n, bs, workers = 1438, 32, 4
    per_epoch = batches_per_epoch(n, batch_size=bs, n_workers=workers)
    assert per_epoch == 11
    seen = [batch_indices(n, batch_size=bs, n_workers=workers, worker=w, step=s, seed=3)
            for w in range(workers) for s in range(per_epoch)]
    flat = np.concatenate(seen)
    assert len(flat) == workers * per_epoch * bs == len(np.unique(flat))
    again = batch_indices(n, batch_size=bs, n_workers=workers, worker=2, step=5, seed=3)
    assert np.array_equal(again, seen[2 * per_epoch + 5])
    next_epoch = batch_indices(n, batch_size=bs, n_workers=workers, worker=2, step=5 + per_epoch, seed=3)
    assert not np.array_equal(next_epoch, again)


def test_hdf5_dataset_loads(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.random.default_rng(0).random((50, 3), dtype=np.float32)
        f["y"] = np.arange(50) % 3
    d = load_dataset(str(path))
    assert d.in_shape == (3,) and d.n_classes == 3 and len(d.y_train) + len(d.y_test) == 50


@pytest.mark.parametrize("content,message", [
    ({"x": np.zeros((5, 2)), "y": np.zeros(4, int)}, r"/x has 5 samples but /y has 4 labels"),
    ({"x": np.zeros((5, 2))}, r"missing dataset\(s\) /y"),
    ({"x": np.zeros((5, 2)), "y": np.zeros(5)}, r"/y must be .* integer labels"),
])
def test_bad_hdf5_datasets_are_named(tmp_path, content, message):
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        for k, v in content.items():
            f[k] = v
    with pytest.raises(UserError, match=message):
        load_dataset(str(path))


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(UserError, match=r"--dataset .*nope.h5: no such file"):
        load_dataset(str(tmp_path / "nope.h5"))
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5 at all")
    with pytest.raises(UserError, match=r"not a readable HDF5 file"):
        load_dataset(str(junk))
