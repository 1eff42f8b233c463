"""hpcps on each transport as itself (:mod:`hpcps.cluster.transports`): every paradigm trains over MPICH's UCX
TCP path (and Open MPI's TCP BTL), and each cell of this MPI is first proven from MPI's own log.

Before the push inbox took its headers by matched probes, every run over ``UCX_TLS=tcp,self
MPIR_CVAR_NOLOCAL=1`` hung at its first rounds: a posted ``MPI_ANY_SOURCE`` receive there misses a message
that a probe sees, when its sender has a receive of its own posted from the receiver (every worker has, for
its notices). ``tools/soak.py`` runs the drawn combinations in every cell.
"""

from __future__ import annotations

import sys

import h5py
import pytest

from hpcps.cluster.transports import cells
from launching import FAMILY, failure, launch, needs_mpiexec

pytestmark = [needs_mpiexec, pytest.mark.slow]

PROBE = "from mpi4py import MPI; import numpy as np; c = MPI.COMM_WORLD; x = np.zeros(1); " \
        "c.Allreduce(np.ones(1), x); w = MPI.Win.Allocate(8, comm=c); w.Lock(0); w.Get(x, 0); w.Unlock(0); w.Free()"
HERE = cells(FAMILY) if FAMILY else []
#: the cell every paradigm runs in: this MPI's TCP path between the ranks of one host
TCP = next((c for c in HERE if c.name in ("mpich-ucx-tcp", "openmpi-tcp")), None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cell", HERE, ids=[c.name for c in HERE])
def test_each_cell_is_the_transport_it_names_by_mpis_own_log(cell):
    proc = launch(2, sys.executable, "-c", PROBE, timeout=90, env={**cell.env, **cell.log_env})
    assert proc.returncode == 0, failure(proc.stderr)
    assert cell.proven(proc.stdout + proc.stderr), (cell.name, (proc.stdout + proc.stderr)[-3000:])


PARADIGMS = ["bsp", "asp", "ssp", "dssp", "eager", "hsp", "grouped", "localsgd", "diloco"]


@pytest.mark.skipif(TCP is None, reason="no TCP cell for this MPI")
@pytest.mark.timeout(150)
@pytest.mark.parametrize("paradigm", PARADIGMS)
def test_every_paradigm_trains_over_tcp_with_every_gradient_accounted_for(tmp_path, paradigm):
    """4 ranks (5 for grouped: 2 group servers), 2 shards for the paradigms that take them, partitions where
    they apply: pushed = applied + dropped over the rows, every worker ran every step."""
    out = tmp_path / f"{paradigm}.h5"
    steps = 12
    extra = {"grouped": ["--groups", "2"], "localsgd": ["--local-steps", "3"], "diloco": ["--local-steps", "3"],
             "eager": []}.get(paradigm, ["--servers", "2", "--partition-mb", "0.01"])
    n = 5 if paradigm == "grouped" else 4
    proc = launch(n, sys.executable, "-m", "hpcps", "train", "--paradigm", paradigm, "--steps", str(steps),
                  "--stall-warn", "10", "--stall-abort", "60", "--out", str(out), *extra, timeout=120, env=TCP.env)
    assert proc.returncode == 0, failure(proc.stderr)
    with h5py.File(out) as f:
        s = dict(f["summary"].attrs)
        it = f["workers/iterations"][()]
        workers = int(f.attrs["n_workers"])
    assert s["gradients_pushed"] == s["gradients_applied"] + s["gradients_dropped"] == len(it)
    rounds = steps // 3 if paradigm in ("localsgd", "diloco") else steps
    assert len(it) == workers * rounds
