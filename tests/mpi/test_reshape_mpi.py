"""A checkpoint resumes on another shape of job: another shard count (the flat vector and the optimizer state
cut again) and another worker count (the interrupted epoch's data dealt again)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from hpcps.cluster.slices import Slices
from hpcps.data.sharding import Redeal, resumed_batch_indices
from hpcps.data.loaders import load_dataset
from hpcps.runtime.checkpoints.files import read_checkpoint, read_optimizer_state
from hpcps.training.flat import FlatParameters
from hpcps.training.models import build_model
from mpitest import share, train

pytestmark = pytest.mark.mpi(min_size=5)

STEPS, BATCH, LR, MOMENTUM, SEED = 20, 16, 0.2, 0.9, 7
COMMON = dict(paradigm="bsp", steps=STEPS, batch_size=BATCH, lr=LR, momentum=MOMENTUM, seed=SEED)


def _sub(world, n):
    return world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)


def _checkpoint(world, tmp, name: str = "ck", **extra) -> str:
    """A bsp run of 2 shards and 3 workers with momentum, checkpointed at round 10 of 20."""
    train(tmp / f"written-{name}.h5", servers=2, checkpoint_every=10, checkpoint_dir=str(tmp / name), **COMMON,
          **extra)
    return str(tmp / name / "step-000010.h5")


def _replay(path: str, n_workers: int) -> np.ndarray:
    """The new shape in one process: rounds 10-19 of ``n_workers`` workers on the re-dealt data, momentum SGD
    from the checkpoint's parameters and momentum (each shard's one chunk, laid end to end)."""
    data = load_dataset("digits")
    model = build_model("mlp", data.in_shape, data.n_classes, seed=SEED)
    flat = FlatParameters(model)
    ckpt = read_checkpoint(path)
    flat.params[:] = ckpt.params
    momentum = torch.cat([read_optimizer_state(path, s)["state"][0]["momentum_buffer"] for s in range(2)])
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    redeal = Redeal(tuple(int(c) for c in ckpt.worker_clocks), 10)
    for step in range(10, STEPS):
        idx = np.concatenate([resumed_batch_indices(len(y), batch_size=BATCH, n_workers=n_workers, worker=w,
                                                    step=step, seed=SEED, redeal=redeal) for w in range(n_workers)])
        flat.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        momentum.mul_(MOMENTUM).add_(torch.from_numpy(flat.grads))
        flat.params -= LR * momentum.numpy()
    return flat.params


def _on_two_workers(world, tmp, path: str, name: str) -> dict:
    """Resume ``path`` on 2 workers and its 2 shards (4 ranks): how far the result is from :func:`_replay`'s,
    how far that moved from the checkpoint, and what the file says changed (every rank)."""
    comm, facts = _sub(world, 4), None
    if comm != MPI.COMM_NULL:
        result, t = train(tmp / f"{name}.h5", comm=comm, servers=2, resume=path, **COMMON)
        if comm.rank == 0:
            reference = _replay(path, n_workers=2)
            facts = {"diff": float(np.abs(result.params - reference).max()),
                     "moved": float(np.abs(reference - read_checkpoint(path).params).max()),
                     "shape": t["attrs"]["resumed_shape"], "pushed": int(t["summary"]["gradients_pushed"])}
        comm.Free()
    return share(world, facts)


def _fresh_difference(world, tmp) -> float:
    """How far apart a fresh 1-shard and 2-shard run of the same 3 workers end (float rounding only)."""
    two, _ = train(tmp / "fresh-two.h5", servers=2, **COMMON)
    comm, diff = _sub(world, 4), None
    if comm != MPI.COMM_NULL:
        one, _ = train(tmp / "fresh-one.h5", comm=comm, servers=1, **COMMON)
        comm.Free()
    if world.rank == 0:
        diff = float(np.abs(one.params - two.params).max())
    return world.bcast(diff)


@pytest.mark.timeout(120)
def test_a_two_shard_checkpoint_resumes_on_one_shard_as_on_two(world, mpi_tmp_path):
    """The same 3 workers on 1 shard (4 ranks) and on the checkpoint's 2 (5 ranks): the same parameters to the
    last bit (the slices' cuts on the grid of hpcps.cluster.slices.ALIGN: a fresh 1-shard and 2-shard run
    end alike too), so the parameters and the momentum were cut again right; the file says what changed."""
    path = _checkpoint(world, mpi_tmp_path)
    two, _ = train(mpi_tmp_path / "two.h5", servers=2, resume=path, **COMMON)
    comm, facts = _sub(world, 4), None
    if comm != MPI.COMM_NULL:
        one, t = train(mpi_tmp_path / "one.h5", comm=comm, servers=1, resume=path, **COMMON)
        if comm.rank == 0:
            facts = {"params": one.params, "shape": t["attrs"]["resumed_shape"],
                     "pushed": int(t["summary"]["gradients_pushed"]),
                     "steps": sorted(set(t["workers/iterations"]["step"].tolist()))}
        comm.Free()
    facts = share(world, facts)
    diff = world.bcast(float(np.abs(facts["params"] - two.params).max()) if world.rank == 0 else None)
    fresh = _fresh_difference(world, mpi_tmp_path)
    assert diff == 0 and fresh == 0, (diff, fresh)
    assert facts["shape"] == "2 shard(s) -> 1" and facts["pushed"] == 3 * 10
    assert facts["steps"] == list(range(10, STEPS))


@pytest.mark.timeout(120)
def test_a_three_worker_checkpoint_resumes_on_two_workers_as_that_shape_would_train(world, mpi_tmp_path):
    """2 workers (and the checkpoint's 2 shards, 4 ranks) from round 10: the parameters equal a one-process
    replay of 2 workers on the re-dealt data from the checkpoint's parameters and momentum."""
    facts = _on_two_workers(world, mpi_tmp_path, _checkpoint(world, mpi_tmp_path), "fewer")
    assert facts["moved"] > 1e-3 and facts["diff"] < 1e-5
    assert facts["shape"] == "3 worker(s) at clocks [10, 10, 10] -> 2 at clock 10" and facts["pushed"] == 2 * 10


@pytest.mark.timeout(180)
def test_striped_and_contiguous_slices_resume_each_others_checkpoints(world, mpi_tmp_path):
    """Slices striped (``--partition-mb`` on 2 shards) when the checkpoint was written and contiguous at the
    resume, and the other way: the parameters and the momentum are cut again, and the run ends where the
    resume on the checkpoint's own slices ends, to the last bit."""
    parts = {"partition_mb": 0.004}  # about 1000 values per chunk: the MLP's values dealt in 6 or more
    plain = _checkpoint(world, mpi_tmp_path)
    striped = _checkpoint(world, mpi_tmp_path, "striped", **parts)
    runs = {"same": (plain, {}), "striped->plain": (striped, {}), "plain->striped": (plain, parts),
            "striped->striped": (striped, parts)}
    facts = {}
    for name, (path, extra) in runs.items():
        result, t = train(mpi_tmp_path / f"{name}.h5", servers=2, resume=path, **COMMON, **extra)
        if world.rank == 0:
            facts[name] = (result.params, t["attrs"]["resumed_shape"], int(t["summary"]["gradients_pushed"]))
    facts = share(world, facts if world.rank == 0 else None)
    reference = facts["same"][0]
    for name, (params, shape, pushed) in facts.items():
        assert np.array_equal(params, reference), (name, float(np.abs(params - reference).max()))
        assert pushed == 3 * 10
        assert shape == ("the shards' slices dealt again (--partition-mb)" if name in ("striped->plain",
                                                                                      "plain->striped") else ""), name


@pytest.mark.timeout(120)
def test_a_checkpoint_whose_slices_were_cut_off_the_grid_resumes_as_that_shape_would_train(world, mpi_tmp_path,
                                                                                          monkeypatch):
    """A checkpoint of an hpcps whose shards' cuts fell where the values did (before the grid of
    hpcps.cluster.slices.ALIGN): its optimizer state is cut again from those slices, not read as if they
    were today's, and 2 workers go on from it as a one-process replay from its momentum does."""
    class OffGrid(Slices):
        @classmethod
        def plan(cls, *args, **kw):
            return Slices.plan(*args, **{**kw, "align": 1})

    with monkeypatch.context() as m:
        m.setattr("hpcps.runtime.run.Slices", OffGrid)
        m.setattr("hpcps.runtime.plan.ALIGN", 1)  # what it records: a checkpoint before the grid records none
        path = _checkpoint(world, mpi_tmp_path, "off-grid")
    sizes = [len(read_optimizer_state(path, s)["state"][0]["momentum_buffer"]) for s in range(2)]
    today = Slices.plan(sum(sizes), sum(sizes), 2)  # the MLP has no buffers: its values are all trainable
    assert sizes != [today.length(0), today.length(1)]  # its cut is off today's
    facts = _on_two_workers(world, mpi_tmp_path, path, "off-grid-resumed")
    assert facts["moved"] > 1e-3 and facts["diff"] < 1e-5, facts
    assert facts["shape"].startswith("the shards' slices cut again"), facts
