"""The step API (hpcps.init): the user's own loop under hpcps, against closed forms.

A one-worker BSP run through ``ps.step()`` is the plain torch loop with the
optimizer on the servers: param groups, gradient accumulation, clipping and
a warm-up + cosine schedule give the same parameters with 1 and 3 shards; a
GradScaler skips exactly the steps it skips in torch; every worker draws
its own random stream; the run file records the optimizer and rates that
ran; the loop's own fields come back on resume, and a resume under another
optimizer or schedule is refused.
"""

from __future__ import annotations

import json
import math
import os

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpcps
from hpcps.errors import UserError
from hpcps.training.optim import make_schedule
from mpitest import share

pytestmark = pytest.mark.timeout(240)

VOCAB, CONTEXT, BATCH = 11, 8, 6


class TinyLM(torch.nn.Module):
    """Embeddings, a LayerNorm, a projection: tensors of 1 and 2 dimensions for the decay rule."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, 16)
        self.pos = torch.nn.Embedding(CONTEXT, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x, y):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        logits = self.head(F.gelu(self.fc(self.ln(h))))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def batch(step: int, micro: int, worker: int = 0):
    """A deterministic batch of the worker's step and micro-batch (its own generator: no global RNG)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + worker)
    x = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g)
    return x, torch.roll(x, -1, 1)


def sub(world, n: int):
    """The first ``n`` ranks of ``world`` as a communicator (MPI.COMM_NULL elsewhere)."""
    return world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)


STEPS, ACCUM, CLIP, LR, MIN_LR, WARMUP, WD = 10, 2, 0.5, 3e-2, 3e-3, 3, 0.1


def torch_loop() -> torch.Tensor:
    """The reference: nanoGPT's loop in one process (AdamW with decay on 2-D tensors only, warm-up
    and cosine to min_lr, accumulation over 2 micro-batches, clipping)."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW([
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=LR)
    schedule = make_schedule("cosine", horizon=STEPS, warmup=WARMUP, floor=MIN_LR / LR)
    for it in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = LR * schedule(it)
        for micro in range(ACCUM):
            (model(*batch(it, micro)) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def hpcps_loop(comm, out, **options):
    """The same loop on the step API: the optimizer on the servers, the rest unchanged."""
    ps = hpcps.init(TinyLM, device="cpu", optimizer="adamw", lr=LR, lr_schedule="cosine", warmup_steps=WARMUP, min_lr=MIN_LR,
                    param_groups=lambda m: hpcps.decay_groups(m, WD), paradigm="bsp", steps=STEPS, out=str(out),
                    progress=False, exit_on_error=False, comm=comm, **options)
    with ps:
        while ps.running:
            for micro in range(ACCUM):
                loss = ps.model(*batch(ps.iteration, micro, ps.worker_index)) / ACCUM
                loss.backward()
            torch.nn.utils.clip_grad_norm_(ps.model.parameters(), CLIP)
            ps.step(loss)
            ps.optimizer.zero_grad()  # set_to_none in torch: hpcps keeps the flat buffer
    return ps


@pytest.mark.parametrize("servers,partition_mb", [(1, 0.0), (3, 0.0), (3, 0.0005)])
def test_one_worker_bsp_on_the_step_api_is_the_plain_torch_loop(world, mpi_tmp_path, servers, partition_mb):
    """(With ``partition_mb``: 512-byte partitions, the loop's forward passes starting before the pull is in.)"""
    comm = sub(world, servers + 1)
    facts = None
    if comm != MPI.COMM_NULL:
        ps = hpcps_loop(comm, mpi_tmp_path / f"step-{servers}-{partition_mb}.h5", servers=servers,
                        partition_mb=partition_mb)
        if comm.rank == 0:
            ref = torch_loop()
            got = torch.from_numpy(ps.result.params[:len(ref)])
            with h5py.File(ps.result.path) as f:
                it = f["workers/iterations"][()]
            facts = {"err": float((got - ref).abs().max()), "moved": float((ref - torch_loop_start()).abs().max()),
                     "rows": len(it), "lr": it["lr"].tolist(),
                     "expected_lr": [LR * make_schedule("cosine", horizon=STEPS, warmup=WARMUP,
                                                        floor=MIN_LR / LR)(v) for v in it["version"]]}
        comm.Free()
    facts = share(world, facts)
    assert facts["moved"] > 1e-2  # the run really trained
    assert facts["err"] < 1e-5, facts["err"]
    assert facts["rows"] == STEPS
    assert np.allclose(facts["lr"], facts["expected_lr"], rtol=1e-12, atol=0)  # the lr column: rates applied


def torch_loop_start() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.cat([p.detach().reshape(-1) for p in TinyLM().parameters()])


@pytest.mark.parametrize("unscale_first", [True, False])
def test_a_grad_scaler_skips_on_the_servers_exactly_the_steps_it_skips_in_torch(world, mpi_tmp_path, unscale_first):
    """fp16 autocast, a GradScaler starting far too high: its first steps find Inf and are skipped. Through
    ``ps.optimizer`` they are pushed as skipped (reason 2 on the server, never applied). Without
    ``unscale_`` first, the scaler hands ``ps.optimizer`` the scale and it unscales."""
    steps, scale = 12, 2.0 ** 30

    def run_torch() -> tuple[torch.Tensor, int]:
        torch.manual_seed(0)
        model = TinyLM()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        scaler, skipped = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=3), 0
        for it in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(*batch(it, 0))
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
            opt.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), skipped

    comm = sub(world, 2)
    facts = None
    if comm != MPI.COMM_NULL:
        ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=0.5, paradigm="bsp", steps=steps, progress=False,
                        out=str(mpi_tmp_path / f"amp-{unscale_first}.h5"), exit_on_error=False, comm=comm)
        seen = []
        with ps:
            scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=3)
            while ps.running:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = ps.model(*batch(ps.iteration, 0))
                seen.append(float(loss))
                scaler.scale(loss).backward()
                if unscale_first:
                    scaler.unscale_(ps.optimizer)
                if unscale_first:  # the loss named, through the scaler to the row
                    scaler.step(ps.optimizer, loss=loss)
                else:  # as a DDP script has it: the row's loss is what backward ran from, less the scale
                    scaler.step(ps.optimizer)
                scaler.update()
        seen = comm.bcast(seen, root=1)
        if comm.rank == 0:
            ref, skipped = run_torch()
            with h5py.File(ps.result.path) as f:
                up = f["servers/updates"][()]
                losses = f["workers/iterations"]["loss"]
            got = torch.from_numpy(ps.result.params[:len(ref)])
            facts = {"skipped": skipped, "reason2": int((up["reason"] == 2).sum()),
                     "applied": int(up["applied"].sum()), "err": float((got - ref).abs().max()),
                     "losses": (len(losses), int(np.isfinite(losses).sum())),
                     "loss_err": float(np.abs(np.asarray(losses, np.float64) - np.asarray(seen)).max())}
        comm.Free()
    facts = share(world, facts)
    assert 0 < facts["skipped"] < steps  # the scaler skipped some steps and took others
    assert facts["reason2"] == facts["skipped"] and facts["applied"] == steps - facts["skipped"]
    assert facts["err"] < 1e-5, facts["err"]
    assert facts["losses"] == (steps, steps)  # every row's loss, named or not
    assert facts["loss_err"] < 1e-6, facts["loss_err"]  # the loss itself, not the scaled one (2**30 times it)


def test_every_worker_draws_its_own_random_stream(world, mpi_tmp_path):
    """After the model is built (from ``seed`` on every rank), worker i's torch stream is ``seed + 1 + i``."""
    ps = hpcps.init(TinyLM, device="cpu", paradigm="asp", steps=1, seed=7, progress=False, out=str(mpi_tmp_path / "rng.h5"),
                    exit_on_error=False, comm=world)
    draws = None
    with ps:
        if ps.is_worker:
            draws = (ps.worker_index, torch.rand(4).tolist())
            ps.model(*batch(0, 0)).backward()
            ps.step()
    got = dict(d for d in world.allgather(draws) if d is not None)
    assert len(got) == 4
    assert len({tuple(v) for v in got.values()}) == 4
    for i, values in got.items():
        assert values == torch.rand(4, generator=torch.Generator().manual_seed(7 + 1 + i)).tolist()


def test_the_run_file_records_a_factorys_optimizer_and_the_rates_it_applied(world, mpi_tmp_path):
    comm = sub(world, 2)
    facts = None
    if comm != MPI.COMM_NULL:
        ps = hpcps.init(TinyLM, device="cpu", optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-4, weight_decay=0.05),
                        lr_schedule=lambda v: 0.5 ** (v // 4), paradigm="bsp", steps=9, progress=False,
                        out=str(mpi_tmp_path / "ran.h5"), exit_on_error=False, comm=comm)
        with ps:
            while ps.running:
                ps.model(*batch(ps.iteration, 0)).backward()
                ps.step()
        if comm.rank == 0:
            with h5py.File(ps.result.path) as f:
                it = f["workers/iterations"][()]
                opt = json.loads(f.attrs["optimizer"])
                samples = json.loads(f.attrs["lr_schedule_values"])
            facts = {"class": opt["class"], "lr": opt["defaults"]["lr"], "wd": opt["defaults"]["weight_decay"],
                     "lr_column": it["lr"].tolist(), "expected": [3e-4 * 0.5 ** (v // 4) for v in it["version"]],
                     "samples": samples}
        comm.Free()
    facts = share(world, facts)
    assert facts["class"] == "torch.optim.adamw.AdamW" and facts["lr"] == 3e-4 and facts["wd"] == 0.05
    assert facts["lr_column"] == facts["expected"]
    assert [0, 1.0] in facts["samples"] and [9, 0.25] in facts["samples"]  # versions 0..9 of 9 steps


def _loop(ps, fields: dict | None = None):
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0)).backward()
            ps.state["iter_num"] = ps.iteration + 1  # the loop's own fields, as they will be after this step
            ps.state["best"] = min(ps.state.get("best", math.inf), float(ps.iteration))
            ps.log(twice=2.0 * ps.iteration)
            ps.step()
    return ps


def test_the_loops_own_fields_come_back_on_resume_and_another_optimizer_is_refused(world, mpi_tmp_path):
    comm = sub(world, 2)
    facts = None
    if comm != MPI.COMM_NULL:
        common = dict(paradigm="bsp", steps=8, progress=False, exit_on_error=False, comm=comm,
                      checkpoint_every=4, checkpoint_dir=str(mpi_tmp_path / "ckpt"))
        factory = lambda groups: torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.0)  # noqa: E731
        first = _loop(hpcps.init(TinyLM, device="cpu", optimizer=factory, out=str(mpi_tmp_path / "a.h5"), **common))
        path = str(mpi_tmp_path / "ckpt" / "step-000004.h5")
        common.update(steps=8, resume=path)
        # the built-in adamw at the same rate is the same optimizer: accepted
        second = hpcps.init(TinyLM, device="cpu", optimizer="adamw", lr=1e-3, out=str(mpi_tmp_path / "b.h5"), **common)
        resumed = (dict(second.state), second.iteration) if second.is_worker else None
        _loop(second)
        refusals = []
        for other in (dict(optimizer="adamw", lr=1e-3, lr_schedule=lambda v: 50.0),
                      dict(optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3))):
            try:
                hpcps.init(TinyLM, device="cpu", out=str(mpi_tmp_path / "c.h5"), **other, **common)
            except UserError as exc:
                refusals.append(str(exc))
        gathered = comm.gather(resumed)
        resumed = comm.bcast(gathered[1] if comm.rank == 0 else None)
        if comm.rank == 0:
            with h5py.File(first.result.path) as f:
                scalars = f["workers/scalars"][()]
            facts = {"resumed": resumed, "refusals": refusals,
                     "scalars": sorted((int(s["step"]), float(s["value"])) for s in scalars)}
        comm.Free()
    facts = share(world, facts)
    state, iteration = facts["resumed"]
    assert iteration == 4 and state == {"iter_num": 4, "best": 0.0}
    assert facts["scalars"] == [(k, 2.0 * k) for k in range(8)]
    assert "schedule differs: x50 here but x1 in the checkpoint at version 0" in facts["refusals"][0]
    assert "the optimizer's weight_decay is 0.01 here but 0.0 in the checkpoint" in facts["refusals"][1]


@pytest.mark.timeout(120)
def test_evaluation_every_n_versions_and_a_stop_on_the_loss(world, mpi_tmp_path):
    """hpcps.train under bsp with ``eval_every=5``: every evaluation but the final one is 5 or more versions
    after the last; ``target="loss<=X"`` stops the run at the first evaluation at or below X, and none but the
    final one follows it (while the stop reaches the workers, versions go on: under Intel MPI another
    periodic evaluation slipped in before they stopped)."""
    data = torch.utils.data.TensorDataset(torch.randn(400, 4), torch.zeros(400, 2))

    def net():
        torch.manual_seed(3)
        return torch.nn.Linear(4, 2)

    result = hpcps.train(model=net, data=data, loss="mse", paradigm="bsp", steps=200, lr=0.05, eval_every=5,
                         target="loss<=0.001", out=str(mpi_tmp_path / "every.h5"), progress=False,
                         exit_on_error=False, comm=world)
    facts = None
    if world.rank == 0:
        with h5py.File(result.path) as f:
            ev, it = f["eval"][()], f["workers/iterations"][()]
            summary = dict(f["summary"].attrs)
        facts = {"gaps": np.diff(ev["version"][:-1]).tolist(),
                 "rows": len(it), "first_hit": int(np.argmax(ev["loss"] <= 1e-3)), "n_eval": len(ev),
                 "t_target": float(summary["time_to_target_s"]), "final_loss": float(summary["final_loss"])}
    facts = share(world, facts)
    assert facts["gaps"] and min(facts["gaps"]) >= 5
    assert facts["rows"] < 4 * 200  # stopped before the last step
    assert facts["first_hit"] == facts["n_eval"] - 2  # the stop came at the first evaluation that met it
    assert facts["t_target"] == facts["t_target"] and facts["final_loss"] <= 1e-3


@pytest.mark.parametrize("paradigm,extra", [("bsp", {}), ("asp", {}), ("ssp", {}), ("dssp", {}), ("eager", {}),
                                            ("hsp", {}), ("grouped", {"groups": 2})])
def test_the_users_loop_runs_under_every_paradigm(world, mpi_tmp_path, paradigm, extra):
    """Every worker takes its ``steps`` steps through ``ps.step()``; every gradient is pushed once and
    applied once (grouped: the group servers' rows), and the iteration rows say which step each was."""
    steps = 12
    ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=0.05, paradigm=paradigm, steps=steps, progress=False,
                    out=str(mpi_tmp_path / f"{paradigm}.h5"), exit_on_error=False, comm=world, **extra)
    taken = 0
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            taken += 1
            ps.step()
    counts = world.allgather((ps.is_worker, taken))
    facts = None
    if world.rank == 0:
        with h5py.File(ps.result.path) as f:
            it, up = f["workers/iterations"][()], f["servers/updates"][()]
        workers = sorted(set(it["rank"].tolist()))
        facts = {"rows": len(it), "workers": len(workers), "applied": int(up[up["shard"] == 0]["applied"].sum()),
                 "steps": sorted(it[it["rank"] == workers[0]]["step"].tolist())}
    facts = share(world, facts)
    n_workers = sum(w for w, _ in counts)
    assert [t for w, t in counts if w] == [steps] * n_workers
    assert facts["workers"] == n_workers and facts["rows"] == steps * n_workers == facts["applied"]
    assert facts["steps"] == list(range(steps))


def test_a_stop_by_the_loop_says_so_writes_a_checkpoint_and_counts_its_steps(world, mpi_tmp_path, capsys):
    """``ps.stop("plateau")`` at step 5 of 12: ``stopped_by`` names the loop and its reason, a checkpoint to
    resume from is written as for a signal, and the end line says how many of the planned steps ran."""
    steps = 12
    ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=0.05, paradigm="bsp", steps=steps, progress=False,
                    out=str(mpi_tmp_path / "stop.h5"), exit_on_error=False, comm=world)
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            if ps.iteration == 5 and ps.worker_index == 0:
                ps.stop("plateau")
            ps.step()
    facts = None
    if world.rank == 0:
        with h5py.File(ps.result.path) as f:
            summary, it = dict(f["summary"].attrs), f["workers/iterations"][()]
        facts = {"stopped_by": str(summary["stopped_by"]), "checkpoint": str(summary["checkpoint"]),
                 "reached": int(it["step"].max()) + 1,
                 "lines": [line for line in capsys.readouterr().err.splitlines() if "INFO: done in" in line]}
        facts["exists"] = bool(facts["checkpoint"]) and os.path.exists(facts["checkpoint"])
    facts = share(world, facts)
    assert facts["stopped_by"] == "loop: plateau"
    assert facts["exists"], facts
    assert 6 <= facts["reached"] < steps  # the step it was asked at, and at most the one under way after it
    assert len(facts["lines"]) == 1 and f"after {facts['reached']} of {steps} steps" in facts["lines"][0], facts


@pytest.mark.parametrize("threads", [None, 3])
def test_the_loops_torch_thread_count_is_kept_or_changed_with_a_line_saying_so(world, mpi_tmp_path, capsys, threads):
    """The script set 3 torch threads: ``threads=3`` keeps them silently; without it the run's default (1)
    replaces them, and rank 0 says so."""
    torch.set_num_threads(3)
    options = {} if threads is None else {"threads": threads}
    ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=0.05, paradigm="bsp", steps=2, progress=False,
                    out=str(mpi_tmp_path / "threads.h5"), exit_on_error=False, comm=world, **options)
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            ps.step()
    now = torch.get_num_threads()
    torch.set_num_threads(1)
    said = [line for line in capsys.readouterr().err.splitlines() if "torch threads per rank" in line]
    facts = share(world, said if world.rank == 0 else None)
    assert now == (threads or 1)
    if threads is None:
        assert len(facts) == 1 and "torch threads per rank: 1, not 3" in facts[0], facts
    else:
        assert facts == []


def test_steps_may_follow_from_the_worker_count(world, mpi_tmp_path):
    """``steps=lambda n: ...``: 2 shards leave 3 workers, each takes 24 // 3 steps; a function that returns
    no positive whole number ends every rank with one line naming it."""
    ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=0.05, paradigm="asp", servers=2, steps=lambda n: 24 // n,
                    progress=False, out=str(mpi_tmp_path / "steps.h5"), exit_on_error=False, comm=world)
    taken = 0
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            ps.step()
            taken += 1
    counts = world.allgather(taken if ps.is_worker else None)
    assert [c for c in counts if c is not None] == [8, 8, 8]
    with pytest.raises(UserError, match=r"steps: the function of the worker count returned 0.0 for 4 workers"):
        hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=0.05, paradigm="bsp", steps=lambda n: 0.0, progress=False,
                   out=str(mpi_tmp_path / "bad.h5"), exit_on_error=False, comm=world)


def test_reseed_false_keeps_the_scripts_stream_and_says_when_every_worker_draws_alike(world, mpi_tmp_path, capsys):
    """With ``reseed=False`` a worker's torch stream after ``init`` continues from the model's build (the factory
    after ``torch.manual_seed(seed)``), as the single-process script's does; every rank seeded alike, every
    worker draws alike, and rank 0 says so once. A step whose loss is unknown is said once, by worker 0."""
    ps = hpcps.init(TinyLM, device="cpu", paradigm="asp", steps=1, seed=7, progress=False, reseed=False,
                    out=str(mpi_tmp_path / "rng.h5"), exit_on_error=False, comm=world)
    draws = None
    with ps:
        if ps.is_worker:
            draws = torch.rand(4).tolist()
            ps.model(*batch(0, 0)).expand(2).backward(torch.full((2,), 0.5))  # from a non-scalar: no loss known
            ps.step()
    got = [d for d in world.allgather(draws) if d is not None]
    torch.manual_seed(7)
    TinyLM()
    assert got == [torch.rand(4).tolist()] * 4  # the single process's next draw, on every worker
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if "WARNING: reseed=False" in line]
    assert len(said) == (1 if world.rank == 0 else 0), said
    # (and a step whose loss is unknown, its backward from a non-scalar: worker 0 says once that its row has none)
    no_loss = [line for line in err if "a step whose loss is unknown" in line]
    assert len(no_loss) == (1 if ps.is_worker and ps.worker_index == 0 else 0), no_loss


@pytest.mark.parametrize("options", [{"servers": 2}, {"servers": 2, "placement": "rank"}, {"servers": 1, "groups": 1}])
def test_world_before_init_says_what_init_makes_of_this_rank(world, mpi_tmp_path, options):
    """hpcps.world() with init's options: the worker count, this rank's role and worker index, as the session
    init then returns has them (the run's own placement of the ranks included)."""
    paradigm = "grouped" if "groups" in options else "asp"
    where = hpcps.world(exit_on_error=False, comm=world, paradigm=paradigm, **options)
    ps = hpcps.init(TinyLM, device="cpu", paradigm=paradigm, steps=1, progress=False, exit_on_error=False,
                    comm=world, out=str(mpi_tmp_path / "world.h5"), **options)
    with ps:
        if ps.is_worker:
            ps.model(*batch(0, 0)).backward()
            ps.step()
    assert (where.n_workers, where.worker_index, where.is_worker) == (ps.n_workers, ps.worker_index, ps.is_worker)
    assert not ps.stopped  # (the steps ran out: nobody stopped it)
    roles = world.allgather(where.role)
    n_servers, groups = options["servers"], options.get("groups", 0)
    assert sorted(roles) == sorted(["server"] * n_servers + ["group"] * groups + ["worker"] * where.n_workers)
    assert where.n_workers == world.size - n_servers - groups and where.size == world.size


@pytest.mark.parametrize("paradigm", ["bsp", "asp"])
def test_a_loop_that_resumes_itself_goes_on_at_its_iteration_and_keeps_the_earlier_run_file(world, mpi_tmp_path,
                                                                                             paradigm):
    """nanoGPT's own resume: the model from its checkpoint, ``ps.optimizer.load_state_dict`` of its saved state,
    ``start_iteration=iter_num``. Before, the versions began at 0 again (eval rows of iterations 100/150/200 filed
    at versions 0/50/100) and the same ``out`` was overwritten without a word. Now the shards start where the
    first run ended (bsp: k; asp: k x workers), the iterations go on at k, a schedule of the version goes on; under
    bsp the parameters end where the uninterrupted run's do (to 1e-6), and the first run's file is kept beside
    (``.1.h5``)."""
    total, k = 8, 4
    common = dict(device="cpu", optimizer="sgd", lr=0.1, momentum=0.9, lr_schedule=lambda version: 1 - version / 64,
                  paradigm=paradigm, progress=False, exit_on_error=False, comm=world)
    out = str(mpi_tmp_path / f"own-{paradigm}.h5")

    def loop(ps):
        saved = None
        with ps:
            while ps.running:
                ps.optimizer.zero_grad()
                ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
                ps.step()
            if ps.is_worker:
                saved = ps.optimizer.state_dict()  # the loop's checkpoint, as nanoGPT saves it
        return ps, saved

    whole, _ = loop(hpcps.init(TinyLM, out=str(mpi_tmp_path / f"whole-{paradigm}.h5"), steps=total, **common))
    first, saved = loop(hpcps.init(TinyLM, out=out, steps=k, **common))  # the job's time ran out at k
    flat = world.bcast(first.result.params if world.rank == 0 else None, root=0)

    def from_checkpoint() -> TinyLM:
        model = TinyLM()
        torch.nn.utils.vector_to_parameters(torch.from_numpy(flat[:sum(p.numel() for p in model.parameters())]),
                                            model.parameters())
        return model

    ps = hpcps.init(from_checkpoint, out=out, steps=total, start_iteration=k, **common)
    starts = None
    if ps.is_worker:
        ps.optimizer.load_state_dict(saved)
        starts = ps.iteration
    resumed, _ = loop(ps)
    assert [s for s in world.allgather(starts) if s is not None] == [k] * 4
    if world.rank == 0:
        n = 1 if paradigm == "bsp" else 4
        with h5py.File(out) as f, h5py.File(whole.result.path) as w:
            assert (f.attrs["start_iteration"], f.attrs["start_version"]) == (k, k * n)
            assert sorted(set(f["workers/iterations"]["step"].tolist())) == list(range(k, total))
            updates = f["servers/updates"][()]
            assert int(updates["version"].min()) == k * n
            if paradigm == "bsp":  # (asp's rate also has the gradient's staleness in it: lr_scaling)
                rate = {int(u["version"]): float(u["lr"]) for u in w["servers/updates"][()]}
                assert all(math.isclose(float(u["lr"]), rate[int(u["version"])]) for u in updates)
        with h5py.File(str(mpi_tmp_path / f"own-{paradigm}.1.h5")) as f:  # the first run's, kept
            assert sorted(set(f["workers/iterations"]["step"].tolist())) == list(range(k))
        if paradigm == "bsp":
            assert np.abs(resumed.result.params - whole.result.params).max() < 1e-6


@pytest.mark.parametrize("pull", ["get", "send"])
def test_a_stop_under_bsp_ends_every_worker_at_the_same_round_and_applies_no_partial_round(world, mpi_tmp_path, pull):
    """Before, ``ps.stop()`` raised every shard's stop flag at once: a worker that had pulled before it took one
    more step, one that pulled after took none, and the shard applied the round's last gradients as a round of
    their own (seen: version 3 applied with 1 of 4 gradients). Now a stop asked for under a paradigm of rounds
    goes up with the shards' next publish: every worker ends at the same iteration, every version applied is a
    whole round. Each worker of the first two asks in turn, at its own iteration 3, three runs each."""
    for asker in (0, 1):
        for attempt in range(3):
            ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=0.05, paradigm="bsp", servers=2, steps=40,
                            pull=pull, progress=False, exit_on_error=False, comm=world,
                            out=str(mpi_tmp_path / f"stop-{pull}-{asker}-{attempt}.h5"))
            with ps:
                while ps.running:
                    ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
                    ps.step()
                    if ps.worker_index == asker and ps.iteration == 3:
                        ps.stop("enough")
            ended = world.allgather((ps.iteration, ps.stopped) if ps.is_worker else None)
            assert len({e for e in ended if e is not None}) == 1 and ended[-1][1], ended  # (stopped, all of them)
            if world.rank == 0:
                with h5py.File(ps.result.path) as f:
                    up = f["servers/updates"][()]
                for shard in (0, 1):
                    mine = up[up["shard"] == shard]
                    per_version = np.bincount(mine["version"][mine["applied"] == 1])
                    assert (per_version == ps.n_workers).all(), per_version


def test_no_fused_runs_the_users_plain_torch_optimizer_to_the_last_bit(world, mpi_tmp_path):
    """The built-in adamw takes torch's fused kernel by default (faster; a few ulp from the for-loop kernel). A
    DDP script's plain ``torch.optim.AdamW(model.parameters())`` runs the default kernel: ``fused=False`` is it,
    and one worker under bsp ends on the single-process loop's parameters exactly (and says which kernel ran)."""
    steps = 6
    comm = sub(world, 2)
    facts = None
    if comm != MPI.COMM_NULL:
        ps = hpcps.init(TinyLM, device="cpu", optimizer="adamw", lr=3e-3, weight_decay=0.01, fused=False,
                        paradigm="bsp", steps=steps, progress=False, out=str(mpi_tmp_path / "plain.h5"),
                        exit_on_error=False, comm=comm)
        with ps:
            while ps.running:
                ps.optimizer.zero_grad()
                ps.model(*batch(ps.iteration, 0)).backward()
                ps.optimizer.step()
        if comm.rank == 0:
            torch.manual_seed(0)
            model = TinyLM()
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
            for it in range(steps):
                opt.zero_grad()
                model(*batch(it, 0)).backward()
                opt.step()
            want = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            got = torch.from_numpy(ps.result.params[:len(want)])
            with h5py.File(ps.result.path) as f:
                ran = json.loads(f.attrs["optimizer"])
            facts = {"equal": bool(torch.equal(got, want)), "err": float((got - want).abs().max()),
                     "fused": ran["defaults"].get("fused")}
        comm.Free()
    facts = share(world, facts)
    assert facts["equal"], facts
    assert not facts["fused"]


def test_a_model_the_script_built_starts_the_run_from_rank_0s_parameters_and_leaves_the_stream(world, mpi_tmp_path):
    """``hpcps.init(model)``, as ``DDP(model)``: every rank built its own (seeded by its rank, as nanoGPT seeds
    1337 + rank); the run starts from rank 0's, and torch's stream is where the script left it."""
    torch.manual_seed(100 + world.rank)
    model = TinyLM()
    start = world.bcast(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]), root=0)
    after_build = torch.get_rng_state()
    ps = hpcps.init(model, device="cpu", paradigm="bsp", steps=1, reseed=False, progress=False, exit_on_error=False,
                    comm=world, out=str(mpi_tmp_path / "given.h5"))
    facts = None
    with ps:
        if ps.is_worker:
            facts = (bool(torch.equal(torch.get_rng_state(), after_build)),
                     bool(torch.equal(torch.cat([p.detach().reshape(-1) for p in ps.model.parameters()]), start)))
            ps.model(*batch(0, 0)).backward()
            ps.step()
    assert [f for f in world.allgather(facts) if f is not None] == [(True, True)] * (world.size - 1)
