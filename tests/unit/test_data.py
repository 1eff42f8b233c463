"""Data sets and the deterministic batch schedule."""

import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpcps.data.sharding import batch_indices, batches_per_epoch
from hpcps.data.loaders import load_dataset
from hpcps.errors import UserError


def test_digits_split_is_fixed_and_disjoint():
    a, b = load_dataset("digits"), load_dataset("digits")
    assert a.x_train.shape == (1438, 1, 8, 8) and a.x_test.shape == (359, 1, 8, 8) and a.n_classes == 10
    assert np.array_equal(a.y_test, b.y_test)
    assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0


def test_digits_are_scikit_learns_exactly_and_load_without_importing_it():
    """The bundled CSV read directly gives load_digits' arrays bit for bit, and a fresh interpreter that loads
    ``digits`` never imports scikit-learn (its import was most of a small run's start-up)."""
    from sklearn.datasets import load_digits

    from hpcps.data.loaders import _digits_file

    images, target = _digits_file()
    bunch = load_digits()
    assert images.dtype == bunch.images.dtype and target.dtype == bunch.target.dtype
    assert np.array_equal(images, bunch.images) and np.array_equal(target, bunch.target)
    probe = ("import sys; from hpcps.data.loaders import load_dataset; load_dataset('digits'); "
             "print('sklearn' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"


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


@pytest.mark.parametrize("old_clocks,new_workers", [((10, 12, 9, 14), 3), ((7, 7, 7), 5), ((40, 3), 4)])
def test_the_interrupted_epoch_is_dealt_again_without_a_sample_twice_or_skipped(old_clocks, new_workers):
    """Workers that stopped at ``old_clocks`` (bsp's equal clocks in the second case; in the third, worker 0
    an epoch ahead of worker 1, 31 batches an epoch): the new workers' re-dealt batches hold exactly what
    the old ones had not taken of their current epochs (a sample left in two epochs comes twice, once for
    each), all of it but less than a batch per new worker, as many batches each; with one interrupted
    epoch no sample comes twice or was taken already; then the new schedule goes on at the next epoch."""
    from hpcps.data.sharding import Redeal, _epoch_order, batches_per_epoch, redealt_batches, resumed_batch_indices

    n, b, seed, old_n = 1000, 16, 3, len(old_clocks)
    per_old = batches_per_epoch(n, batch_size=b, n_workers=old_n)
    redeal = Redeal(old_clocks, min(old_clocks))
    taken, dealt = [], []
    for w, clock in enumerate(old_clocks):
        epoch, k = divmod(clock, per_old)
        share = _epoch_order(n, seed, epoch)[w::old_n][:per_old * b]
        taken.append(share[:k * b])
        dealt.append(share)
    new = [redealt_batches(n, batch_size=b, redeal=redeal, n_workers=new_workers, worker=w, seed=seed)
           for w in range(new_workers)]
    from collections import Counter

    again = Counter(np.concatenate([x for pre, _ in new for x in pre]).tolist())
    rest = Counter(np.concatenate([d[len(t):] for d, t in zip(dealt, taken)]).tolist())
    assert not again - rest  # only what the old workers had not taken, each as often as it was left
    assert 0 <= (rest - again).total() < new_workers * b  # and all of it but less than a batch per worker
    if len({c // per_old for c in old_clocks}) == 1:  # one interrupted epoch: no sample twice in it
        assert max(again.values()) == 1 and not set(again) & set(np.concatenate(taken).tolist())
    assert len({len(pre) for pre, _ in new}) == 1  # every new worker takes as many batches
    pre, epoch = new[0]
    after = resumed_batch_indices(n, batch_size=b, n_workers=new_workers, worker=0, step=redeal.start + len(pre),
                                  seed=seed, redeal=redeal)
    assert epoch == max(c // per_old for c in old_clocks) + 1
    assert np.array_equal(after, batch_indices(n, batch_size=b, n_workers=new_workers, worker=0,
                                               step=epoch * batches_per_epoch(n, batch_size=b, n_workers=new_workers),
                                               seed=seed))
