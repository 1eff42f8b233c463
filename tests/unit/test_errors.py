"""The hint a failing rank's line carries where hpcps knows what the user can do (hpcps.errors.hint)."""

import pytest
import torch

from hpcps.errors import hint

#: torch's own words when a CPU batch meets a model on a GPU (torch 2.11 on an H200): a tensor op's, and a
#: convolution's, which compares the types
ON_A_GPU = [
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
    "(when checking argument for argument mat1 in method wrapper_CUDA_addmm)",
    "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the same or input "
    "should be a MKLDNN tensor and weight is a dense tensor",
    "Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same",
]


@pytest.mark.parametrize("message", ON_A_GPU)
def test_a_batch_on_another_device_than_the_model_is_told_to_go_to_ps_device(message):
    assert "x.to(ps.device)" in hint(RuntimeError(message))


def test_the_hint_follows_torchs_own_error_between_two_devices():
    """Raised by torch here, without a GPU: a tensor on the meta device and one on the CPU."""
    with pytest.raises(RuntimeError) as caught:
        torch.randn(3, device="meta") + torch.randn(3)
    assert "x.to(ps.device)" in hint(caught.value)


def test_other_errors_get_no_hint():
    with pytest.raises(RuntimeError) as caught:  # two dtypes on one device: not a matter of devices
        torch.nn.Conv2d(1, 1, 1)(torch.randn(1, 1, 2, 2, dtype=torch.float64))
    assert hint(caught.value) == ""
    assert hint(ValueError("Expected all tensors to be on the same device")) == ""
    assert hint(RuntimeError("CUDA out of memory")) == ""
