"""``--partition-mb``: partitioned, prioritised pulls end to end (mpiexec -n 5). The pass starts before the
pull is complete, so what it computes on must still be exactly the version pulled: bsp with partitions ends
with the very parameters (and BatchNorm statistics) of bsp without, on 1 and 2 shards, in fp32 and bf16;
and the paradigms that pull between steps lose nothing with them."""

import json

import numpy as np
import pytest

from mpitest import force_transfer, share, train

pytestmark = pytest.mark.mpi(min_size=5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model,dataset,servers,compress,extra", [
    ("mlp", "digits", 1, "none", {}),
    ("resnet18", "synthetic:3x8x8:10:64", 2, "none", {}),  # BatchNorm, slices striped over 2 shards
    ("mlp", "digits", 2, "bf16", {}),  # 16-bit pulls widened partition by partition
    # striped slices cut AdamW's param groups (decay on matrices only) otherwise than contiguous ones
    ("mlp", "digits", 3, "none", {"optimizer": "adamw", "weight_decay": 0.1}),
    # one group: its server is the central shards' only client, and pushes to them in their wire order
    ("mlp", "digits", 2, "none", {"paradigm": "grouped", "groups": 1}),
    # pulls reading one shard at a time, each worker from its own shard on (both runs: whole pulls too)
    ("mlp", "digits", 3, "none", {"shards_at_once": 1}),
    ("mlp", "digits", 3, "none", {"momentum": 0.9, "steps": 12}),
    ("mlp", "digits", 2, "none", {"optimizer": "adam", "lr": 0.01, "steps": 12}),
], ids=["mlp-1", "resnet18-2", "bf16-2", "adamw-3", "grouped-2", "fanin-3", "mom-3", "adam-2"])
def test_bsp_with_partitioned_pulls_ends_bit_for_bit_as_without(world, mpi_tmp_path, model, dataset,
                                                                servers, compress, extra):
    """With several shards, partitions also stripe the shards' slices (hpcps.cluster.slices): the same values
    are stepped the same way, only held elsewhere. With torch's fused kernels too (the default): they round
    a tensor's last values otherwise than the rest on AVX-512 CPUs, and the cuts on the grid of
    hpcps.cluster.slices.ALIGN end every tensor where the whole pull's would (striped adamw chunks ended
    1 ulp apart before)."""
    # on the CPU, a visible GPU too: bit for bit needs deterministic kernels, and CUDA's defaults (cuDNN's
    # convolutions) are not; test_cuda_mpi.py holds partitions on the GPU to the GPU's own run-to-run spread
    common = {"paradigm": "bsp", "model": model, "dataset": dataset, "servers": servers, "compress": compress,
              "steps": 6, "batch_size": 8, "seed": 4, "lr": 0.05, "eval_every": 1000, "device": "cpu", **extra}
    name = f"{model}-{compress}-{servers}-{len(extra)}"
    whole, _ = train(mpi_tmp_path / f"whole-{name}.h5", **common)
    # a few KB per partition: dozens of partitions, some cut inside a layer, some across the shards' bound
    parted, t = train(mpi_tmp_path / f"parted-{name}.h5", partition_mb=0.004, **common)
    facts = None
    if world.rank == 0:
        facts = {"same": np.array_equal(whole.params, parted.params),  # parameters, then the float buffers
                 "max_diff": float(np.abs(whole.params - parted.params).max()),
                 "pushed": int(t["summary"]["gradients_pushed"]), "applied": int(t["summary"]["gradients_applied"])}
    facts = share(world, facts)
    assert facts["same"], facts
    workers = 5 - servers - extra.get("groups", 0)
    assert facts["pushed"] == facts["applied"] == workers * common["steps"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("paradigm", ["asp", "ssp", "hsp", "grouped"])
def test_the_paradigms_that_pull_between_steps_lose_nothing_with_partitions(world, mpi_tmp_path, paradigm):
    steps = 12
    _, t = train(mpi_tmp_path / f"parts-{paradigm}.h5", paradigm=paradigm, partition_mb=0.004, steps=steps,
                 seed=1, compute_time=0.002, compute_forward=0.5, slowdown=["4=2"],
                 **({"groups": 1} if paradigm == "grouped" else {}))
    facts = None
    if world.rank == 0:
        s, it = t["summary"], t["workers/iterations"]
        facts = {"pushed": int(s["gradients_pushed"]), "handled": int(s["gradients_applied"] + s["gradients_dropped"]),
                 "pull_s": bool((it["pull_s"] >= it["pull_wait_s"] - 1e-12).all() and (it["pull_s"] >= 0).all())}
    facts = share(world, facts)
    workers = 3 if paradigm == "grouped" else 4
    assert facts["pushed"] == facts["handled"] == workers * steps
    assert facts["pull_s"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transfer,model,dataset", [("staged", "mlp", "digits"), ("direct", "mlp", "digits"),
                                                    ("staged", "resnet18", "synthetic:3x8x8:10:64")],
                         ids=["staged", "direct", "staged-resnet18"])
def test_a_gpu_workers_partitions_go_up_as_they_come_and_bsp_ends_bit_for_bit(world, mpi_tmp_path, monkeypatch,
                                                                               transfer, model, dataset):
    """A GPU worker's pull lands in host memory and each partition is uploaded as it comes (the GPU paths,
    on the CPU): bsp ends with the parameters of whole pulls on CPU workers.

    ResNet-18's partitions go up while its forward pass runs, after layers that saved their parameters
    for backward: the upload must not look to autograd like a change of those (it once failed every
    worker's backward, seen first on a GPU)."""
    common = {"paradigm": "bsp", "model": model, "dataset": dataset, "servers": 2, "steps": 6, "batch_size": 8,
              "seed": 4, "lr": 0.05, "eval_every": 1000}
    whole, _ = train(mpi_tmp_path / f"whole-{transfer}.h5", device="cpu", **common)  # a visible GPU too
    force_transfer(monkeypatch, transfer)
    parted, t = train(mpi_tmp_path / f"parted-{transfer}.h5", partition_mb=0.004, **common)
    facts = None
    if world.rank == 0:
        facts = {"same": np.array_equal(whole.params, parted.params), "applied": int(t["summary"]["gradients_applied"]),
                 "devices": json.loads(t["attrs"]["devices"])}
    facts = share(world, facts)
    assert facts["same"] and facts["applied"] == 3 * 6
    assert all("forced by the test" in d for d in facts["devices"][2:])


@pytest.mark.timeout(120)
def test_the_locked_window_says_it_ignores_the_fan_in_and_loses_nothing(world, mpi_tmp_path, monkeypatch, capsys):
    """The locked protocol reads every shard at once under locks: --shards-at-once is named in a warning, not
    dropped without a word, and the run trains what it would."""
    monkeypatch.setenv("HPCPS_WINDOW", "locked")
    _, t = train(mpi_tmp_path / "locked-fanin.h5", paradigm="bsp", servers=2, shards_at_once=1, steps=4, seed=2)
    said = capsys.readouterr().err  # (the run's log handler writes to the stderr it found at its start)
    facts = None
    if world.rank == 0:
        facts = {"warned": "--shards-at-once 1: ignored by the locked window protocol" in said,
                 "pushed": int(t["summary"]["gradients_pushed"]), "applied": int(t["summary"]["gradients_applied"])}
    facts = share(world, facts)
    assert facts == {"warned": True, "pushed": 12, "applied": 12}
