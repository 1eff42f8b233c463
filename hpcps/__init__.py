"""hpcps: parameter-server training of PyTorch models over MPI.

One switch (``--paradigm``) selects the synchronization paradigm; the
runtime (topology, transport, server and worker loops) is shared by all of
them. :func:`hpcps.train` trains the user's own model, data, loss and
optimizer (see :mod:`hpcps.api`); ``hpcps train`` is the command-line client
of the same runtime. See README.md and docs/ for the user's view.
"""

__version__ = "0.1.0"

__all__ = ["train", "__version__"]


def __getattr__(name: str):
    """``hpcps.train`` imports the runtime (torch, mpi4py) on first use only, so offline tools
    (``hpcps report``, ``hpcps simulate``) never import MPI."""
    if name == "train":
        from hpcps.api import train

        return train
    raise AttributeError(f"module 'hpcps' has no attribute {name!r}")
