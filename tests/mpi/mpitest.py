"""Helpers of the MPI tests: run a job collectively, share rank 0's facts."""

from __future__ import annotations

import h5py
import numpy as np
import torch
from mpi4py import MPI

import hpcps.runtime.run
from hpcps.options.config import make_config
from hpcps.cluster.device import DevicePlan
from hpcps.cluster.layout import Role
from hpcps.metrics.schema import TABLES
from hpcps.runtime.run import run_training


def train(out, comm=MPI.COMM_WORLD, **options):
    """Run a training job collectively; return (result on rank 0 / None, tables dict on rank 0 / None)."""
    options.setdefault("progress", False)
    cfg = make_config({"out": str(out), **options})
    result = run_training(cfg, comm)
    if comm.rank != 0:
        return None, None
    return result, read_tables(result.path)


def read_tables(path) -> dict:
    """A run file's tables by name, its ``summary`` and its root ``attrs``, as dicts."""
    with h5py.File(path) as f:
        tables = {name: f[name][()] for name in TABLES}
        tables["summary"] = dict(f["summary"].attrs)
        tables["attrs"] = dict(f.attrs)
    return tables


def share(comm, facts):
    """Broadcast rank 0's facts to every rank."""
    return comm.bcast(facts, root=0)


def clocks_at(updates: np.ndarray, version: int, worker_ranks) -> dict[int, int]:
    """Gradients of each worker among those shard 0 had taken when it published ``version``: those applied
    before it (one per version), and those dropped at a version up to it. A dropped gradient makes no
    version, so its row cannot say whether it came before or after a pull of the version it was dropped at;
    it is counted as come (the paradigm counts a dropped gradient's clock too). Counting it only below
    ``version`` made a slowest worker's clock one short where the pull came after the drop: ssp's gap read
    1 over a bound of 0 once in 200 drawn combinations (a NaN dropped, tests/mpi/test_combinations_mpi.py)."""
    at = updates["version"] < version
    if "applied" in updates.dtype.names:
        at |= (updates["applied"] == 0) & (updates["version"] == version)
    first = updates[(updates["shard"] == 0) & at]
    return {w: int((first["worker"] == w).sum()) for w in worker_ranks}


def force_transfer(monkeypatch, transfer: str) -> None:
    """Make the workers of the next runs move tensors as on a GPU (``staged``/``direct``), on the CPU.

    Replaces the device planning of :func:`hpcps.runtime.run.run_training` (collective
    there; a plain function here, on every rank alike).
    """
    def plan(cfg, comm, layout):
        if layout.role(comm.rank) is not Role.WORKER:
            return DevicePlan(torch.device("cpu"), "shared")
        return DevicePlan(torch.device("cpu"), transfer, "forced by the test")
    monkeypatch.setattr(hpcps.runtime.run, "_plan_device", plan)
