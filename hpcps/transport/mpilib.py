"""What the MPI library under mpi4py says of its CUDA support (the mechanism behind hpcps.cluster.device's policy)."""

from __future__ import annotations

import ctypes

from mpi4py import MPI


def query_cuda_support() -> bool | None:
    """``MPIX_Query_cuda_support()`` of the library mpi4py loaded, or None where the library has no such call.

    Open MPI (>= 2.0) and MPICH (>= 4.0) export it: 1 when the library was
    built with CUDA *and* its run-time configuration supports device buffers.
    mpi4py does not wrap it, so it is looked up among the symbols its
    extension module was linked with. MPI must be initialised.
    """
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype, query.argtypes = ctypes.c_int, []
    return bool(query())
