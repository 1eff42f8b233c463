"""Transport cells: the environment that puts an MPI on one transport, and what its own log says when it did.

A transport is tested as itself only where MPI's own log shows it was the one
picked: ``MPIR_CVAR_NOLOCAL=1`` alone leaves MPICH's UCX on shared memory
(``tag(sysv cma)``), not on TCP. Each :class:`Cell` names the variables that
select it and a log switch with the pattern its log must show; the transport
tests (``tests/cli/test_transports.py``) and the soak (``tools/soak.py``) run
their jobs in these cells and check the pattern first. Pure: no MPI.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Cell:
    """One MPI on one transport between the ranks of this host."""

    name: str
    family: str  # the launcher family that runs it (hpcps.cluster.launcher.launcher_family)
    env: dict[str, str]  # what selects the transport
    log_env: dict[str, str]  # what makes the MPI say which transport it picked
    proof: str  # a regular expression its log must match
    refute: str | None = None  # one it must not match (a shared-memory path beside the one named)
    about: str = field(default="", compare=False)

    def proven(self, log: str) -> bool:
        """Whether ``log`` (the job's stdout and stderr, run with :attr:`log_env`) shows this transport."""
        return re.search(self.proof, log) is not None and (self.refute is None or re.search(self.refute, log) is None)


#: UCX's line per endpoint configuration, e.g. ``intra-node cfg#1 tag(tcp/eth0)  rma_am(tcp/eth0)``
_UCX_TAG = r"(?:intra|inter)-node cfg#\d+ tag\(([^)]*)\)"

#: MPICH's default between the ranks of one host (its own shared memory) is what the rest of the suite runs on;
#: the box (``hpcps emulate``) has tests of its own (tests/cli/test_box.py)
CELLS: tuple[Cell, ...] = (
    Cell("mpich-ucx-shm", "mpich", {"MPIR_CVAR_NOLOCAL": "1"}, {"UCX_LOG_LEVEL": "info"},
         _UCX_TAG.replace(r"([^)]*)", r"[^)]*(?:sysv|posix|cma)[^)]*"), None,
         "MPICH's netmod, UCX, left to pick: shared memory between the ranks of one host"),
    Cell("mpich-ucx-tcp", "mpich", {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self"}, {"UCX_LOG_LEVEL": "info"},
         _UCX_TAG.replace(r"([^)]*)", r"tcp/[^)]*"), _UCX_TAG.replace(r"([^)]*)", r"[^)]*(?:sysv|posix|cma)[^)]*"),
         "MPICH from pip between nodes that have only Ethernet: UCX over TCP"),
    Cell("mpich-ofi-tcp", "mpich", {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"},
         {"MPIR_CVAR_DEBUG_SUMMARY": "1"}, r"provider: tcp", None,
         "MPICH over libfabric's TCP provider (as in the cluster in a box)"),
    Cell("openmpi-tcp", "openmpi", {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp", "OMPI_MCA_osc": "rdma"},
         {"OMPI_MCA_btl_base_verbose": "10"}, r"btl:tcp: .* if \S+ kidx", None,
         "Open MPI's ob1 over its TCP BTL, one-sided through osc/rdma over it"),
)


def cells(family: str | None = None) -> list[Cell]:
    """The cells of ``family`` (every cell where None)."""
    return [c for c in CELLS if family is None or c.family == family]


def cell(name: str) -> Cell:
    """The cell called ``name``; ValueError naming the known ones otherwise."""
    for c in CELLS:
        if c.name == name:
            return c
    raise ValueError(f"no transport cell {name!r}: one of {', '.join(c.name for c in CELLS)}")
