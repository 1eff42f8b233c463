"""Where a shard's slice is stepped (:mod:`hpcps.runtime.residence`): in place in the master, or on a device
with a copy up per gradient and a copy down per update."""

import numpy as np
import pytest
import torch

from hpcps.errors import UserError
from hpcps.runtime.residence import DeviceSlice, HostSlice, pinned, place, shard_device
from hpcps.training.optim import ShardOptimizer, builtin_optimizer


def test_a_host_slice_is_the_master_itself_and_reads_gradients_where_they_were_received():
    master = np.arange(4, dtype=np.float32)
    home = HostSlice(master)
    home.tensor.add_(1)
    assert master.tolist() == [1, 2, 3, 4]
    received = torch.ones(4)
    assert home.upload(received) is received
    assert not home.pinned and home.device == torch.device("cpu")


def test_a_device_slice_is_a_copy_apart_that_comes_down_into_the_master_only_when_asked():
    master = np.arange(4, dtype=np.float32)
    home = DeviceSlice(master, torch.device("cpu"))
    home.tensor.add_(1)
    assert master.tolist() == [0, 1, 2, 3]  # the window's master is untouched until the download
    home.download()
    assert master.tolist() == [1, 2, 3, 4]
    received = torch.full((4,), 2.0)
    up = home.upload(received)
    received.fill_(7)  # the receive buffer is MPI's again: the next push lands in it
    assert up.tolist() == [2, 2, 2, 2]
    assert not home.pinned  # pinned receive buffers on a GPU only


def test_shard_device_puts_the_ith_shard_of_a_node_on_its_ith_gpu_and_refuses_cuda_without_one():
    assert shard_device("host", 0, 4) is None
    assert shard_device("cpu", 3, 0) == torch.device("cpu")
    assert shard_device("cuda", 1, 4) == torch.device("cuda", 1)
    assert shard_device("cuda", 5, 4) == torch.device("cuda", 1)  # more shards than GPUs: round robin
    with pytest.raises(UserError, match="--server-device cuda: this shard's rank sees no CUDA device"):
        shard_device("cuda", 0, 0)
    with pytest.raises(UserError, match="one of host, cpu, cuda"):
        shard_device("gpu", 0, 1)
    assert isinstance(place(np.zeros(2, np.float32), None), HostSlice)
    assert isinstance(place(np.zeros(2, np.float32), torch.device("cpu")), DeviceSlice)


def test_an_optimizer_over_a_device_slice_steps_as_over_the_master_and_keeps_its_sum_there():
    """Adam with two gradients per update (the summed path) and momentum state: the same bits."""
    start = np.linspace(-1, 1, 700, dtype=np.float32)
    grads = [torch.from_numpy(np.sin(np.arange(700, dtype=np.float32) * k)) for k in (1, 2, 3, 4)]
    host_master, dev_master = start.copy(), start.copy()
    host = ShardOptimizer(HostSlice(host_master).tensor, builtin_optimizer("adam", lr=0.01), lambda v: 1.0, chunk=256)
    home = DeviceSlice(dev_master, torch.device("cpu"))
    dev = ShardOptimizer(home.tensor, builtin_optimizer("adam", lr=0.01), lambda v: 1.0, chunk=256)
    for k in range(3):
        pair = grads[k:k + 2]
        host.step(pair, [0.5, 0.5], version=k, factor=1.0)
        dev.step([home.upload(g) for g in pair], [0.5, 0.5], version=k, factor=1.0)
    home.download()
    assert not np.array_equal(host_master, start)
    assert np.array_equal(host_master, dev_master)
    assert dev._sum.device == home.tensor.device
    saved = dev.state_dict()["state"][0]
    assert all(v.device.type == "cpu" for v in saved.values() if isinstance(v, torch.Tensor))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a slice on a GPU needs one")
def test_on_a_gpu_the_receive_buffers_are_pinned_and_the_slice_steps_as_on_the_host_within_rounding():
    buffers = pinned((2, 700), np.float32)
    assert torch.from_numpy(buffers).is_pinned()
    start = np.linspace(-1, 1, 700, dtype=np.float32)
    host_master, dev_master = start.copy(), start.copy()
    host = ShardOptimizer(HostSlice(host_master).tensor, builtin_optimizer("adamw", lr=0.01), lambda v: 1.0)
    home = DeviceSlice(dev_master, torch.device("cuda", 0))
    assert home.pinned and home.tensor.device.type == "cuda"
    dev = ShardOptimizer(home.tensor, builtin_optimizer("adamw", lr=0.01), lambda v: 1.0)
    for k in range(3):
        buffers[0] = np.sin(np.arange(700, dtype=np.float32) * (k + 1))
        host.step([torch.from_numpy(buffers[0])], [1.0], version=k, factor=1.0)
        dev.step([home.upload(torch.from_numpy(buffers[0]))], [1.0], version=k, factor=1.0)
    home.download()
    np.testing.assert_allclose(dev_master, host_master, rtol=1e-5, atol=1e-6)
    saved = dev.state_dict()["state"][0]
    assert all(v.device.type == "cpu" for v in saved.values() if isinstance(v, torch.Tensor))
    dev.load_state_dict(dev.state_dict())  # host tensors back onto the GPU, as torch.optim puts state by its param
    assert dev.optimizer.state[dev.chunks[0]]["exp_avg"].device.type == "cuda"
