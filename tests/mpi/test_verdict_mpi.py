"""A gradient is applied by every shard or by none: the worker, which holds all of it, decides whether it is
finite and says so with its push (mpiexec -n 5). Before, each shard scanned its own slice, so a NaN in one
slice was dropped there and applied by the other shard, and the summary said nothing was dropped."""

from __future__ import annotations

import math
import os

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcps
from mpitest import share
from test_step_api import TinyLM, batch

pytestmark = [pytest.mark.mpi(min_size=5), pytest.mark.timeout(180)]


def _facts(path):
    with h5py.File(path) as f:
        up = f["servers/updates"][()]
        summary = dict(f["summary"].attrs)
    return up, summary


def _last_param_nan(model):
    """A NaN in the model's last parameter's gradient: the end of the flat vector, shard 1's slice."""
    list(model.parameters())[-1].grad.view(-1)[-1] = float("nan")


def test_a_nan_in_one_shards_slice_is_applied_by_no_shard_and_counted_once(world, mpi_tmp_path):
    """bsp on 2 shards, 3 workers: worker 1's step-2 gradient has one NaN, in shard 1's slice. Both shards drop
    it (reason 1), the summary counts one dropped gradient, and both shards end at the same version."""
    ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=0.05, paradigm="bsp", steps=6, servers=2, progress=False,
                    divergence="ignore", out=str(mpi_tmp_path / "one.h5"), exit_on_error=False, comm=world)
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            if ps.worker_index == 1 and ps.iteration == 2:
                _last_param_nan(ps.model)
            ps.step()
    facts = None
    if world.rank == 0:
        up, summary = _facts(ps.result.path)
        bad = up[(up["worker"] == 3) & (up["worker_clock"] == 3)]
        facts = {"bad": sorted((int(r["shard"]), int(r["applied"]), int(r["reason"])) for r in bad),
                 "dropped": int(summary["gradients_dropped"]), "applied": int(up["applied"].sum()),
                 "last": [int(up[up["shard"] == s]["version"].max()) for s in (0, 1)]}
    facts = share(world, facts)
    assert facts["bad"] == [(0, 0, 1), (1, 0, 1)], facts
    assert facts["dropped"] == 1 and facts["applied"] == 2 * (3 * 6 - 1), facts
    assert facts["last"][0] == facts["last"][1], facts


def test_a_round_of_nans_in_one_slice_with_periodic_checkpoints_finishes(world, mpi_tmp_path):
    """Every worker's step-2 gradient has a NaN in shard 1's slice, with a checkpoint every 2 versions: no shard
    applies that round, both stay at one version, and the run ends on its own (it waited for the stall abort
    when shard 0 moved on alone)."""
    ckpt = mpi_tmp_path / "ck"
    ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=0.05, paradigm="bsp", steps=6, servers=2, progress=False,
                    divergence="ignore", checkpoint_every=2, checkpoint_dir=str(ckpt), stall_abort=60,
                    out=str(mpi_tmp_path / "round.h5"), exit_on_error=False, comm=world)
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            if ps.iteration == 2:
                _last_param_nan(ps.model)
            ps.step()
    facts = None
    if world.rank == 0:
        up, summary = _facts(ps.result.path)
        facts = {"stopped_by": summary["stopped_by"], "dropped": int(summary["gradients_dropped"]),
                 "last": [int(up[up["shard"] == s]["version"].max()) for s in (0, 1)],
                 "checkpoints": sorted(p for p in os.listdir(ckpt) if p.endswith(".h5"))}
    facts = share(world, facts)
    assert facts["stopped_by"] == "" and facts["dropped"] == 3, facts
    assert facts["last"] == [4, 4], facts  # 5 rounds applied, the last one to version 4
    assert facts["checkpoints"] == ["step-000002.h5", "step-000004.h5"], facts


def test_a_push_begun_during_backward_carries_its_verdict_after_it(world, mpi_tmp_path):
    """hpcps's own loop with partitioned pulls over striped shards pushes each piece as backward produces it,
    before it can know the gradient is finite: its verdict follows the payload, and a NaN in one piece is
    still applied by no shard."""
    calls = {"n": 0}

    def loss(model, xy):
        x, y = xy
        out = torch.nn.functional.cross_entropy(model(x), y)
        calls["n"] += 1
        if MPI.COMM_WORLD.rank == 3 and calls["n"] == 3:  # one NaN, in the last layer's bias only
            out = out + math.nan * list(model.parameters())[-1][-1]
        return out

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, 10))

    result = hpcps.train(model=net, data="digits", loss=loss, paradigm="bsp", steps=5, servers=2,
                         partition_mb=0.002, divergence="ignore", progress=False,
                         out=str(mpi_tmp_path / "backward.h5"), exit_on_error=False, comm=world)
    facts = None
    if world.rank == 0:
        up, summary = _facts(result.path)
        bad = up[(up["worker"] == 3) & (up["worker_clock"] == 3)]
        facts = {"bad": sorted((int(r["shard"]), int(r["applied"]), int(r["reason"])) for r in bad),
                 "dropped": int(summary["gradients_dropped"]), "finite": bool(np.isfinite(result.params).all())}
    facts = share(world, facts)
    assert facts["bad"] == [(0, 0, 1), (1, 0, 1)], facts
    assert facts["dropped"] == 1 and facts["finite"], facts
