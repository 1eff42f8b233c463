"""What the MPI library under mpi4py says of itself: its name and version, which implementation it is, and
its CUDA support (the mechanism behind hpcps.cluster.device's policy and ``hpcps check``)."""

from __future__ import annotations

import ctypes

from mpi4py import MPI


def library_version(text: str | None = None) -> str:
    """The first line of ``MPI_Get_library_version`` (or of ``text``), printable: Open MPI ends its string
    in a NUL, which HDF5's strings cannot hold, and MPICH spreads its over many lines."""
    text = MPI.Get_library_version() if text is None else text
    lines = text.replace("\0", "").strip().splitlines()
    return " ".join(lines[0].split()) if lines else "unknown MPI"


#: (what the version string contains, upper case; the implementation's short name), the first that matches
_IMPLEMENTATIONS = (("CRAY MPICH", "cray-mpich"), ("INTEL(R) MPI", "intel-mpi"), ("INTEL MPI", "intel-mpi"),
                    ("MVAPICH", "mvapich"), ("OPEN MPI", "openmpi"), ("MPICH", "mpich"))


def implementation(text: str | None = None) -> str:
    """The implementation's short name (``openmpi``, ``mpich``, ``intel-mpi``, ``cray-mpich``, ``mvapich``,
    else ``other``) from ``MPI_Get_library_version`` (or ``text``)."""
    version = (MPI.Get_library_version() if text is None else text).upper()
    return next((name for key, name in _IMPLEMENTATIONS if key in version), "other")


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
