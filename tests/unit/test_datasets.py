"""Built-in data sets by name and the built-in models (no MPI)."""

import h5py
import numpy as np
import pytest
import torch

from hpcps.data.sharding import batch_indices
from hpcps.data.loaders import load_dataset
from hpcps.data.datasets import SyntheticData, builtin_dataset, cache_mnist1d, read_mnist1d
from hpcps.errors import UserError
from hpcps.training.models import MODELS, torchvision_model


@pytest.fixture
def h5file(tmp_path):
    path = tmp_path / "d.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["images"] = rng.standard_normal((200, 1, 4, 4)).astype(np.float32)
        f["labels"] = rng.integers(0, 5, 200)
        f["x"], f["y"] = f["images"][()], f["labels"][()]
    return path


def test_streamed_hdf5_has_the_in_memory_split_and_reads_only_the_workers_own_rows(h5file):
    load, prepare = builtin_dataset(f"{h5file}:/images,/labels", 0.2)
    source = load()
    memory = load_dataset(str(h5file))
    assert prepare is None and source.kind == "hdf5" and (source.n_train, source.n_test) == (160, 40)
    assert source.in_shape == (1, 4, 4) and source.n_classes == memory.n_classes
    read = []
    original = source.read
    source.read = lambda rows: (read.extend(rows.tolist()), original(rows))[1]
    batches = source.for_worker(1, 4, batch_size=10, seed=3, device=torch.device("cpu"), steps=4)
    for step in range(4):  # one epoch is 4 batches of 10 for each of 4 workers
        x, y = batches.batch(step)
        idx = batch_indices(160, batch_size=10, n_workers=4, worker=1, step=step, seed=3)
        assert torch.equal(x, torch.from_numpy(memory.x_train[idx])) and torch.equal(y, torch.from_numpy(memory.y_train[idx]))
    share = np.concatenate([batch_indices(160, batch_size=10, n_workers=4, worker=1, step=k, seed=3) for k in range(4)])
    assert sorted(read) == sorted(source.train_idx[share].tolist())  # its own 40 rows, each once, no more
    assert source.samples_read == 40
    test = [b for b in source.test_batches(16)]
    assert [len(b[1]) for b in test] == [16, 16, 8]
    assert torch.equal(torch.cat([b[0] for b in test]), torch.from_numpy(memory.x_test))


@pytest.mark.parametrize("spec,message", [
    ("{file}:/images,/nope", "missing dataset(s) /nope"),
    ("{file}:/images", "expected FILE.h5:/SAMPLES,/LABELS"),
    ("/nonexistent/d.h5", "no such file"),
    ("synthetic:3x32:10", "expected synthetic:CxHxW:CLASSES:SAMPLES"),
    ("synthetic:3x0x4:10:100", "sizes must be at least 1"),
    ("mnist1d:lots", "SAMPLES must be a positive whole number"),
])
def test_bad_data_set_names_are_one_line(h5file, spec, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load, _ = builtin_dataset(spec.format(file=h5file), 0.2)
        load()


def test_synthetic_samples_depend_on_their_index_only_and_can_be_learnt():
    load, _ = builtin_dataset("synthetic:3x8x8:4:100", 0.2)
    source = load()
    assert isinstance(source, SyntheticData) and source.kind == "synthetic"
    assert (source.n_train, source.n_test, source.in_shape, source.n_classes) == (80, 20, (3, 8, 8), 4)
    x1, y1 = source.samples(np.array([7, 3]))
    x2, y2 = source.samples(np.array([3]))
    assert torch.equal(x1[1], x2[0]) and y1.tolist() == [3, 3] and y2.tolist() == [3]
    # class templates: a sample is nearer its own class's template than the others'
    x, y = source.samples(np.arange(100))
    distance = ((x[:, None] - source.templates[None]) ** 2).flatten(2).sum(2)
    assert float((distance.argmin(1) == y).double().mean()) > 0.9


def test_mnist1d_is_generated_once_into_the_cache(tmp_path, monkeypatch):
    pytest.importorskip("mnist1d", reason="needs the mnist1d package (pip install mnist1d)")
    monkeypatch.setenv("HPCPS_CACHE_DIR", str(tmp_path))
    path = cache_mnist1d(500)
    stamp = (tmp_path / "mnist1d-500.npz").stat().st_mtime_ns
    assert cache_mnist1d(500) == path and (tmp_path / "mnist1d-500.npz").stat().st_mtime_ns == stamp
    data = read_mnist1d(500)
    assert data.x_train.shape == (400, 1, 40) and data.x_test.shape == (100, 1, 40) and data.n_classes == 10
    assert data.x_train.dtype == np.float32 and set(np.unique(data.y_train)) <= set(range(10))


def test_cnn1d_at_25_channels_is_the_papers_convbase():
    assert sum(p.numel() for p in MODELS["cnn1d"]((1, 40), 10, hidden=25).parameters()) == 5210


@pytest.mark.parametrize("name,shape,params", [
    ("cnn1d", (1, 40), 28_298),  # the MNIST-1D paper's layout at 64 channels: 3 strided convolutions, 320 -> 10
    ("resnet18", (3, 32, 32), 11_173_962),  # the CIFAR ResNet-18 everyone quotes
    ("resnet50", (3, 32, 32), 23_520_842),
])
def test_builtin_models_have_their_published_sizes(name, shape, params):
    model = MODELS[name](shape, 10)
    assert sum(p.numel() for p in model.parameters()) == params
    model.eval()
    with torch.no_grad():
        assert model(torch.zeros(2, *shape)).shape == (2, 10)
    with pytest.raises(UserError, match=f"--model {name} needs inputs of shape"):
        MODELS[name]((64,), 10)


def test_torchvision_models_need_a_working_torchvision():
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # the registry's CUDA wheels fail against a CPU torch
        with pytest.raises(UserError, match="torchvision does not import here"):
            torchvision_model("resnet18")
        pytest.skip(f"torchvision does not import here ({type(exc).__name__}: {exc}); checked the error instead")
    model = torchvision_model("resnet18")((3, 32, 32), 7)
    assert model.fc.out_features == 7


def test_a_damaged_chunk_is_one_error_naming_the_file_and_the_samples(tmp_path):
    """A gzip chunk of /x overwritten with garbage: the read that meets it raises RunAborted (one line on the
    failing rank, no traceback) naming the file, the data set and the samples (it was a bare OSError)."""
    from hpcps.data.datasets import H5Data
    from hpcps.errors import RunAborted

    path = tmp_path / "damaged.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.random.default_rng(0).random((200, 16), dtype=np.float32), chunks=(50, 16),
                         compression="gzip")
        f["y"] = np.arange(200) % 4
    with h5py.File(path, "r") as f:
        info = f["x"].id.get_chunk_info(1)  # samples 50-99
    with open(path, "r+b") as raw:
        raw.seek(info.byte_offset)
        raw.write(b"\xff" * info.size)
    data = H5Data(str(path), test_fraction=0.2, spec=str(path))
    data.read(np.arange(0, 40))  # an intact chunk reads
    with pytest.raises(RunAborted, match=rf"--dataset {path}: cannot read samples 60-70 of /x in {path} \(HDF5: "):
        data.read(np.arange(60, 71))
