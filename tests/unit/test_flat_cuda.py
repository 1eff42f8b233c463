"""FlatParameters on a real GPU (skipped without one): pinned host buffers and exact copies both ways."""

import numpy as np
import pytest
import torch

from hpcps.training.flat import FlatParameters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))


@pytest.mark.parametrize("transfer", ["staged", "direct"])
def test_host_side_is_pinned_and_the_model_lives_on_the_device(transfer):
    flat = FlatParameters(_model(), "cuda", transfer)
    assert flat.params_t.is_cuda and flat.grads_t.is_cuda
    assert torch.from_numpy(flat.params).is_pinned()
    if transfer == "staged":
        assert torch.from_numpy(flat.grads).is_pinned()
        assert isinstance(flat.push_grads, np.ndarray)
    else:
        assert flat.grads is None and flat.push_grads is flat.grads_t
    assert np.array_equal(flat.params, flat.params_t.cpu().numpy())


def test_upload_and_stage_grads_copy_exactly():
    model = _model()
    flat = FlatParameters(model, "cuda", "staged")
    rng = np.random.default_rng(1)
    flat.params[:] = rng.standard_normal(flat.size, dtype=np.float32)
    flat.upload()
    assert np.array_equal(flat.params_t.cpu().numpy(), flat.params)
    assert torch.equal(model[0].weight.detach().reshape(-1), flat.params_t[:35])  # the model sees the pull
    model(torch.randn(4, 7, device="cuda")).sum().backward()
    flat.stage_grads()
    assert np.array_equal(flat.grads, flat.grads_t.cpu().numpy())
    assert np.abs(flat.grads[:flat.n_params]).max() > 0


def test_upload_ranges_lands_every_range_once_the_device_is_synchronized():
    flat = FlatParameters(_model(), "cuda", "staged")
    before = flat.params_t.cpu().numpy()
    flat.params[:] = np.arange(flat.size, dtype=np.float32)
    flat.upload_ranges([(0, 10), (20, flat.size)])
    flat.synchronize()
    got = flat.params_t.cpu().numpy()
    assert np.array_equal(got[:10], np.arange(10)) and np.array_equal(got[20:], np.arange(20, flat.size))
    assert np.array_equal(got[10:20], before[10:20])  # untouched outside the ranges


def test_a_pulled_snapshot_swapped_in_reaches_the_device():
    flat = FlatParameters(_model(), "cuda", "staged")
    new = np.full(flat.size, 0.5, np.float32)
    old = flat.swap_params(new)
    flat.upload()
    assert old is not new and flat.params is new
    assert torch.equal(flat.params_t, torch.full_like(flat.params_t, 0.5))


def test_a_batchnorm_after_odd_sized_layers_trains_on_the_device():
    """Packed end to end, this model's BatchNorm statistics began 8 bytes off a 16-byte boundary and the
    GPU's batch-norm kernel failed ("misaligned address"); each tensor now begins where an allocation of its
    own would."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 64, 10), torch.nn.BatchNorm1d(10))
    flat = FlatParameters(model, "cuda", "staged")
    assert all(t.data_ptr() % 512 == 0 for t in [*model.parameters(), *model.buffers()] if t.is_floating_point())
    for _ in range(3):
        flat.begin_pass()
        model(torch.randn(16, 1, 8, 8, device="cuda")).square().mean().backward()
        flat.end_pass()
    flat.stage_grads()
    assert np.isfinite(flat.grads).all() and np.abs(flat.grads[flat.n_params:]).max() > 0
