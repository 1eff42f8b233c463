"""``ps.optimizer.state_dict()`` gathers the shards' optimizer state in torch's layout, and
``load_state_dict()`` hands one back, from a plain torch run or another shard count (mpiexec -n 5)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from mpi4py import MPI

import hpcps
from hpcps.runtime.checkpoints.files import checkpoint_path, read_optimizer_state
from mpitest import share
from test_step_api import TinyLM, batch, sub

pytestmark = [pytest.mark.mpi(min_size=5), pytest.mark.timeout(240)]

LR, WD, HALF = 0.05, 0.1, 6


def _torch_optimizer(model, name):
    names = dict(model.named_parameters())
    groups = [{**g, "params": [names[n] for n in g["params"]]} for g in hpcps.decay_groups(model, WD)]
    return torch.optim.SGD(groups, lr=LR, momentum=0.9) if name == "sgd" else torch.optim.Adam(groups, lr=LR / 10)


def _flat_state(state: dict, key: str) -> torch.Tensor:
    """One key of a torch-layout state, every parameter's flattened, in the parameters' order."""
    return torch.cat([state["state"][i][key].reshape(-1) for i in sorted(state["state"])])


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_torch_state_loaded_mid_run_continues_as_torch_would_and_comes_back(world, mpi_tmp_path, name):
    """torch trains 6 steps, then hpcps (one worker, 2 shards cutting the decay groups) takes its weights and
    optimizer state (load_state_dict) and trains the next 6: the parameters and the state hpcps's
    ps.optimizer.state_dict() returns, after a torch.save round trip, are torch's after 12 steps."""
    comm = sub(world, 3)
    facts = None
    if comm != MPI.COMM_NULL:
        torch.manual_seed(0)
        ref = TinyLM()
        opt = _torch_optimizer(ref, name)
        for it in range(2 * HALF):
            if it == HALF:
                weights, mid = copy.deepcopy(ref.state_dict()), copy.deepcopy(opt.state_dict())
            ref(*batch(it, 0)).backward()
            opt.step()
            opt.zero_grad()

        def model():
            m = TinyLM()
            m.load_state_dict(weights)
            return m

        make = (lambda groups: torch.optim.SGD(groups, lr=LR, momentum=0.9)) if name == "sgd" else \
            (lambda groups: torch.optim.Adam(groups, lr=LR / 10))
        ps = hpcps.init(model, device="cpu", optimizer=make, param_groups=lambda m: hpcps.decay_groups(m, WD), paradigm="bsp",
                        steps=HALF, servers=2, progress=False, out=str(mpi_tmp_path / f"{name}.h5"),
                        exit_on_error=False, comm=comm)
        with ps:
            if ps.is_worker:
                ps.optimizer.load_state_dict(mid)
            while ps.running:
                ps.model(*batch(HALF + ps.iteration, 0)).backward()
                ps.step()
            if ps.is_worker:
                buf = io.BytesIO()
                torch.save(ps.optimizer.state_dict(), buf)
                buf.seek(0)
                got = torch.load(buf)
                want = opt.state_dict()
                keys = ["momentum_buffer"] if name == "sgd" else ["exp_avg", "exp_avg_sq"]
                facts = {"params": sorted(got["state"]) == sorted(want["state"]),
                         "err": max(float((_flat_state(got, k) - _flat_state(want, k)).abs().max()) for k in keys),
                         "size": max(float(_flat_state(want, k).abs().max()) for k in keys),
                         "shapes": all(got["state"][i][keys[0]].shape == want["state"][i][keys[0]].shape
                                       for i in want["state"]),
                         "groups": [(len(g["params"]), g["weight_decay"]) for g in got["param_groups"]]
                         == [(len(g["params"]), g["weight_decay"]) for g in want["param_groups"]]}
                if name == "adam":
                    facts["steps"] = sorted({float(s["step"]) for s in got["state"].values()})
        if comm.rank == 0:
            want_p = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
            params_err = float((torch.from_numpy(ps.result.params[:len(want_p)]) - want_p).abs().max())
        facts = comm.bcast(facts, root=2)
        if comm.rank == 0:
            facts["params_err"] = params_err
        comm.Free()
    facts = share(world, facts)
    assert facts["params"] and facts["shapes"] and facts["groups"], facts
    assert facts["size"] > 1e-4  # there is a state to compare
    assert facts["err"] <= 1e-6 * max(1.0, facts["size"]), facts
    assert facts["params_err"] < 1e-5, facts
    if name == "adam":
        assert facts["steps"] == [2.0 * HALF]


def test_the_gathered_momentum_is_what_the_two_shards_hold(world, mpi_tmp_path):
    """3 workers under bsp, momentum SGD on 2 shards, a checkpoint at the last version: every worker's
    ps.optimizer.state_dict() after the last step holds the momentum buffers the shards wrote, value for value."""
    steps = 5
    ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=LR, momentum=0.9, paradigm="bsp", steps=steps, servers=2,
                    checkpoint_every=steps, progress=False, out=str(mpi_tmp_path / "two.h5"), exit_on_error=False,
                    comm=world)
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            ps.step()
        got = _flat_state(ps.optimizer.state_dict(), "momentum_buffer") if ps.is_worker else None
    gathered = world.gather(got, root=0)
    facts = None
    if world.rank == 0:
        path = checkpoint_path(ps.run.state.ckpt_dir, steps)
        held = torch.cat([torch.cat([read_optimizer_state(path, s)["state"][k]["momentum_buffer"]
                                     for k in sorted(read_optimizer_state(path, s)["state"])]) for s in range(2)])
        workers = [g for g in gathered if g is not None]
        facts = {"n": len(workers), "equal": all(torch.equal(g, held) for g in workers),
                 "size": float(held.abs().max()), "len": (len(held), len(workers[0]))}
    facts = share(world, facts)
    assert facts["n"] == 3 and facts["len"][0] == facts["len"][1], facts
    assert facts["size"] > 0 and facts["equal"], facts


def test_a_state_from_two_shards_loads_into_one(world, mpi_tmp_path):
    """A state gathered on 2 shards and loaded into a run on 1 shard comes back out of it unchanged."""
    facts = None
    saved = None
    ps = hpcps.init(TinyLM, device="cpu", optimizer="adam", lr=1e-3, paradigm="bsp", steps=3, servers=2, progress=False,
                    out=str(mpi_tmp_path / "a.h5"), exit_on_error=False, comm=world)
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            ps.step()
        if ps.is_worker:
            saved = ps.optimizer.state_dict()
    saved = world.bcast(saved, root=2)  # rank 2, a worker of both runs (rank 1 serves the first)
    ps = hpcps.init(TinyLM, device="cpu", optimizer="adam", lr=1e-3, paradigm="bsp", steps=1, servers=1, progress=False,
                    out=str(mpi_tmp_path / "b.h5"), exit_on_error=False, comm=world)
    with ps:
        if ps.is_worker:
            ps.optimizer.load_state_dict(saved)
            back = ps.optimizer.state_dict()
            facts = {"same": all(torch.equal(back["state"][i][k], saved["state"][i][k])
                                 for i in saved["state"] for k in ("exp_avg", "exp_avg_sq", "step")),
                     "keys": sorted(back["state"]) == sorted(saved["state"]),
                     "moved": float(_flat_state(saved, "exp_avg").abs().max())}
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            ps.step()
    facts = share(world, world.bcast(facts, root=1))
    assert facts["keys"] and facts["same"] and facts["moved"] > 0, facts
