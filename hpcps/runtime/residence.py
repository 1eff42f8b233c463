"""Where a central shard's slice lives while it is stepped (``--server-device``).

``host`` (the default): the slice is the shard's fp32 master in host memory, the array its window
publishes from; the optimizer steps it in place, and a push's gradient is read where MPI received it.

``cuda``: the slice, the optimizer's state and the round's sum live on the shard's GPU, and torch's
fused optimizers step them there, as colocated parameter-server designs keep each shard's slice on its
worker's device (BytePS moved the optimizer to the GPU for the same reason: a CPU cannot keep up with a
GPU's rate of updates). MPI still reads and writes host memory:

- a push lands in the shard's receive buffers (pinned host memory on a GPU) and goes up with one copy;
- after each update the slice comes down with one copy into the host master, and the window publishes
  that: the RMA window stays in host memory, as common CUDA-aware builds offer no one-sided operations
  on device memory, and a worker's pull reads it there as before.

``cpu``: the same code as ``cuda`` on torch's CPU device. The slice is a tensor of its own, apart from
the master, and every gradient and every update is copied as on a GPU, so the tests hold the device
path to the host path bit for bit on a machine without one (the same chunks, the same kernels).

Every copy here is synchronous: a receive buffer goes back to MPI the moment its gradient is summed or
applied, and an asynchronous upload still reading it would race the next receive.
"""

from __future__ import annotations

import numpy as np
import torch

from hpcps.errors import UserError
from hpcps.transport.push import PushInbox

SETTINGS = ("host", "cpu", "cuda")


class HostSlice:
    """The slice in the window's host memory, stepped in place (``--server-device host``)."""

    device = torch.device("cpu")
    pinned = False  # receive buffers: plain host memory

    def __init__(self, master: np.ndarray) -> None:
        self.tensor = torch.from_numpy(master)  # the master itself: nothing to copy

    def upload(self, gradient: torch.Tensor) -> torch.Tensor:
        """A received gradient where the optimizer reads it: where it was received."""
        return gradient

    def download(self) -> None:
        """The master is the slice: already up to date."""


class DeviceSlice:
    """The slice on ``device``, copied from ``master`` once and back into it after each update."""

    def __init__(self, master: np.ndarray, device: torch.device) -> None:
        self.device = torch.device(device)
        #: receive buffers in pinned memory, so a gradient's upload is one DMA (a GPU only)
        self.pinned = self.device.type == "cuda"
        self.host = torch.from_numpy(master)
        self.tensor = self.host.to(self.device, copy=True)

    def upload(self, gradient: torch.Tensor) -> torch.Tensor:
        """A received gradient (a view of a receive buffer) copied to the device: the buffer is MPI's again
        once this returns."""
        return gradient.to(self.device, copy=True)

    def download(self) -> None:
        """The stepped slice into the host master, before the window publishes it."""
        self.host.copy_(self.tensor)

    @staticmethod
    def describe_device(device: torch.device) -> str:
        """What the log and the run file's ``devices`` say of a slice on ``device``."""
        pinned = "pinned " if device.type == "cuda" else ""
        return f"{device}, pushes and publishes copied through {pinned}host memory"


def pinned(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """A zeroed array in page-locked host memory (it keeps the torch tensor that owns the memory alive): a
    GPU's upload from it is one DMA. Needs CUDA."""
    raw = torch.zeros(int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=torch.uint8, pin_memory=True)
    return raw.numpy().view(dtype).reshape(shape)


class PinnedPushInbox(PushInbox):
    """A :class:`~hpcps.transport.push.PushInbox` whose receive buffers are page-locked host memory, for a
    shard whose slice is on a GPU: it uploads every gradient from them."""

    def __init__(self, comm, **options) -> None:
        super().__init__(comm, **options)
        self.grads = pinned(self.grads.shape, self.grads.dtype)  # before any receive is posted into them


def shard_device(setting: str, local_index: int, n_gpus: int) -> torch.device | None:
    """The device ``--server-device`` puts a shard's slice on (None: ``host``), ``local_index`` being the
    shard's index among the shards on its node: shard ``i`` of a node takes ``cuda:<i mod GPUs>``, beside
    the node's worker ``i`` (``--placement rank`` colocates them so). Raises UserError where ``cuda`` finds
    no GPU."""
    if setting not in SETTINGS:
        raise UserError(f"--server-device {setting!r}: one of {', '.join(SETTINGS)}")
    if setting == "host":
        return None
    if setting == "cpu":
        return torch.device("cpu")
    if n_gpus == 0:
        raise UserError("--server-device cuda: this shard's rank sees no CUDA device (torch.cuda.device_count() "
                         "is 0: check CUDA_VISIBLE_DEVICES, the job's GPU request and that torch is a CUDA build)")
    return torch.device("cuda", local_index % n_gpus)


def place(master: np.ndarray, device: torch.device | None) -> HostSlice | DeviceSlice:
    """The slice of ``master`` where :func:`shard_device` said."""
    return HostSlice(master) if device is None else DeviceSlice(master, device)
