"""Server optimizers, schedules and buffers against torch.optim replays (mpiexec -n 5), through hpcps.train."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import hpcps
from hpcps.data.sharding import batch_indices
from hpcps.data.loaders import load_dataset
from hpcps.transport.poll import polite_barrier
from mpitest import share

pytestmark = pytest.mark.mpi(min_size=5)

TORCH_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def bn_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def _replay(factory, *, steps, batch, seed, optimizer, options, n_workers=4, schedule=lambda v: 1.0):
    """Single-process torch: step k averages the N workers' step-k gradients, as one optimizer step;
    float buffers become the mean of what each worker's forward made of them (model averaging)."""
    data = load_dataset("digits")
    torch.manual_seed(seed)
    model = factory()
    opt = TORCH_OPTIMIZERS[optimizer](model.parameters(), **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    for k in range(steps):
        state = copy.deepcopy(model.state_dict())
        grads, buffers = [], []
        for w in range(n_workers):
            model.load_state_dict(state)
            idx = batch_indices(len(y), batch_size=batch, n_workers=n_workers, worker=w, step=k, seed=seed)
            model.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            buffers.append({n: b.clone() for n, b in model.named_buffers() if b.is_floating_point()})
        model.load_state_dict(state)
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
        sched.step()
        with torch.no_grad():
            for n, b in model.named_buffers():
                if b.is_floating_point():
                    b.copy_(torch.stack([bw[n] for bw in buffers]).mean(0))
    return {n: t.detach().clone() for n, t in model.state_dict().items() if t.is_floating_point()}


def _diff(result_state, reference):
    return max(float((result_state[n] - t).abs().max()) for n, t in reference.items())


def _moved(reference, factory, seed):
    torch.manual_seed(seed)
    start = factory().state_dict()
    return max(float((start[n] - t).abs().max()) for n, t in reference.items())


@pytest.mark.parametrize("optimizer,options,servers,tol", [
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=5e-4), 1, 1e-5),
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=5e-4), 2, 1e-5),
    ("adam", dict(lr=3e-3, weight_decay=1e-4), 2, 1e-4),
])
def test_bsp_equals_torch_optim_on_the_concatenated_batches(world, mpi_tmp_path, optimizer, options, servers, tol):
    steps, batch, seed = 12, 16, 2
    result = hpcps.train(model=mlp, data="digits", optimizer=optimizer, **options, paradigm="bsp", servers=servers,
                         steps=steps, batch_size=batch, seed=seed, out=str(mpi_tmp_path / f"{optimizer}{servers}.h5"),
                         progress=False, exit_on_error=False, comm=world)
    facts = None
    if world.rank == 0:
        ref = _replay(mlp, steps=steps, batch=batch, seed=seed, optimizer=optimizer, options=options,
                      n_workers=world.size - servers)
        facts = {"diff": _diff(result.state_dict, ref), "moved": _moved(ref, mlp, seed)}
    facts = share(world, facts)
    assert facts["moved"] > 1e-2, "the reference did not train"
    assert facts["diff"] < tol, facts


def test_batchnorm_buffers_are_the_mean_of_the_workers_buffers(world, mpi_tmp_path):
    """BSP with a BatchNorm model: parameters as torch.optim on the mean gradient, and the server's
    running statistics, after every round, the mean of the four workers' (each updated by its batch)."""
    steps, batch, seed = 6, 16, 5
    result = hpcps.train(model=bn_mlp, data="digits", optimizer="sgd", lr=0.1, momentum=0.9, paradigm="bsp",
                         steps=steps, batch_size=batch, seed=seed, out=str(mpi_tmp_path / "bn.h5"), progress=False,
                         exit_on_error=False, comm=world)
    facts = None
    if world.rank == 0:
        ref = _replay(bn_mlp, steps=steps, batch=batch, seed=seed, optimizer="sgd",
                      options=dict(lr=0.1, momentum=0.9))
        bn = {n: t for n, t in ref.items() if "running" in n}
        facts = {"diff": _diff(result.state_dict, ref), "bn_diff": _diff(result.state_dict, bn),
                 "var_moved": float((result.state_dict["2.running_var"] - 1).abs().max())}
    facts = share(world, facts)
    assert facts["var_moved"] > 1e-2, "the running statistics never reached the server"
    assert facts["bn_diff"] < 1e-5 and facts["diff"] < 1e-5, facts


def test_one_worker_full_batch_with_a_schedule_equals_the_torch_replay(world, mpi_tmp_path):
    """1 server + 1 worker, the whole training set as its batch: torch.optim SGD (Nesterov, weight
    decay) under LambdaLR with a linear warm-up and a cosine decay, written here independently."""
    steps, warmup, seed = 30, 5, 1
    options = dict(lr=0.2, momentum=0.9, nesterov=True, weight_decay=1e-3)

    def schedule(v):
        return (v + 1) / warmup if v < warmup else 0.5 * (1 + math.cos(math.pi * (v - warmup) / (steps - warmup)))

    pair = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)
    facts = None
    if pair != MPI.COMM_NULL:
        n_train = len(load_dataset("digits").y_train)
        result = hpcps.train(model=mlp, data="digits", optimizer="sgd", **options, lr_schedule="cosine",
                             warmup_steps=warmup, paradigm="bsp", steps=steps, batch_size=n_train, seed=seed,
                             out=str(mpi_tmp_path / "one.h5"), progress=False, exit_on_error=False, comm=pair)
        if pair.rank == 0:
            ref = _replay(mlp, steps=steps, batch=n_train, seed=seed, optimizer="sgd", options=options,
                          n_workers=1, schedule=schedule)
            facts = {"diff": _diff(result.state_dict, ref), "moved": _moved(ref, mlp, seed)}
        pair.Free()
    polite_barrier(world)
    facts = world.bcast(facts, root=0)
    assert facts["moved"] > 1e-2
    assert facts["diff"] < 1e-5, facts


@pytest.mark.parametrize("optimizer,options", [("sgd", dict(momentum=0.9, weight_decay=1e-3)),
                                               ("adam", dict(lr=1e-3))])
def test_bsp_resumed_with_optimizer_state_ends_bit_for_bit(world, mpi_tmp_path, optimizer, options):
    ckdir = mpi_tmp_path / f"ck-{optimizer}"
    common = dict(model=bn_mlp, data="digits", optimizer=optimizer, **options, paradigm="bsp", steps=30, servers=2,
                  seed=4, checkpoint_every=15, progress=False, exit_on_error=False, comm=world)
    full = hpcps.train(out=str(mpi_tmp_path / f"full-{optimizer}.h5"), checkpoint_dir=str(ckdir), **common)
    resumed = hpcps.train(out=str(mpi_tmp_path / f"resumed-{optimizer}.h5"), resume=str(ckdir / "step-000015.h5"),
                          checkpoint_dir=str(ckdir / "again"), **common)
    facts = None
    if world.rank == 0:
        facts = {"equal": bool(np.array_equal(full.params, resumed.params)),
                 "parts": sorted(p.name for p in ckdir.iterdir() if p.suffix == ".pt"),
                 "tracked": [int(r.state_dict[k]) for r in (full, resumed) for k in r.state_dict
                             if k.endswith("num_batches_tracked")]}
    facts = share(world, facts)
    # each shard's optimizer, and worker 0's loop (here: BatchNorm's batch count, an integer buffer)
    assert facts["parts"] == ["step-000015.optim-0.pt", "step-000015.optim-1.pt", "step-000015.user.pt",
                              "step-000030.optim-0.pt", "step-000030.optim-1.pt", "step-000030.user.pt"]
    assert facts["equal"]
    assert facts["tracked"] == [30, 30], facts  # the saved models count worker 0's batches, the resumed one too


@pytest.mark.timeout(120)
@pytest.mark.parametrize("paradigm,rule", [("asp", "auto"), ("asp", "none"), ("bsp", "auto")])
def test_each_update_records_the_momentum_and_rate_the_staleness_rule_gave_it(world, mpi_tmp_path, paradigm, rule):
    """--stale-momentum auto: each shard's update i is applied at momentum 1-(1-0.9)(1+s) (at least 0), s the
    running mean staleness of its updates up to i (the rule replayed on the shard's own rows), and at the rate
    times (1-m')/(1-m); bsp's and --stale-momentum none's are the user's 0.9 and rate."""
    import h5py

    from hpcps.training.momentum import StaleMomentum

    out = mpi_tmp_path / f"{paradigm}-{rule}.h5"
    hpcps.train(model=mlp, data="digits", optimizer="sgd", lr=0.1, momentum=0.9, stale_momentum=rule,
                paradigm=paradigm, servers=2, steps=15, batch_size=16, seed=3, out=str(out), progress=False,
                exit_on_error=False, comm=world)
    facts = None
    if world.rank == 0:
        with h5py.File(out) as f:
            up = f["servers/updates"][()]
        n_workers, lr_per_update = world.size - 2, 0.1 / (world.size - 2 if paradigm == "asp" else 1)
        facts = {"stale": int(up["staleness"].max()), "bad": []}
        for shard in (0, 1):
            rows = np.sort(up[(up["shard"] == shard) & (up["applied"] == 1)], order="version")
            replay = StaleMomentum()
            for r in rows:
                replay.observe(r["staleness"])
                momentum, factor = replay.adjusted(0.9) if rule == "auto" else (0.9, 1.0)
                if not (math.isclose(r["momentum"], momentum, abs_tol=1e-9)
                        and math.isclose(r["lr"], lr_per_update * factor, rel_tol=1e-9)):
                    facts["bad"].append((shard, int(r["version"]), float(r["momentum"]), momentum))
        facts["n"] = len(up)
        facts["n_workers"] = n_workers
    facts = share(world, facts)
    assert facts["n"] == 2 * facts["n_workers"] * 15
    assert facts["bad"] == [], facts["bad"][:5]
    if paradigm == "asp":
        assert facts["stale"] > 0  # the rule had something to act on
