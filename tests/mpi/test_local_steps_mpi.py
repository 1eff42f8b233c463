"""The local-SGD family (``--local-steps``, localsgd, diloco) against closed forms, on 5 ranks.

DiLoCo with one local step, inner sgd at rate eta and outer sgd at rate 1 is
bsp at eta; one worker's DiLoCo with outer sgd at rate 1 is that worker's
plain torch loop with the inner optimizer; the bounded form keeps the outer
clocks within ``--staleness``; every pseudo-gradient is accounted for; a
resume from a periodic checkpoint takes the inner optimizer's state back and
ends bit for bit as the uninterrupted run.
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpcps
from hpcps.analysis.report import max_clock_gap
from hpcps.data.loaders import load_dataset
from hpcps.runtime.checkpoints.files import read_checkpoint
from hpcps.training.flat import FlatParameters
from hpcps.training.models import build_model
from hpcps.training.local import InnerFiles
from mpitest import clocks_at, share, train

pytestmark = [pytest.mark.mpi(min_size=5), pytest.mark.timeout(300)]

WORKERS = [1, 2, 3, 4]


def sub(world, n: int):
    return world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)


def test_diloco_with_one_local_step_and_outer_sgd_at_rate_one_is_bsp(world, mpi_tmp_path):
    """H=1, inner sgd at eta, outer sgd at 1 without momentum: each round's pseudo-gradient is eta times the
    gradient, so 50 rounds on 2 shards and 3 workers end where bsp at eta ends."""
    eta, rounds = 0.05, 50
    common = dict(steps=rounds, servers=2, seed=3, batch_size=16)
    bsp, _ = train(mpi_tmp_path / "bsp.h5", paradigm="bsp", lr=eta, **common)
    dil, t = train(mpi_tmp_path / "diloco.h5", paradigm="diloco", local_steps=1, inner_optimizer="sgd",
                   inner_lr=eta, lr=1.0, momentum=0.0, **common)
    facts = None
    if world.rank == 0:
        facts = {"err": float(np.abs(bsp.params - dil.params).max()),
                 "moved": float(np.abs(bsp.params - read_start(t)).max()),
                 "rows": len(t["workers/iterations"]), "applied": int(t["summary"]["gradients_applied"]),
                 "versions": int(t["servers/updates"]["version"].max()) + 1}
    facts = share(world, facts)
    assert facts["moved"] > 1e-2
    assert facts["err"] < 1e-5, facts["err"]
    assert facts["rows"] == facts["applied"] == 3 * rounds  # a row and a pseudo-gradient per worker and round
    assert facts["versions"] == rounds


def read_start(tables) -> np.ndarray:
    """The parameters the run started from: the built-in model at the run's seed."""
    data = load_dataset("digits")
    return FlatParameters(build_model("mlp", data.in_shape, data.n_classes, seed=3)).params.copy()


VOCAB, CONTEXT, BATCH = 11, 8, 6


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, x, y):
        return F.cross_entropy(self.head(F.gelu(self.ln(self.tok(x)))).reshape(-1, VOCAB), y.reshape(-1))


def lm_batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g)
    return x, torch.roll(x, -1, 1)


@pytest.mark.parametrize("every,overlap", [(1, 0), (4, 0), (7, 0), (4, 2), (7, 6)])
def test_one_worker_diloco_is_its_plain_loop_with_the_inner_optimizer(world, mpi_tmp_path, every, overlap):
    """One worker, outer sgd at rate 1 without momentum, any H: the outer step sets the parameters to the
    worker's own, so the run is the worker's torch loop with AdamW (18 steps: the last round is shorter
    where H does not divide them), through ``ps.step()``; a row per round. So too with ``--overlap-steps``:
    the parameters it rebases onto are those it pushed (H=7, T=6: the last round, of 4 steps, takes its
    outer step before its push)."""
    steps, lr = 18, 1e-2
    comm = sub(world, 2)
    facts = None
    if comm != MPI.COMM_NULL:
        ps = hpcps.init(TinyLM, device="cpu", paradigm="diloco", local_steps=every, inner_optimizer="adamw",
                        inner_lr=lr, lr=1.0, momentum=0.0, steps=steps, overlap_steps=overlap,
                        out=str(mpi_tmp_path / f"one{every}-{overlap}.h5"),
                        progress=False, exit_on_error=False, comm=comm)
        with ps:
            while ps.running:
                ps.model(*lm_batch(ps.iteration)).backward()
                ps.step()
        if comm.rank == 0:
            torch.manual_seed(0)
            model = TinyLM()
            start = flat_of(model)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)  # (hpcps's default decay)
            for it in range(steps):
                model(*lm_batch(it)).backward()
                opt.step()
                opt.zero_grad()
            ref = flat_of(model)
            got = torch.from_numpy(ps.result.params[:len(ref)])
            facts = {"err": float((got - ref).abs().max()), "moved": float((ref - start).abs().max()),
                     "pushed": int(ps.result.summary["gradients_pushed"])}
        comm.Free()
    facts = share(world, facts)
    assert facts["moved"] > 1e-2
    assert facts["err"] < 1e-5, facts["err"]
    assert facts["pushed"] == -(-steps // every)


def test_a_nonfinite_inner_gradient_is_skipped_and_the_worker_trains_on(world, mpi_tmp_path):
    """Regression: under local steps one NaN in an inner step's gradient was applied by the inner AdamW, whose
    state stayed NaN: every later round of that worker was dropped and the run stopped as diverged. Now the
    inner step is skipped (as --nonfinite skip skips a push) and counted: one worker, H=4, NaN at inner step 5,
    the run is its torch loop with AdamW that skips that step, and every round is applied."""
    steps, every, lr, bad = 16, 4, 1e-2, 5
    comm = sub(world, 2)
    facts = None
    if comm != MPI.COMM_NULL:
        out = mpi_tmp_path / "nan-inner.h5"
        ps = hpcps.init(TinyLM, device="cpu", paradigm="diloco", local_steps=every, inner_optimizer="adamw",
                        inner_lr=lr, lr=1.0, momentum=0.0, steps=steps, out=str(out), progress=False,
                        exit_on_error=False, comm=comm)
        with ps:
            while ps.running:
                ps.model(*lm_batch(ps.iteration)).backward()
                if ps.iteration == bad:
                    next(ps.model.parameters()).grad.view(-1)[0] = float("nan")
                ps.step()
        if comm.rank == 0:
            torch.manual_seed(0)
            model = TinyLM()
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            for it in range(steps):
                model(*lm_batch(it)).backward()
                if it != bad:
                    opt.step()
                opt.zero_grad()
            ref = flat_of(model)
            got = torch.from_numpy(ps.result.params[:len(ref)])
            with h5py.File(out, "r") as f:
                scalars = f["workers/scalars"][()]
            counted = scalars[scalars["name"] == b"inner_nonfinite"]
            facts = {"err": float((got - ref).abs().max()), "applied": int(ps.result.summary["gradients_applied"]),
                     "counted": [(int(r["step"]), float(r["value"])) for r in counted]}
        comm.Free()
    facts = share(world, facts)
    assert facts["err"] < 1e-5, facts["err"]
    assert facts["applied"] == steps // every
    assert facts["counted"] == [(bad, 1.0)]


def flat_of(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def set_flat(model: torch.nn.Module, values: torch.Tensor) -> None:
    """Copy ``values`` into the parameters (torch's ``vector_to_parameters`` would make them views of it)."""
    at = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(values[at:at + p.numel()].view_as(p))
            at += p.numel()


def overlapped_replay(workers: int, steps: int, every: int, overlap: int, eta: float, momentum: float) -> torch.Tensor:
    """Lock-step DiLoCo with ``--overlap-steps`` in plain torch: inner sgd at ``eta`` on worker ``w``'s batches
    ``lm_batch(1000 w + k)``; a round's mean pseudo-gradient stepped by outer sgd at rate 1 with ``momentum``;
    after a push each worker takes ``overlap`` steps of its next round on its own parameters, then takes
    the new global ones plus those steps' change, the global ones its anchor. The final global parameters."""
    torch.manual_seed(0)
    base = TinyLM()
    glob = torch.nn.Parameter(flat_of(base).clone())
    outer = torch.optim.SGD([glob], lr=1.0, momentum=momentum)
    models = [TinyLM() for _ in range(workers)]
    for m in models:
        set_flat(m, glob.detach())
    inner = [torch.optim.SGD(m.parameters(), lr=eta) for m in models]
    anchor = [glob.detach().clone() for _ in range(workers)]
    pushed: list[torch.Tensor | None] = [None] * workers

    def rebase() -> None:
        for w, m in enumerate(models):
            set_flat(m, glob.detach() + (flat_of(m) - pushed[w]))
            anchor[w], pushed[w] = glob.detach().clone(), None

    for r in range(-(-steps // every)):
        length = min(every, steps - r * every)
        if pushed[0] is not None and overlap == 0:  # no overlap: each round starts on the global parameters
            rebase()
        for k in range(length):
            for w, m in enumerate(models):
                m(*lm_batch(1000 * w + r * every + k)).backward()
                inner[w].step()
                inner[w].zero_grad()
            if pushed[0] is not None and (k + 1 == overlap or k + 1 == length):
                rebase()
        deltas = [anchor[w] - flat_of(m) for w, m in enumerate(models)]
        pushed = [flat_of(m).clone() for m in models]
        outer.zero_grad()
        glob.grad = torch.stack(deltas).mean(0)
        outer.step()
    return glob.detach().clone()


def test_overlapped_rounds_rebase_each_worker_onto_the_global_parameters_as_streaming_diloco_does(world, mpi_tmp_path):
    """Two workers, lock-step rounds of 4 inner sgd steps, outer sgd with momentum 0.5, ``--overlap-steps 2``:
    the final parameters are the plain-torch replay's (each worker's next round begins on the parameters
    it pushed and rebases after 2 steps), which differ from the same run without overlap; a row and an
    applied pseudo-gradient per worker and round."""
    steps, every, overlap, eta, momentum = 16, 4, 2, 0.5, 0.5
    comm = sub(world, 3)
    facts = None
    if comm != MPI.COMM_NULL:
        ps = hpcps.init(TinyLM, device="cpu", paradigm="diloco", local_steps=every, inner_optimizer="sgd",
                        inner_lr=eta, lr=1.0, momentum=momentum, nesterov=False, steps=steps,
                        overlap_steps=overlap, out=str(mpi_tmp_path / "overlap.h5"), progress=False,
                        exit_on_error=False, comm=comm)
        with ps:
            while ps.running:
                ps.model(*lm_batch(1000 * ps.worker_index + ps.iteration)).backward()
                ps.step()
        if comm.rank == 0:
            ref = overlapped_replay(2, steps, every, overlap, eta, momentum)
            plain = overlapped_replay(2, steps, every, 0, eta, momentum)
            got = torch.from_numpy(ps.result.params[:len(ref)])
            summary = ps.result.summary
            facts = {"err": float((got - ref).abs().max()), "apart": float((ref - plain).abs().max()),
                     "pushed": int(summary["gradients_pushed"]), "applied": int(summary["gradients_applied"])}
        comm.Free()
    facts = share(world, facts)
    assert facts["apart"] > 1e-3  # the overlap changes the run
    assert facts["err"] < 1e-5, facts["err"]
    assert facts["pushed"] == facts["applied"] == 2 * steps // every


def test_the_bounded_form_keeps_every_outer_clock_within_s_of_the_slowest(world, mpi_tmp_path):
    """ssp over rounds of 3 local steps, a straggler 3x slower: when a worker starts a round (its row's
    version; and its row's start time against the times the shard applied the others' pseudo-gradients), it is
    at most s rounds ahead of the slowest worker's pseudo-gradients applied; the bound binds."""
    s, steps, every = 1, 36, 3
    _, t = train(mpi_tmp_path / "ssp.h5", paradigm="ssp", local_steps=every, staleness=s, steps=steps,
                 slowdown=["4=3"], lr=0.3)
    facts = None
    if world.rank == 0:
        it, up = t["workers/iterations"], t["servers/updates"]
        gaps = [int(row["step"]) - min(clocks_at(up, int(row["version"]), WORKERS).values()) for row in it]
        fast = it[it["rank"] != 4]
        facts = {"max_gap": max(gaps), "fast_wait": float(fast["wait_s"].sum()), "rows": len(it),
                 "timed_gap": max_clock_gap(it, up, steps // every),
                 "steps": sorted(set(it["step"].tolist())), "applied": int(t["summary"]["gradients_applied"])}
    facts = share(world, facts)
    assert facts["rows"] == facts["applied"] == 4 * steps // every
    assert facts["steps"] == list(range(steps // every))
    assert facts["max_gap"] == s  # never more than s rounds ahead, and the straggler made the bound bind
    assert facts["timed_gap"] <= s  # also from the timestamps alone (hpcps report's check)
    assert facts["fast_wait"] > 0.0


@pytest.mark.parametrize("paradigm, overlap", [("diloco", 0), ("asp", 0), ("asp", 1)])
def test_a_resume_from_a_periodic_checkpoint_takes_back_the_inner_state(world, mpi_tmp_path, paradigm, overlap):
    """Inner sgd with momentum 0.9 (its state matters), 20 rounds of 2 local steps, a checkpoint every 10
    versions. diloco (lock-step rounds): resumed at round 10 the run ends bit for bit as the uninterrupted
    one, and without the inner state (its file removed) it does not. asp (a cut while the run goes on): every
    worker finds its state at its clock in the cut, and the resumed run pushes exactly the rest (also with
    ``--overlap-steps 1``, a push's pull taken after the next round's first step). diloco resumed
    with adam inside instead trains its 10 rounds, each worker's inner state afresh (sgd's is not adam's)."""
    ckdir = mpi_tmp_path / f"ck-{paradigm}-{overlap}"
    common = dict(paradigm=paradigm, local_steps=2, steps=40, seed=4, inner_momentum=0.9, inner_lr=0.05,
                  checkpoint_every=10, checkpoint_dir=str(ckdir), overlap_steps=overlap)
    full, _ = train(mpi_tmp_path / f"full-{paradigm}-{overlap}.h5", **common)
    facts = None
    if world.rank == 0:
        # the newest: a worker keeps its inner states from the newest complete checkpoint on (asp's cut falls
        # where it falls past a multiple of 10; diloco's last is at round 20, whose state is not yet pruned)
        path = str(sorted(ckdir.glob("step-*.h5"))[-1 if paradigm == "asp" else 0])
        clocks = read_checkpoint(path).worker_clocks.tolist()
        facts = {"path": path, "clocks": clocks, "found": [InnerFiles(str(ckdir), w).read(c) is not None
                                             for w, c in enumerate(clocks)]}
    facts = share(world, facts)
    assert all(facts["found"]), facts
    path = facts["path"]
    resumed, t = train(mpi_tmp_path / f"resumed-{paradigm}-{overlap}.h5", resume=path,
                       **{**common, "checkpoint_dir": str(ckdir / "again")})
    if paradigm == "diloco":  # another inner optimizer: its state is not loaded into this one (it starts afresh)
        other, _ = train(mpi_tmp_path / "other.h5", resume=path, **{**common, "inner_optimizer": "adam", "inner_momentum": 0.0,
                                                         "inner_lr": 1e-3, "checkpoint_dir": str(ckdir / "other")})
    if paradigm == "diloco":
        if world.rank == 0:
            for w, c in enumerate(facts["clocks"]):
                os.remove(InnerFiles(str(ckdir), w).path(c))
        world.Barrier()
        fresh, _ = train(mpi_tmp_path / "fresh.h5", resume=path, **{**common, "checkpoint_dir": str(ckdir / "fresh")})
    if world.rank == 0:
        facts.update(pushed=int(t["summary"]["gradients_pushed"]), applied=int(t["summary"]["gradients_applied"]))
        if paradigm == "diloco":
            facts.update(equal=bool(np.array_equal(full.params, resumed.params)),
                         fresh_equal=bool(np.array_equal(full.params, fresh.params)),
                         moved=float(np.abs(full.params - read_checkpoint(path).params).max()),
                         other=bool(np.isfinite(other.params).all()))
    facts = share(world, facts)
    assert facts["pushed"] == facts["applied"] == 4 * 20 - sum(facts["clocks"])  # (asp: 0 where its last cut fell at the end)
    if paradigm == "diloco":
        assert facts["clocks"] == [10] * 4 and facts["pushed"] == 40
        assert facts["moved"] > 1e-3
        assert facts["equal"]  # exactly: the inner momentum came back
        assert not facts["fresh_equal"]  # and it mattered
        assert facts["other"]


def test_local_steps_by_speed_give_a_worker_twice_as_slow_half_the_steps_of_a_round(world, mpi_tmp_path):
    """--local-steps-by-speed, H=4, the last worker 2x slower (emulated compute): every worker takes 4 steps
    in its first round, where they are timed; from then on the slow one takes 2 per round, the others 4, each
    round's batches still numbered from round x H."""
    ps = hpcps.init(TinyLM, device="cpu", paradigm="bsp", local_steps=4, local_steps_by_speed=True,
                    inner_lr=0.05, lr=1.0, steps=16, compute_time=0.03, slowdown={4: 2.0},
                    out=str(mpi_tmp_path / "speed.h5"), progress=False, exit_on_error=False, comm=world)
    seen = []
    with ps:
        while ps.running:
            seen.append(ps.iteration)
            ps.model(*lm_batch(ps.iteration)).backward()
            ps.step()
    got = world.gather(seen if ps.is_worker else None, root=0)
    facts = share(world, [s for s in got if s is not None] if world.rank == 0 else None)
    assert facts[:3] == [list(range(16))] * 3
    assert facts[3] == [0, 1, 2, 3, 4, 5, 8, 9, 12, 13]
