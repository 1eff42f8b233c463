"""Model parameters and gradients are views into the flat buffers."""

import numpy as np
import torch
import torch.nn.functional as F

from hpcps.training.flat import FlatParameters
from hpcps.training.models import build_model


def test_parameters_are_views_into_one_buffer():
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    flat = FlatParameters(model)
    assert flat.size == sum(p.numel() for p in before) == 64 * 128 + 128 + 128 * 10 + 10
    assert np.array_equal(flat.params, np.concatenate([b.reshape(-1).numpy() for b in before]))
    flat.params[:] = 0.5  # a pull writes here ...
    assert all(torch.all(p == 0.5) for p in model.parameters())  # ... and the model sees it


def test_backward_writes_the_flat_gradient_buffer():
    model = build_model("cnn", (1, 8, 8), 10, seed=1)
    flat = FlatParameters(model)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    F.cross_entropy(model(x), y).backward()
    expected = np.concatenate([p.grad.reshape(-1).numpy() for p in model.parameters()])
    assert np.abs(flat.grads).sum() > 0 and np.array_equal(flat.grads, expected)
    flat.zero_grad()
    assert all(torch.all(p.grad == 0) for p in model.parameters())


def test_a_model_that_does_not_fit_the_data_is_a_clear_error():
    import pytest

    from hpcps.errors import UserError

    with pytest.raises(UserError, match=r"--model cnn needs inputs of shape \(channels, height, width\)"):
        build_model("cnn", (64,), 10, seed=0)
    with pytest.raises(UserError, match=r"--model: unknown model 'resnet'"):
        build_model("resnet", (1, 8, 8), 10, seed=0)


def _backward(model):
    x, y = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(3)), torch.tensor([0, 1, 2, 3])
    F.cross_entropy(model(x), y).backward()
    return np.concatenate([p.grad.reshape(-1).numpy() for p in model.parameters()])


def test_shared_transfer_copies_nothing():
    flat = FlatParameters(build_model("mlp", (1, 8, 8), 10, seed=0))
    assert flat.transfer == "shared"
    assert np.shares_memory(flat.params, flat.params_t.numpy()) and flat.push_grads is flat.grads
    assert np.shares_memory(flat.grads, flat.grads_t.numpy())


def test_staged_transfer_keeps_host_and_model_apart_until_told():
    """The GPU path without a GPU: ``staged`` copies between the host side and the model only when asked."""
    model = build_model("cnn", (1, 8, 8), 10, seed=1)
    initial = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
    flat = FlatParameters(model, "cpu", "staged")
    assert np.array_equal(flat.params, initial)  # the host side starts as the model
    assert not np.shares_memory(flat.params, flat.params_t.numpy())
    flat.params[:] = 0.25  # a pull lands on the host side ...
    assert not any(torch.any(p == 0.25) for p in model.parameters())  # ... the model has not seen it ...
    flat.upload()
    assert all(torch.all(p == 0.25) for p in model.parameters())  # ... until the upload
    expected = _backward(model)
    assert not np.array_equal(flat.grads, expected)  # backward wrote the model's gradient only
    flat.stage_grads()
    assert np.abs(expected).sum() > 0 and np.array_equal(flat.grads, expected)
    slot = flat.new_push_buffer()
    assert isinstance(slot, np.ndarray) and not np.shares_memory(slot, flat.grads)
    flat.stage_grads(slot)
    assert np.array_equal(slot, expected)


def test_direct_transfer_pushes_the_models_gradient_tensor():
    model = build_model("mlp", (1, 8, 8), 10, seed=2)
    flat = FlatParameters(model, "cpu", "direct")
    assert flat.grads is None and flat.push_grads is flat.grads_t  # no host copy of the gradient at all
    expected = _backward(model)
    slot = flat.new_push_buffer()
    assert isinstance(slot, torch.Tensor) and slot.data_ptr() != flat.grads_t.data_ptr()
    flat.stage_grads(slot)
    assert np.array_equal(slot.numpy(), expected)
    flat.params[:] = -1.0
    flat.upload()  # parameters still come through the host, where the windows are
    assert all(torch.all(p == -1.0) for p in model.parameters())


def test_gpu_memory_cannot_be_shared_with_mpi():
    import pytest

    with pytest.raises(ValueError, match="'shared' is for CPU training"):
        FlatParameters(build_model("mlp", (1, 8, 8), 10, seed=0), "cuda:0", "shared")


def test_swapping_the_parameter_array_repoints_every_parameter_and_buffer_without_a_copy():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    flat = FlatParameters(model)
    weight = model[0].weight  # the same tensor object afterwards: optimizers and hooks keep theirs
    new = np.arange(flat.size, dtype=np.float32)
    old = flat.swap_params(new)
    assert flat.params is new and torch.from_numpy(new).data_ptr() == flat.params_t.data_ptr()
    # (model_t and its views too: left on the old array, they would read what the next pull writes there)
    assert flat.model_t.data_ptr() == flat.params_t.data_ptr()
    assert [v.data_ptr() for v in flat._model_views] == [flat.params_t[o:o + n].data_ptr() for *_, o, n in flat.spans]
    assert model[0].weight is weight and weight.data_ptr() == flat.params_t.data_ptr()
    assert np.array_equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(),
                          new[:flat.n_params])
    assert np.array_equal(model[1].running_mean.numpy(), new[flat.n_params:flat.n_params + 4])
    new[0] = -7.0  # a later pull into the array lands in the model
    assert float(model[0].weight[0, 0]) == -7.0
    x = torch.randn(5, 3)
    model(x).sum().backward()  # the gradients still land in the flat gradient buffer
    assert float(np.abs(flat.grads[:flat.n_params]).sum()) > 0
    assert flat.swap_params(old) is new


def test_swapping_under_staged_transfers_swaps_the_host_array_and_upload_copies_it():
    model = torch.nn.Linear(3, 2)
    flat = FlatParameters(model, transfer="staged")
    new = np.full(flat.size, 0.5, np.float32)
    flat.swap_params(new)
    assert flat.params is new and not torch.equal(model.weight.detach(), torch.full((2, 3), 0.5))
    flat.upload()
    assert torch.equal(model.weight.detach(), torch.full((2, 3), 0.5))


def _odd_bn_model():
    """Odd sizes before BatchNorm (80 + 55 values), so that packed end to end its weight and running
    statistics would begin off any 16-byte boundary."""
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(7, 10), torch.nn.Linear(10, 5), torch.nn.BatchNorm1d(5),
                               torch.nn.Linear(5, 3))


def test_off_the_cpu_every_tensor_of_the_model_begins_on_a_512_byte_boundary():
    """The model's own copy (a device's) gives each parameter and float buffer the alignment a tensor of its
    own would have; params_t stays packed end to end, as MPI sends it."""
    model = _odd_bn_model()
    flat = FlatParameters(model, "cpu", "staged")
    base = flat.model_t.data_ptr()
    tensors = [*model.parameters(), model[2].running_mean, model[2].running_var]
    assert all((t.data_ptr() - base) % 512 == 0 for t in tensors)
    assert flat.size == sum(t.numel() for t in tensors) == 173
    assert np.array_equal(flat.params, np.concatenate([t.detach().reshape(-1).numpy() for t in tensors]))
    shared = FlatParameters(_odd_bn_model())  # on the CPU: the model is the packed vector itself
    assert shared.model_t is shared.params_t


def test_a_partial_upload_reaches_exactly_the_model_values_it_covers():
    """Ranges cut inside tensors (a partition's bounds): the values they cover, and only those, reach the
    model's aligned copy."""
    model = _odd_bn_model()
    flat = FlatParameters(model, "cpu", "staged")
    before = flat.values().clone()
    flat.params[:] = np.arange(flat.size, dtype=np.float32) + 1000
    ranges = [(3, 77), (84, 85), (100, 173)]
    flat.upload_ranges(ranges)
    now = np.concatenate([t.detach().reshape(-1).numpy() for t in
                          [*model.parameters(), model[2].running_mean, model[2].running_var]])
    expected = before.numpy().copy()
    for lo, hi in ranges:
        expected[lo:hi] = flat.params[lo:hi]
    assert np.array_equal(now, expected)


def test_values_and_the_buffers_change_follow_the_models_own_copy():
    """What a step and a forward pass change in the model's aligned copy: :meth:`values` and the buffers'
    change that :meth:`end_pass` records are those of the CPU's packed layout, bit for bit."""
    got = {}
    for transfer in ("shared", "staged"):
        model = _odd_bn_model()
        flat = FlatParameters(model, "cpu", transfer)
        flat.begin_pass()
        model(torch.randn(6, 7, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        flat.end_pass()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        got[transfer] = (flat.values().clone(), flat.grads_t.clone())
    assert torch.equal(got["shared"][0], got["staged"][0]) and torch.equal(got["shared"][1], got["staged"][1])
    assert got["staged"][1][-10:].abs().max() > 0  # the running statistics moved
