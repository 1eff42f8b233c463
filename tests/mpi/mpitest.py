"""Helpers of the MPI tests: run a job collectively, share rank 0's facts."""

from __future__ import annotations

import h5py
import numpy as np
from mpi4py import MPI

from hpcps.config import make_config
from hpcps.metrics.schema import TABLES
from hpcps.run import run_training


def train(out, comm=MPI.COMM_WORLD, **options):
    """Run a training job collectively; return (result on rank 0 / None, tables dict on rank 0 / None)."""
    options.setdefault("progress", False)
    cfg = make_config({"out": str(out), **options})
    result = run_training(cfg, comm)
    if comm.rank != 0:
        return None, None
    with h5py.File(result.path) as f:
        tables = {name: f[name][()] for name in TABLES}
        tables["summary"] = dict(f["summary"].attrs)
        tables["attrs"] = dict(f.attrs)
    return result, tables


def share(comm, facts):
    """Broadcast rank 0's facts to every rank."""
    return comm.bcast(facts, root=0)


def clocks_at(updates: np.ndarray, version: int, worker_ranks) -> dict[int, int]:
    """Gradients of each worker among those applied before ``version`` (shard 0, one per version)."""
    first = updates[(updates["shard"] == 0) & (updates["version"] < version)]
    return {w: int((first["worker"] == w).sum()) for w in worker_ranks}
