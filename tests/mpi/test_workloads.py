"""Workloads like the papers' (mpiexec -n 5): ResNet-18 under every paradigm, streamed HDF5 data."""

import h5py
import numpy as np
import pytest

from mpitest import share, train

pytestmark = pytest.mark.mpi(min_size=5)

PARADIGMS = [("bsp", {}), ("asp", {}), ("ssp", {}), ("dssp", {}), ("eager", {}), ("hsp", {}),
             ("grouped", {"groups": 1})]


@pytest.mark.slow
@pytest.mark.parametrize("paradigm,extra", PARADIGMS, ids=[p for p, _ in PARADIGMS])
def test_resnet18_trains_on_synthetic_cifar_shaped_data(world, mpi_tmp_path, paradigm, extra):
    steps = 2
    result, t = train(mpi_tmp_path / f"r18-{paradigm}.h5", paradigm=paradigm, model="resnet18",
                      dataset="synthetic:3x32x32:10:64", steps=steps, batch_size=2, optimizer="sgd", momentum=0.9,
                      lr=0.01, eval_batch_size=16, **extra)
    facts = None
    if world.rank == 0:
        s = t["summary"]
        workers = world.size - 1 - extra.get("groups", 0)
        facts = {"pushed": int(s["gradients_pushed"]), "applied": int(s["gradients_applied"]),
                 "expected": workers * steps, "kind": t["attrs"]["dataset_kind"],
                 "finite": bool(np.isfinite(result.params).all()),
                 "bn_moved": float(np.abs(result.state_dict["1.running_var"].numpy() - 1).max()),
                 "params": sum(v.numel() for k, v in result.state_dict.items() if "running" not in k
                               and "num_batches" not in k)}
    facts = share(world, facts)
    assert facts["pushed"] == facts["applied"] == facts["expected"]
    assert facts["kind"] == "synthetic" and facts["finite"] and facts["params"] == 11_173_962
    assert facts["bn_moved"] > 0  # the workers' BatchNorm statistics reached the servers


def test_hdf5_is_streamed_each_rank_reading_only_its_share(world, mpi_tmp_path):
    """2 shards, 3 workers: a worker reads steps x batch samples, shard 1 none, rank 0 the held-out set
    once per evaluation."""
    path = mpi_tmp_path / "stream.h5"
    if world.rank == 0:
        rng = np.random.default_rng(1)
        with h5py.File(path, "w") as f:
            f["images"] = rng.standard_normal((500, 1, 8, 8)).astype(np.float32)
            f["labels"] = rng.integers(0, 10, 500)
    world.barrier()
    steps, batch = 25, 8
    _, t = train(mpi_tmp_path / "stream-run.h5", paradigm="asp", servers=2, dataset=f"{path}:/images,/labels",
                 steps=steps, batch_size=batch, device="cpu")  # the device column's premise, a GPU visible too
    facts = None
    if world.rank == 0:
        ranks = t["ranks"]
        facts = {"read": {int(r["rank"]): int(r["samples_read"]) for r in ranks},
                 "roles": [r["role"].decode() for r in ranks], "evals": len(t["eval"]),
                 "kind": t["attrs"]["dataset_kind"], "rss": bool((ranks["peak_rss_bytes"] > 0).all()),
                 "devices": [r["device"].decode() for r in ranks]}
    facts = share(world, facts)
    assert facts["roles"] == ["server", "server", "worker", "worker", "worker"] and facts["kind"] == "hdf5"
    assert facts["read"] == {0: 100 * facts["evals"], 1: 0, 2: steps * batch, 3: steps * batch, 4: steps * batch}
    assert facts["rss"] and facts["devices"] == ["cpu"] * 5
