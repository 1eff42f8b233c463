"""hpcps: parameter-server training of PyTorch models over MPI.

One switch (``--paradigm``) selects the synchronization paradigm; the
runtime (topology, transport, server and worker loops) is shared by all of
them. See README.md for the user's view and DESIGN.md for the map.
"""

__version__ = "0.1.0"
