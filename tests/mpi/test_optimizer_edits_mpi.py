"""``ps.optimizer`` is the servers' optimizer seen from the loop: torch's schedulers and hand edits of its
param groups reach every shard and are applied from the next push (mpiexec -n 5)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcps
from mpitest import share
from test_step_api import TinyLM, batch, sub

pytestmark = [pytest.mark.mpi(min_size=5), pytest.mark.timeout(240)]

LR, WD, STEPS = 0.05, 0.1, 12


def _rows(path):
    with h5py.File(path) as f:
        return f["servers/updates"][()]


@pytest.mark.parametrize("paradigm,options", [
    ("bsp", {}), ("ssp", {}),
    # where features meet: partitioned pulls over striped shards, 16-bit pushes, an eager worker's own count
    ("asp", {"partition_mb": 0.002}), ("ssp", {"compress": "bf16"}), ("eager", {"lr_staleness": "none"}),
], ids=["bsp", "ssp", "asp-partitions", "ssp-bf16", "eager"])
def test_a_step_lr_on_ps_optimizer_is_the_rate_each_gradient_is_applied_at(world, mpi_tmp_path, paradigm, options):
    """StepLR(step_size=5, gamma=0.1) stepped after every ps.step(): gradient k of every worker is applied
    at LR x 0.1^((k-1) // 5), on both shards, under bsp and under ssp (each worker's own scheduler), and
    with partitions, compression, or eager's decoupled pull."""
    steps = 15
    ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=LR, paradigm=paradigm, steps=steps, servers=2, lr_scaling="none",
                    progress=False, out=str(mpi_tmp_path / f"{paradigm}.h5"), exit_on_error=False, comm=world,
                    **options)
    scheduler = torch.optim.lr_scheduler.StepLR(ps.optimizer, step_size=5, gamma=0.1)
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            ps.step()
            scheduler.step()
    facts = None
    if world.rank == 0:
        up = _rows(ps.result.path)
        expected = LR * 0.1 ** ((up["worker_clock"] - 1) // 5)
        facts = {"rows": len(up), "applied": int(up["applied"].sum()),
                 "max_rel": float(np.max(np.abs(up["lr"] - expected) / expected)),
                 "rates": sorted(set(np.round(up["lr"], 12).tolist()))}
    facts = share(world, facts)
    assert facts["rows"] == facts["applied"] == 2 * 3 * steps
    assert facts["max_rel"] < 1e-12, facts
    assert facts["rates"] == [round(LR * 0.01, 12), round(LR * 0.1, 12), LR]


def test_one_worker_with_a_scheduler_and_a_momentum_edit_is_the_plain_torch_loop(world, mpi_tmp_path):
    """One worker, 2 shards cutting the decay groups: SGD with momentum, StepLR(3, 0.5), and momentum set to 0
    by hand at step 6, end with the parameters the same loop reaches in torch alone."""
    comm = sub(world, 3)
    facts = None
    if comm != MPI.COMM_NULL:
        torch.manual_seed(0)
        ref = TinyLM()
        names = dict(ref.named_parameters())  # decay_groups names the parameters; torch wants the tensors
        opt = torch.optim.SGD([{**g, "params": [names[n] for n in g["params"]]} for g in hpcps.decay_groups(ref, WD)],
                              lr=LR, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        for it in range(STEPS):
            if it == 6:
                for group in opt.param_groups:
                    group["momentum"] = 0.0
            ref(*batch(it, 0)).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=LR, momentum=0.9, param_groups=lambda m: hpcps.decay_groups(m, WD),
                        paradigm="bsp", steps=STEPS, servers=2, progress=False, out=str(mpi_tmp_path / "one.h5"),
                        exit_on_error=False, comm=comm)
        scheduler = torch.optim.lr_scheduler.StepLR(ps.optimizer, step_size=3, gamma=0.5) if ps.is_worker else None
        with ps:
            while ps.running:
                if ps.iteration == 6:
                    for group in ps.optimizer.param_groups:
                        group["momentum"] = 0.0
                ps.model(*batch(ps.iteration, 0)).backward()
                ps.step()
                scheduler.step()
        if comm.rank == 0:
            want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
            got = torch.from_numpy(ps.result.params[:len(want)])
            torch.manual_seed(0)
            start = torch.cat([p.detach().reshape(-1) for p in TinyLM().parameters()])
            with h5py.File(ps.result.path) as f:
                hypers = f["servers/hypers"][()]
            facts = {"err": float((got - want).abs().max()), "moved": float((want - start).abs().max()),
                     "momentum": sorted({(int(h["shard"]), int(h["group"]), int(h["version"]), float(h["value"]))
                                         for h in hypers if h["name"] == b"momentum"}),
                     "lr": sorted({(int(h["version"]), round(float(h["value"]), 9))
                                   for h in hypers if h["name"] == b"lr"})}
        comm.Free()
    facts = share(world, facts)
    assert facts["moved"] > 1e-2
    assert facts["err"] < 1e-5, facts
    # the run file says what the loop changed, from the first edit on (StepLR's first cut, applied at version 3),
    # and nothing the loop left as the optimizer had it (momentum 0.9 until then): momentum 0 from version 6, on
    # both shards' pieces of both groups; the base rate halved every 3
    assert facts["momentum"] == [(s, g, 6, 0.0) for s in (0, 1) for g in (0, 1)], facts
    assert facts["lr"] == [(3 * k, round(LR * 0.5 ** k, 9)) for k in range(1, 4)], facts


def test_reduce_lr_on_plateau_on_a_validation_metric_reaches_the_servers(world, mpi_tmp_path):
    """A validation loss that never improves: ReduceLROnPlateau(patience=1, factor=0.5) halves the rate every
    second step; gradient k is applied at the rate the same scheduler gives after k-1 such steps."""
    steps = 10
    ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=LR, paradigm="bsp", steps=steps, lr_scaling="none",
                    progress=False, out=str(mpi_tmp_path / "plateau.h5"), exit_on_error=False, comm=world)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(ps.optimizer, factor=0.5, patience=1)
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            ps.step()
            scheduler.step(1.0)  # the validation loss, flat
    facts = None
    if world.rank == 0:
        dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
        replay = torch.optim.lr_scheduler.ReduceLROnPlateau(dummy, factor=0.5, patience=1)
        rates = []
        for _ in range(steps):
            rates.append(dummy.param_groups[0]["lr"])
            replay.step(1.0)
        up = _rows(ps.result.path)
        expected = np.array(rates)[up["worker_clock"] - 1]
        facts = {"max_rel": float(np.max(np.abs(up["lr"] - expected) / expected)), "lowest": float(up["lr"].min()),
                 "rows": len(up)}
    facts = share(world, facts)
    assert facts["rows"] == 4 * steps
    assert facts["lowest"] < LR / 4  # it did anneal
    assert facts["max_rel"] < 1e-12, facts


def test_a_divergence_at_a_rate_the_loop_set_names_that_rate_not_lr(world, mpi_tmp_path, capsys):
    """The loop sets a huge rate in ps.optimizer: the run stops as diverged, and rank 0's line names the rate
    the loop set, not lr= (which is not the rate in force)."""
    ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=LR, paradigm="bsp", steps=60, lr_scaling="none", progress=False,
                    out=str(mpi_tmp_path / "diverged.h5"), exit_on_error=False, comm=world)
    with ps:
        if ps.is_worker:
            ps.optimizer.param_groups[0]["lr"] = 5e3
        while ps.running:
            loss = ps.model(*batch(ps.iteration, 0, ps.worker_index))
            loss.backward()
            ps.step(loss)
    err = capsys.readouterr().err
    facts = None
    if world.rank == 0:
        facts = {"stopped_by": ps.result.summary["stopped_by"],
                 "line": [x for x in err.splitlines() if "ERROR: training diverged" in x]}
    facts = share(world, facts)
    assert facts["stopped_by"] == "diverged", facts
    assert len(facts["line"]) == 1 and "the loop set the rate to 5000 in ps.optimizer" in facts["line"][0], facts
