"""The GPU transfer modes, exercised on the CPU (1 server or 2 shards + workers, mpiexec -n 5).

``staged`` copies between the model and separate host buffers at every
pull and push, as on a GPU without a CUDA-aware MPI; ``direct`` also hands
MPI torch tensors instead of numpy arrays, as on a GPU with one. Neither
may change a single bit of what BSP computes.
"""

import json

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpitest import force_transfer, share, train
from hpcps.data.loaders import load_dataset
from hpcps.errors import UserError
from hpcps.training.flat import FlatParameters
from hpcps.training.models import build_model
from hpcps.cluster.topology import node_local_index

pytestmark = pytest.mark.mpi(min_size=5)


@pytest.mark.parametrize("transfer", ["staged", "direct"])
def test_bsp_ends_bit_for_bit_as_with_shared_buffers(world, mpi_tmp_path, monkeypatch, transfer):
    common = dict(paradigm="bsp", steps=15, servers=2, batch_size=16, lr=0.2, seed=6)
    shared, _ = train(mpi_tmp_path / "shared.h5", device="cpu", **common)  # on the CPU where a GPU is visible too
    force_transfer(monkeypatch, transfer)
    moved, t = train(mpi_tmp_path / f"{transfer}.h5", **common)
    facts = None
    if world.rank == 0:
        facts = {"equal": bool(np.array_equal(shared.params, moved.params)),
                 "trained": float(np.abs(shared.params - train_start(common)).max()),
                 "devices": json.loads(t["attrs"]["devices"]),
                 "applied": int(t["summary"]["gradients_applied"])}
    facts = share(world, facts)
    assert facts["trained"] > 1e-2, "nothing trained: the comparison would be empty"
    assert facts["equal"]
    assert facts["applied"] == 3 * 15
    how = "staged through host memory" if transfer == "staged" else "pushed from device memory"
    assert facts["devices"] == ["cpu"] * 2 + [f"cpu, {how} (forced by the test)"] * 3


def train_start(common):
    """The parameters every rank starts from (the model's initialisation)."""
    data = load_dataset("digits")
    return FlatParameters(build_model("mlp", data.in_shape, data.n_classes, seed=common["seed"])).params


def test_a_nan_injected_on_the_device_side_is_still_dropped(world, mpi_tmp_path, monkeypatch):
    """The fault goes into the model's gradient, before staging: the host copy must carry it to the server."""
    force_transfer(monkeypatch, "staged")
    _, t = train(mpi_tmp_path / "nan.h5", paradigm="bsp", steps=10, fault=["nan@3:4"])
    facts = None
    if world.rank == 0:
        up = t["servers/updates"]
        dropped = up[up["applied"] == 0]
        facts = {"dropped": [(int(r["worker"]), int(r["worker_clock"]), int(r["reason"])) for r in dropped]}
    facts = share(world, facts)
    assert facts["dropped"] == [(3, 5, 1)]  # worker rank 3's gradient of step 4 (its 5th), reason 1: non-finite


def test_workers_are_numbered_among_the_workers_of_their_node(world):
    everyone = world.allgather(node_local_index(world, members=range(1, world.size)))
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = share(world, node.size == world.size)
    node.Free()
    if not one_node:
        pytest.skip("the ranks are spread over nodes")
    assert everyone == [None, *range(world.size - 1)]  # the server takes no GPU, the workers 0, 1, ...


def test_device_cuda_without_a_gpu_fails_on_every_rank_with_one_message(world, mpi_tmp_path):
    if torch.cuda.device_count():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UserError, match=r"^ranks 1-4: --device cuda: this rank sees no CUDA device [^;]*$"):
        train(mpi_tmp_path / "cuda.h5", paradigm="bsp", steps=2, device="cuda")
