"""Where a worker computes, and how its tensors reach MPI (pure policy: no MPI, no CUDA calls).

Workers train on ``cuda:<i>``, ``i`` being the worker's index among the
workers on its node (modulo the GPUs it can see, so a node with more workers
than GPUs shares them, and a rank that Slurm bound to one GPU sees it as
``cuda:0``). Servers and group servers apply updates in host memory, where
the RMA windows are, unless ``--server-device`` puts a central shard's slice
on a device (:mod:`hpcps.runtime.residence`).

How a worker's tensors move (:class:`~hpcps.training.flat.FlatParameters` does it):

``shared``
    CPU training: MPI reads and writes the model's own flat buffers; nothing
    is copied.
``staged``
    GPU training with an MPI that cannot read GPU memory: pulls land in a
    pinned host buffer and are copied to the GPU; gradients are copied to a
    pinned host buffer before they are pushed.
``direct``
    GPU training with a CUDA-aware MPI: gradients are pushed straight from
    GPU memory. Pulls still land in pinned host memory and are copied up,
    because the windows stay in host memory (common CUDA-aware builds do not
    support one-sided operations on GPU memory).

Whether an MPI library is CUDA-aware (:func:`detect_cuda_aware`) is read
from its version string, its vendor's environment variables and, where the
library exports it, ``MPIX_Query_cuda_support()`` (Open MPI >= 2.0, MPICH >=
4.0); ``--cuda-aware yes|no`` overrides. In doubt the answer is *no*:
staging is always correct, while handing GPU pointers to an MPI that cannot
read them crashes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

import torch

from hpcps.cluster.launcher import library_name
from hpcps.errors import UserError

Transfer = Literal["shared", "staged", "direct"]

_TRUE = {"1", "true", "yes", "on", "enable", "enabled"}
_FALSE = {"0", "false", "no", "off", "disable", "disabled"}


@dataclass(frozen=True)
class CudaAwareness:
    """Whether MPI may be handed GPU memory, and why we think so (for the log and the metrics file)."""

    aware: bool
    reason: str


@dataclass(frozen=True)
class DevicePlan:
    """One rank's device and transfer mode."""

    device: torch.device
    transfer: Transfer
    reason: str = ""

    def describe(self) -> str:
        pinned = "pinned " if self.device.type == "cuda" else ""
        how = {"shared": "", "staged": f", staged through {pinned}host memory", "direct": ", pushed from device memory"}
        return f"{self.device}{how[self.transfer]}" + (f" ({self.reason})" if self.reason else "")


def select_device(requested: str, local_index: int | None, n_gpus: int) -> torch.device:
    """The device of a rank: ``local_index`` is its index among the workers on its node (None: not a worker)."""
    if requested == "cpu" or local_index is None:
        return torch.device("cpu")
    if n_gpus == 0:
        if requested == "cuda":
            raise UserError("--device cuda: this rank sees no CUDA device (torch.cuda.device_count() is 0: "
                            "check CUDA_VISIBLE_DEVICES, the job's GPU request and that torch is a CUDA build)")
        return torch.device("cpu")
    return torch.device("cuda", local_index % n_gpus)


def _flag(environ: Mapping[str, str], name: str) -> bool | None:
    """An environment variable read as a switch: True, False, or None (unset or unreadable)."""
    value = environ.get(name, "").strip().lower()
    return True if value in _TRUE else False if value in _FALSE else None


def _switch(environ: Mapping[str, str], library: str, variable: str) -> CudaAwareness:
    """CUDA-aware exactly when the vendor's switch ``variable`` is on."""
    return CudaAwareness(bool(_flag(environ, variable)), f"{library} with {variable}={environ.get(variable, 'unset')}")


def detect_cuda_aware(library_version: str, environ: Mapping[str, str], query: bool | None) -> CudaAwareness:
    """Is the MPI library CUDA-aware? ``query``: its ``MPIX_Query_cuda_support()``, None where it has none."""
    version = library_version.upper()
    name = library_name(library_version)
    if "CRAY MPICH" in version:  # the GPU transport layer is switched on at run time
        return _switch(environ, "Cray MPICH", "MPICH_GPU_SUPPORT_ENABLED")
    if "MVAPICH" in version:  # MVAPICH2-GDR: device buffers only with MV2_USE_CUDA=1
        return _switch(environ, "MVAPICH", "MV2_USE_CUDA")
    if "OPEN MPI" in version and _flag(environ, "OMPI_MCA_opal_cuda_support") is False:
        return CudaAwareness(False, "Open MPI with OMPI_MCA_opal_cuda_support switched off")
    if "MPICH" in version and _flag(environ, "MPIR_CVAR_ENABLE_GPU") is False:
        return CudaAwareness(False, "MPICH with MPIR_CVAR_ENABLE_GPU switched off")
    if query is not None:
        return CudaAwareness(query, f"MPIX_Query_cuda_support() of {name} returned {int(query)}")
    if "MPICH" in version and "--WITH-CUDA" in version:
        return CudaAwareness(True, f"{name} configured --with-cuda")
    return CudaAwareness(False, f"{name}: no sign of CUDA support")


def choose_cuda_aware(setting: str, detect) -> CudaAwareness:
    """``--cuda-aware``: ``yes`` and ``no`` decide; ``auto`` calls ``detect()`` (a :class:`CudaAwareness`)."""
    if setting == "yes":
        return CudaAwareness(True, "--cuda-aware yes")
    if setting == "no":
        return CudaAwareness(False, "--cuda-aware no")
    return detect()


def plan_device(requested: str, cuda_aware: str, local_index: int | None, n_gpus: int, detect) -> DevicePlan:
    """A rank's :class:`DevicePlan` from ``--device``, ``--cuda-aware``, its local worker index and GPU count."""
    device = select_device(requested, local_index, n_gpus)
    if device.type == "cpu":
        return DevicePlan(device, "shared")
    aware = choose_cuda_aware(cuda_aware, detect)
    return DevicePlan(device, "direct" if aware.aware else "staged", aware.reason)
