"""hpcps: parameter-server training of PyTorch models over MPI.

One switch (``--paradigm``) selects the synchronization paradigm; the
runtime (topology, transport, server and worker loops) is shared by all of
them. :func:`hpcps.train` trains the user's own model, data, loss and
optimizer (see :mod:`hpcps.api`), and :func:`hpcps.init` lets the user keep
their own training loop (the step API, :mod:`hpcps.runtime.session`); ``hpcps train`` is the command-line client
of the same runtime. See README.md and docs/ for the user's view.
"""

__version__ = "0.1.0"

# before anything imports mpi4py's MPI (which starts MPI): Open MPI's settings hpcps chooses where the
# user chose none (hpcps.cluster.launcher.open_mpi_defaults; os and a folder listing, nothing more)
from hpcps.cluster.launcher import open_mpi_defaults as _open_mpi_defaults  # noqa: E402

_open_mpi_defaults()

# an uncaught exception in a job of several ranks ends the job, as under python -m mpi4py (hpcps.runtime.guard;
# sys and weakref only: nothing of MPI is imported here)
from hpcps.runtime.guard import install as _install_guard  # noqa: E402

_install_guard()

__all__ = ["train", "init", "world", "decay_groups", "Policy", "Decision", "__version__"]


def __getattr__(name: str):
    """``hpcps.train`` and ``hpcps.init`` import the runtime (torch, mpi4py) on first use only, so
    offline tools (``hpcps report``, ``hpcps simulate``) never import MPI."""
    if name in ("train", "init", "world", "World", "decay_groups", "Session", "RunResult"):
        from hpcps import api

        return getattr(api, name)
    if name in ("Policy", "Decision"):  # the base of your own paradigm (hpcps.policies.base): pure, no MPI
        from hpcps.policies import base

        return getattr(base, name)
    raise AttributeError(f"module 'hpcps' has no attribute {name!r}")
