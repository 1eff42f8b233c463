"""What the MPI library under mpi4py says of itself: its name and version, which implementation it is, and
its CUDA support (the mechanism behind hpcps.cluster.device's policy and ``hpcps check``)."""

from __future__ import annotations

import ctypes

from mpi4py import MPI

from hpcps.cluster.launcher import library_name, mpi_family


def library_version() -> str:
    """The first line of this MPI's ``MPI_Get_library_version``, printable (:func:`library_name`)."""
    return library_name(MPI.Get_library_version())


def implementation() -> str:
    """This MPI's family: ``openmpi``, ``mpich``, ``intel-mpi``, ``cray-mpich``, ``mvapich`` or ``other``."""
    return mpi_family(MPI.Get_library_version())


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
