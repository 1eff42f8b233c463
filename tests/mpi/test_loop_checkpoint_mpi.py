"""A checkpoint holds worker 0's loop as of the checkpoint: decisions made after the step that reached
the checkpointed version (an epoch's end: a new rate, a counter), ``ps.optimizer``'s hyperparameters and
the model's integer buffers come back on resume (mpiexec -n 5)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

import hpcps
from mpitest import share

pytestmark = [pytest.mark.mpi(min_size=5), pytest.mark.timeout(240)]

LR, EPOCH, STEPS = 0.05, 4, 12


class Net(torch.nn.Module):
    """A layer, BatchNorm (whose num_batches_tracked is an integer buffer), a layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)


def batch(step: int, worker: int):
    g = torch.Generator().manual_seed(100 * step + worker)
    x = torch.randn(16, 6, generator=g)
    return x, x.sum(1, keepdim=True)


def _train(ps):
    """Anneal the rate by 4 at each epoch's end, after the epoch's last step; count the epochs in ps.state;
    validate (no gradients) before deciding, as a plateau scheduler's loop does."""
    with ps:
        if ps.is_worker:
            ps.state.setdefault("epochs", 0)
        while ps.running:
            ps.model(*batch(ps.iteration, ps.worker_index)).backward()
            ps.step()
            if ps.iteration % EPOCH == 0:  # the epoch's end (ps.iteration is the next step)
                with torch.no_grad():
                    ps.model.eval()
                    ps.model(*batch(1000, 0))
                    ps.model.train()
                for group in ps.optimizer.param_groups:
                    group["lr"] /= 4
                ps.state["epochs"] += 1
        tracked = int(ps.model.net[1].num_batches_tracked) if ps.is_worker else None
    return ps, tracked


def _rates(path):
    with h5py.File(path) as f:
        up = f["servers/updates"][()]
    return {int(v): float(lr) for v, lr in zip(up["version"], up["lr"])}


def test_a_run_resumed_from_an_epochs_checkpoint_applies_the_rate_its_loop_set_at_that_epochs_end(world, mpi_tmp_path):
    """bsp, 4 workers, a checkpoint every epoch (4 steps): a run stopped after 2 epochs and resumed from its
    version-8 checkpoint applies, at every later version, the rate the uninterrupted run applied (LR/16,
    set after version 8 was reached), ends with its parameters, and its loop has counted 2 epochs and
    8 batches in BatchNorm."""
    common = dict(optimizer="sgd", lr=LR, momentum=0.9, paradigm="bsp", lr_scaling="none", progress=False,
                  exit_on_error=False, comm=world, checkpoint_every=EPOCH)
    whole, _ = _train(hpcps.init(Net, device="cpu", steps=STEPS, out=str(mpi_tmp_path / "whole.h5"),
                                 checkpoint_dir=str(mpi_tmp_path / "w"), **common))
    _train(hpcps.init(Net, device="cpu", steps=2 * EPOCH, out=str(mpi_tmp_path / "first.h5"),
                      checkpoint_dir=str(mpi_tmp_path / "c"), **common))
    resumed = hpcps.init(Net, device="cpu", steps=STEPS, out=str(mpi_tmp_path / "resumed.h5"), checkpoint_dir=str(mpi_tmp_path / "r"),
                         resume=str(mpi_tmp_path / "c" / f"step-{2 * EPOCH:06d}.h5"), **common)
    at_start = (dict(resumed.state), int(resumed.model.net[1].num_batches_tracked)) if resumed.is_worker else None
    resumed, tracked = _train(resumed)
    starts = world.gather(at_start, root=0)
    ends = world.gather(tracked, root=0)
    facts = None
    if world.rank == 0:
        a, b = _rates(whole.result.path), _rates(resumed.result.path)
        facts = {"versions": sorted(b), "same": all(b[v] == a[v] for v in b), "later": sorted({b[v] for v in b}),
                 "err": float(np.abs(resumed.result.params - whole.result.params).max()),
                 "starts": [s for s in starts if s is not None], "ends": [e for e in ends if e is not None]}
    facts = share(world, facts)
    assert facts["versions"] == list(range(2 * EPOCH, STEPS)), facts  # the versions gradients were applied to
    assert facts["same"] and facts["later"] == [LR / 16], facts
    assert facts["err"] == 0.0, facts
    assert facts["starts"] == [({"epochs": 2}, 2 * EPOCH)] * 4, facts
    assert facts["ends"] == [STEPS] * 4, facts
