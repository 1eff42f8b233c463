"""End-to-end facts of BSP, ASP and SSP on 1 server + 4 workers (mpiexec -n 5)."""

import json
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from mpitest import clocks_at, force_transfer, share, train
from hpcps.runtime.checkpoints.files import read_checkpoint
from hpcps.data.sharding import batch_indices
from hpcps.data.loaders import load_dataset
from hpcps.training.flat import FlatParameters
from hpcps.training.lr import scaled_lr
from hpcps.training.optim import ShardOptimizer, builtin_optimizer
from hpcps.training.models import build_model
from hpcps.transport.poll import polite_barrier

pytestmark = pytest.mark.mpi(min_size=5)

WORKERS = [1, 2, 3, 4]


def _sgd_on_concatenated_batches(steps, batch_size, lr, seed, n_workers=4):
    """Single-process SGD where step k's batch is every worker's step-k batch together."""
    data = load_dataset("digits")
    model = build_model("mlp", data.in_shape, data.n_classes, seed=seed)
    flat = FlatParameters(model)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    for k in range(steps):
        idx = np.concatenate([batch_indices(len(y), batch_size=batch_size, n_workers=n_workers, worker=w, step=k,
                                            seed=seed) for w in range(n_workers)])
        flat.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        flat.params -= lr * flat.grads
    return flat.params


def test_bsp_equals_single_process_sgd_on_concatenated_batches(world, mpi_tmp_path):
    steps, batch, lr, seed = 15, 16, 0.2, 5
    result, t = train(mpi_tmp_path / "bsp.h5", paradigm="bsp", steps=steps, batch_size=batch, lr=lr, seed=seed)
    facts = None
    if world.rank == 0:
        reference = _sgd_on_concatenated_batches(steps, batch, lr, seed)
        up = t["servers/updates"]
        facts = {
            "max_diff": float(np.abs(result.params - reference).max()),
            "moved": float(np.abs(reference - _sgd_on_concatenated_batches(0, batch, lr, seed)).max()),
            "staleness": (int(np.abs(up["staleness"]).max()), int(np.abs(t["workers/iterations"]["staleness"]).max())),
            "round_versions": sorted(set(zip(up["worker_clock"].tolist(), up["version"].tolist()))),
        }
    facts = share(world, facts)
    assert facts["moved"] > 1e-2, "the reference did not train: the comparison would be empty"
    assert facts["max_diff"] < 1e-5
    assert facts["staleness"] == (0, 0)
    # round k (clock k+1 of every worker) is applied as version k
    assert facts["round_versions"] == [(k + 1, k) for k in range(steps)]


def test_ssp_never_starts_more_than_s_ahead_of_the_slowest(world, mpi_tmp_path):
    s, steps = 2, 40
    _, t = train(mpi_tmp_path / "ssp.h5", paradigm="ssp", staleness=s, steps=steps, slowdown=["4=3"])
    facts = None
    if world.rank == 0:
        it, up = t["workers/iterations"], t["servers/updates"]
        gaps = []
        for row in it:
            clocks = clocks_at(up, int(row["version"]), WORKERS)
            gaps.append(int(row["step"]) - min(clocks.values()))
        fast = it[it["rank"] != 4]
        facts = {"max_gap": max(gaps), "fast_wait": float(fast["wait_s"].sum()), "rows": len(it)}
    facts = share(world, facts)
    assert facts["rows"] == 4 * steps
    assert facts["max_gap"] == s  # never more than s ahead, and the straggler made the bound bind
    assert facts["fast_wait"] > 0.0


def test_dssp_keeps_the_gap_and_thresholds_within_bounds(world, mpi_tmp_path):
    s_lo, s_hi, steps = 1, 4, 60
    _, t = train(mpi_tmp_path / "dssp.h5", paradigm="dssp", staleness=s_lo, staleness_max=s_hi, steps=steps,
                 slowdown=["4=3"])
    facts = None
    if world.rank == 0:
        it, up = t["workers/iterations"], t["servers/updates"]
        gaps = [int(row["step"]) - min(clocks_at(up, int(row["version"]), WORKERS).values()) for row in it]
        facts = {"max_gap": max(gaps), "thresholds": sorted(set(up["threshold"].tolist())),
                 "pushed": int(t["summary"]["gradients_pushed"]), "applied": int(t["summary"]["gradients_applied"])}
    facts = share(world, facts)
    print("dssp thresholds seen:", facts["thresholds"], "max gap:", facts["max_gap"])
    assert facts["max_gap"] <= s_hi
    assert facts["max_gap"] > s_lo  # the controller did let fast workers past s_lo
    assert all(s_lo <= th <= s_hi for th in facts["thresholds"])
    assert facts["pushed"] == facts["applied"] == 4 * steps


def test_asp_fast_workers_never_wait_for_the_straggler(world, mpi_tmp_path):
    steps = 40
    # an emulated 5 ms pass, so 3x slower is 15 ms whatever else the node is doing (a real pass of the
    # default MLP takes about 1 ms, within the noise of 5 ranks sharing 2 cores)
    # (on the CPU: four workers' passes on one shared GPU can take longer than 15 ms, which the premise excludes)
    _, t = train(mpi_tmp_path / "asp.h5", paradigm="asp", steps=steps, slowdown=["4=3"], compute_time=0.005,
                 device="cpu")
    facts = None
    if world.rank == 0:
        up = t["servers/updates"]
        order = up[np.argsort(up["version"])]
        straggler_clock_when_fast_done = []
        for w in (1, 2, 3):
            last = int(order["version"][(order["worker"] == w) & (order["worker_clock"] == steps)][0])
            straggler_clock_when_fast_done.append(clocks_at(up, last + 1, WORKERS)[4])
        # read-my-writes: each gradient is computed on a version that holds its worker's previous one
        # (applied at version v, which makes v + 1); that is all a worker waits for
        missed = []
        for w in WORKERS:
            mine = order[order["worker"] == w]
            mine = mine[np.argsort(mine["worker_clock"])]
            computed_on = mine["version"] - mine["staleness"]
            missed += [int(c) for c, on, prev in zip(mine["worker_clock"][1:], computed_on[1:], mine["version"][:-1])
                       if on < prev + 1]
        facts = {"missed": missed, "straggler": straggler_clock_when_fast_done}
    facts = share(world, facts)
    assert facts["missed"] == []
    # a 3x slower worker is far behind when the fast ones finish (SSP with s=2 would hold them at 2): no fast
    # worker waited for it
    assert all(c <= steps - 5 for c in facts["straggler"]), facts["straggler"]


@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("paradigm", ["bsp", "asp", "ssp", "dssp", "eager", "hsp"])
def test_nothing_lost(world, mpi_tmp_path, paradigm, servers):
    steps = 25
    _, t = train(mpi_tmp_path / f"{paradigm}{servers}.h5", paradigm=paradigm, servers=servers, steps=steps,
                 slowdown=["4=2"])
    facts = None
    if world.rank == 0:
        it, up, s = t["workers/iterations"], t["servers/updates"], t["summary"]
        workers = sorted(set(it["rank"].tolist()))
        per_shard = {sh: sorted(zip(up["worker"][up["shard"] == sh].tolist(),
                                    up["worker_clock"][up["shard"] == sh].tolist())) for sh in range(servers)}
        stale = {}
        for row in up:
            key = (int(row["worker"]), int(row["worker_clock"]))
            stale[key] = max(stale.get(key, -1), int(row["staleness"]))
        facts = {
            "counts": (int(s["gradients_pushed"]), int(s["gradients_applied"]), int(s["gradients_dropped"])),
            "per_shard": per_shard,
            "steps": {w: sorted(it["step"][it["rank"] == w].tolist()) for w in workers},
            "staleness_agrees": all(stale[(int(r["rank"]), int(r["step"]) + 1)] == int(r["staleness"]) for r in it),
            "versions": {sh: sorted(set(up["version"][up["shard"] == sh].tolist())) for sh in range(servers)},
            "n_servers": int(t["attrs"]["n_servers"]),
        }
    facts = share(world, facts)
    n_workers = 5 - servers
    expected = sorted((w, c) for w in range(servers, 5) for c in range(1, steps + 1))
    assert facts["counts"] == (n_workers * steps, n_workers * steps, 0)
    assert all(pairs == expected for pairs in facts["per_shard"].values())  # each gradient once per shard
    assert facts["steps"] == {w: list(range(steps)) for w in range(servers, 5)}
    assert facts["staleness_agrees"]
    if paradigm == "hsp":  # a round's update, or one extra gradient's: as many versions as updates
        assert all(v == list(range(len(v))) for v in facts["versions"].values())
    else:
        n_versions = steps if paradigm == "bsp" else n_workers * steps
        assert all(v == list(range(n_versions)) for v in facts["versions"].values())
    assert facts["n_servers"] == servers


class _Kept(logging.Filter):
    """The hpcps log's lines on this rank (a filter on the logger: a run's set-up replaces its handlers)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.lines.append(record.getMessage())
        return True


@pytest.mark.parametrize("background", [True, False], ids=["background", "foreground"])
def test_target_accuracy_stops_early_and_loses_nothing(world, mpi_tmp_path, monkeypatch, background):
    """The flag rises when the evaluation that met the target is recorded. In the foreground shard 0 serves
    nothing meanwhile, so the run stops within two rounds of the version that evaluation read. In the
    background the rounds go on while it evaluates (a third round after it was seen once in the whole
    suite), so there only the early stop and the accounting are facts."""
    monkeypatch.setenv("HPCPS_EVAL_BACKGROUND", "1" if background else "0")
    said = _Kept()
    logging.getLogger("hpcps").addFilter(said)
    try:
        _, t = train(mpi_tmp_path / "target.h5", paradigm="bsp", steps=5000, target_accuracy=0.85, eval_interval=0.05)
    finally:
        logging.getLogger("hpcps").removeFilter(said)
    # hpcps's own loop evaluates on the servers: no worker says the target had no effect (one did, wrongly)
    assert world.allreduce(sum("had no effect" in line for line in said.lines), op=MPI.SUM) == 0
    facts = None
    if world.rank == 0:
        s, ev = t["summary"], t["eval"]
        hit = ev[ev["accuracy"] >= 0.85][0]
        facts = {"pushed": int(s["gradients_pushed"]), "applied": int(s["gradients_applied"]),
                 "ttt": float(s["time_to_target_s"]), "first_hit": float(hit["t"]),
                 "rounds_after_hit": int(ev["version"][-1] - hit["version"])}
    facts = share(world, facts)
    assert facts["pushed"] < 4 * 5000 and facts["pushed"] == facts["applied"]
    assert facts["ttt"] == facts["first_hit"]
    # in-flight gradients are still applied (nothing lost), but BSP stops within two rounds of the flag:
    # the round under way when it rose, and one a worker may have pulled just before it
    assert facts["rounds_after_hit"] >= 0
    if not background:
        assert facts["rounds_after_hit"] <= 2


@pytest.mark.timeout(120)
def test_evaluations_every_n_versions_read_the_multiples_of_n_on_every_shard(world, mpi_tmp_path, monkeypatch):
    """bsp on two shards, --eval-every 3, evaluations in shard 0's loop: each periodic evaluation reads
    version 3, 6, 9, ... on both shards. It starts once both have published it, and a shard that has gone
    on since is read out of its slot (shard 0 publishes nothing while it evaluates, so shard 1 is at most a
    round ahead). An evaluation that started as shard 0 published 3k read 3k - 1 wherever shard 1 had not
    published yet: a version off the grid, run by run. (In a helper thread, the default, the read waits for
    the thread's start, up to two rounds, 50 ms of compute each here.)"""
    monkeypatch.setenv("HPCPS_EVAL_BACKGROUND", "0")
    _, t = train(mpi_tmp_path / "every.h5", paradigm="bsp", servers=2, steps=30, eval_every=3, compute_time=0.05)
    versions = share(world, t["eval"]["version"].tolist() if world.rank == 0 else None)
    periodic, final = versions[:-1], versions[-1]
    assert final == 30 and len(periodic) >= 9, versions
    assert periodic == list(range(3, 3 * len(periodic) + 1, 3)), versions


def test_compute_time_model_sets_each_workers_iteration_time(world, mpi_tmp_path):
    mean, steps = 0.004, 12
    _, t = train(mpi_tmp_path / "emu.h5", paradigm="asp", steps=steps, compute_time=mean, slowdown=["4=2.5"])
    facts = None
    if world.rank == 0:
        it = t["workers/iterations"]
        facts = {int(r): float(it["compute_s"][it["rank"] == r].min()) for r in WORKERS}
        facts["applied"] = int(t["summary"]["gradients_applied"])
    facts = share(world, facts)
    assert all(facts[r] >= mean for r in (1, 2, 3))  # the sleep tops every real pass up to MEAN
    assert facts[4] >= 2.5 * mean  # ... times the worker's factor
    assert facts["applied"] == 4 * steps  # and the gradients are real and all applied



@pytest.mark.parametrize("paradigm,schedule,scaling", [("eager", "inverse", "auto"), ("asp", "sqrt", "auto"),
                                                        ("dssp", "exp", "none")])
def test_learning_rate_is_the_formula_of_the_known_staleness(world, mpi_tmp_path, paradigm, schedule, scaling):
    """Each gradient's rate is --lr x the paradigm's share (1/4 for 4 asynchronous workers under --lr-scaling
    auto, 1 under none) x the staleness factor; the worker's row records the rate its shard's receipt says
    it applied, the shard's row the same."""
    _, t = train(mpi_tmp_path / f"lr-{paradigm}.h5", paradigm=paradigm, steps=30, lr=0.2,
                 lr_staleness=schedule, slowdown=["4=2"], lr_scaling=scaling)
    base = 0.2 / 4 if scaling == "auto" else 0.2
    facts = None
    if world.rank == 0:
        it, up = t["workers/iterations"], t["servers/updates"]
        expected = [scaled_lr(schedule, base, int(s)) for s in it["lr_staleness"]]
        by_push = {(int(r["worker"]), int(r["worker_clock"])): float(r["lr"]) for r in up}
        recorded = np.array([by_push[int(r["rank"]), int(r["step"]) + 1] for r in it])
        facts = {"max_error": float(np.abs(it["lr"] / expected - 1).max()),
                 "server_error": float(np.abs(recorded / it["lr"] - 1).max()),
                 "known_le_server": bool((it["lr_staleness"] <= it["staleness"]).all()),
                 "scaled": int((it["lr"] < base).sum()), "rows": len(it)}
    facts = share(world, facts)
    assert facts["rows"] == 4 * 30 and facts["max_error"] < 1e-12  # the shard's arithmetic, to rounding
    assert facts["server_error"] == 0.0  # the worker's row: the rate shard 0's receipt says it applied
    assert facts["known_le_server"]  # what the worker knew is a lower bound of the staleness at apply
    assert facts["scaled"] > 0  # some gradients really were stale and scaled down


def test_eager_staleness_bound_holds_where_unbounded_eager_lags(world, mpi_tmp_path):
    """``--staleness 0``: every iteration starts on the newest version its worker knows of.

    The same job without the bound starts some iterations on parameters
    older than what the worker already knew of (its receipts and the
    helper's header reads move on after the take), so the bound is not
    vacuous.
    """
    facts = {}
    for bound in (0, None):
        _, t = train(mpi_tmp_path / f"eager-bound-{bound}.h5", paradigm="eager", steps=40, staleness=bound,
                     slowdown=["4=3"])
        if world.rank == 0:
            it = t["workers/iterations"]
            facts[bound] = {"lag": (int(it["lag"].min()), int(it["lag"].max())),
                            "applied": int(t["summary"]["gradients_applied"])}
    facts = share(world, facts)
    assert facts[0]["lag"] == (0, 0)
    assert facts[None]["lag"][0] == 0 and facts[None]["lag"][1] >= 1, facts
    assert facts[0]["applied"] == facts[None]["applied"] == 4 * 40


@pytest.mark.parametrize("transfer", ["shared", "direct"])
def test_single_eager_worker_matches_a_replay_of_its_own_record(world, mpi_tmp_path, monkeypatch, transfer):
    """One server + one eager worker: replay SGD from the recorded versions and learning rates.

    ``direct``: the worker pushes from torch tensors, as from GPU memory with a CUDA-aware MPI.
    """
    steps, batch, lr = 25, 16, 0.3
    if transfer != "shared":
        force_transfer(monkeypatch, transfer)
    pair = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)
    facts = None
    if pair != MPI.COMM_NULL:
        result, t = train(mpi_tmp_path / "eager1.h5", comm=pair, paradigm="eager", steps=steps, batch_size=batch,
                          lr=lr, seed=3, compute_time=0.002)
        if pair.rank == 0:
            it = np.sort(t["workers/iterations"], order="step")
            data = load_dataset("digits")
            model = build_model("mlp", data.in_shape, data.n_classes, seed=3)
            flat = FlatParameters(model)
            x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
            # each update as the shard makes it (its optimizer, the push's rate over the run's): a ReLU at its
            # kink turns a rounding apart into a gradient apart. Replayed as p - lr * g in numpy, 1.5e-8 apart at
            # version 4 made step 6's gradient 2e-3 apart (4 of 20 runs whose versions went 0, 0, 0, 0, 2, 4, 4)
            replay = torch.from_numpy(flat.params.copy())
            shard = ShardOptimizer(replay, builtin_optimizer("sgd", lr=lr), lambda version: 1.0)
            history = [replay.numpy().copy()]  # parameters by server version
            for row in it:
                flat.params[:] = history[int(row["version"])]
                idx = batch_indices(len(y), batch_size=batch, n_workers=1, worker=0, step=int(row["step"]), seed=3)
                flat.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                shard.step([flat.grads_t.clone()], [1.0], version=len(history) - 1, factor=float(row["lr"]) / lr)
                history.append(replay.numpy().copy())
            facts = {"max_diff": float(np.abs(result.params - history[-1]).max()),
                     "ahead": int((it["version"] > it["step"]).sum()),
                     "backwards": int((np.diff(it["version"]) < 0).sum()),
                     "lr_ok": bool(np.all(it["lr"] == lr / (1 + it["lr_staleness"])))}
        pair.Free()
    polite_barrier(world)
    facts = world.bcast(facts, root=0)
    assert facts["lr_ok"]
    # one worker: version k needs k applied gradients, so a step never runs ahead of its own
    # pushes, and the snapshots it takes never go back in time
    assert facts["ahead"] == 0 and facts["backwards"] == 0
    assert facts["max_diff"] < 1e-5


@pytest.mark.parametrize("paradigm", ["bsp", "asp"])
def test_nonfinite_gradient_is_dropped_with_a_reason_never_applied(world, mpi_tmp_path, paradigm):
    steps = 20
    result, t = train(mpi_tmp_path / f"nan-{paradigm}.h5", paradigm=paradigm, steps=steps, fault=["nan@2:5"])
    facts = None
    if world.rank == 0:
        up, it, s = t["servers/updates"], t["workers/iterations"], t["summary"]
        dropped = up[up["applied"] == 0]
        facts = {"dropped": [(int(r["worker"]), int(r["worker_clock"]), int(r["reason"])) for r in dropped],
                 "counts": (int(s["gradients_pushed"]), int(s["gradients_applied"]), int(s["gradients_dropped"])),
                 "worker_row": int(it["staleness"][(it["rank"] == 2) & (it["step"] == 5)][0]),
                 "versions": int(up["version"].max()) + 1, "finite": bool(np.isfinite(result.params).all())}
    facts = share(world, facts)
    assert facts["dropped"] == [(2, 6, 1)]  # worker rank 2's 6th gradient, reason 1: non-finite
    assert facts["counts"] == (4 * steps, 4 * steps - 1, 1)
    assert facts["worker_row"] == -1 and facts["finite"]
    # BSP still closes every round (averaging the three others); ASP loses that one version
    assert facts["versions"] == (steps if paradigm == "bsp" else 4 * steps - 1)


@pytest.mark.parametrize("servers,lr_staleness", [(1, "none"), (2, "none"), (1, "inverse")])
def test_bsp_resumed_from_a_checkpoint_ends_bit_for_bit_as_the_uninterrupted_run(world, mpi_tmp_path, servers,
                                                                                 lr_staleness):
    """Also with --lr-staleness inverse: the resumed shards publish the checkpoint's version from the
    start, so no resumed gradient looks stale (it did: version 0, and lr/21 for the first)."""
    ckdir = mpi_tmp_path / f"ck{servers}{lr_staleness}"
    common = dict(paradigm="bsp", steps=40, servers=servers, seed=4, checkpoint_every=20, checkpoint_dir=str(ckdir),
                  lr_staleness=lr_staleness)
    full, _ = train(mpi_tmp_path / f"full{servers}.h5", **common)
    resumed, t = train(mpi_tmp_path / f"resumed{servers}.h5", resume=str(ckdir / "step-000020.h5"),
                       **{**common, "checkpoint_dir": str(ckdir / "again")})
    facts = None
    if world.rank == 0:
        facts = {"equal": bool(np.array_equal(full.params, resumed.params)),
                 "moved": float(np.abs(full.params - read_checkpoint(str(ckdir / "step-000020.h5")).params).max()),
                 "steps": sorted(set(t["workers/iterations"]["step"].tolist())),
                 "pushed": int(t["summary"]["gradients_pushed"]),
                 "stale": sorted(set(t["workers/iterations"]["staleness"].tolist())
                                 | set(t["workers/iterations"]["lr_staleness"].tolist())),
                 "leftovers": sorted(p.name for p in ckdir.iterdir() if p.suffix == ".tmp")}
    facts = share(world, facts)
    assert facts["stale"] == [0]  # bsp's gradients are never stale, resumed or not
    assert facts["moved"] > 1e-3  # the second half did train
    assert facts["equal"]  # exactly, not approximately
    assert facts["steps"] == list(range(20, 40)) and facts["pushed"] == (5 - servers) * 20
    assert facts["leftovers"] == []  # written atomically



def test_grouped_with_one_group_equals_single_process_sgd(world, mpi_tmp_path):
    """G=1 is BSP: 1 central shard, 1 group server, 3 workers."""
    steps, batch, lr, seed = 12, 16, 0.2, 6
    result, t = train(mpi_tmp_path / "g1.h5", paradigm="grouped", groups=1, steps=steps, batch_size=batch, lr=lr,
                      seed=seed)
    facts = None
    if world.rank == 0:
        reference = _sgd_on_concatenated_batches(steps, batch, lr, seed, n_workers=3)
        g = t["groups/updates"]
        facts = {"max_diff": float(np.abs(result.params - reference).max()),
                 "central": (len(g), int(np.abs(g["staleness"]).max()), sorted(set(g["worker"].tolist()))),
                 "workers_stale": int(np.abs(t["servers/updates"]["staleness"]).max()),
                 "groups": t["attrs"]["groups"]}
    facts = share(world, facts)
    assert facts["max_diff"] < 1e-5
    assert facts["central"] == (steps, 0, [1])  # one update per round, from group server rank 1, never stale
    assert facts["workers_stale"] == 0 and facts["groups"] == '{"1": [2, 3, 4]}'


@pytest.mark.timeout(120)
def test_a_group_server_pushes_to_one_central_shard_at_a_time_under_shards_at_once(world, mpi_tmp_path,
                                                                                   monkeypatch):
    """--shards-at-once 1 under grouped (2 central shards, 1 group server, 2 workers): the group server's push
    to the central shards goes in a rotation too (it ignored the option), its round's receipts still come
    (each poll gives the next shard its turn), and the run ends bit for bit as with every shard at once (its
    pushes are the central shards' only ones), every gradient applied."""
    import hpcps.runtime.assembly as assembly

    made = []

    class Recording(assembly.Pusher):
        def __init__(self, comm, **kwargs):
            made.append((len(kwargs["shard_ranks"]), kwargs.get("fanout", 0), kwargs.get("first", 0)))
            super().__init__(comm, **kwargs)

    monkeypatch.setattr(assembly, "Pusher", Recording)
    common = dict(paradigm="grouped", servers=2, groups=1, steps=8, seed=3, lr=0.1)
    every, _ = train(mpi_tmp_path / "every.h5", **common)
    one, t = train(mpi_tmp_path / "one.h5", shards_at_once=1, **common)
    facts = world.gather(made, root=0)
    if world.rank == 0:
        s = t["summary"]
        facts = {"group server's pushers": facts[2], "same": bool(np.array_equal(every.params, one.params)),
                 "pushed": int(s["gradients_pushed"]), "applied": int(s["gradients_applied"])}
    facts = share(world, facts)
    assert facts["group server's pushers"] == [(2, 0, 0), (2, 1, 0)]  # to the 2 central shards: all, then 1
    assert facts["same"]
    assert facts["pushed"] == facts["applied"] == 2 * 8


def test_grouped_with_two_groups_loses_nothing(world, mpi_tmp_path):
    steps = 20
    _, t = train(mpi_tmp_path / "g2.h5", paradigm="grouped", groups=2, steps=steps, slowdown=["4=3"])
    facts = None
    if world.rank == 0:
        s, g, up = t["summary"], t["groups/updates"], t["servers/updates"]
        facts = {"counts": (int(s["gradients_pushed"]), int(s["gradients_applied"])),
                 "rounds": {int(w): sorted(g["worker_clock"][g["worker"] == w].tolist()) for w in (1, 2)},
                 "per_worker": sorted(zip(up["worker"].tolist(), up["worker_clock"].tolist())),
                 "central_versions": sorted(g["version"].tolist())}
    facts = share(world, facts)
    assert facts["counts"] == (2 * steps, 2 * steps)
    assert facts["rounds"] == {1: list(range(1, steps + 1)), 2: list(range(1, steps + 1))}
    assert facts["per_worker"] == sorted((w, c) for w in (3, 4) for c in range(1, steps + 1))
    assert facts["central_versions"] == list(range(2 * steps))  # every group update applied once, in turn


@pytest.mark.parametrize("max_stale", [1, 2])
def test_hsp_streams_one_gradient_at_a_time_into_each_shard(world, mpi_tmp_path, max_stale):
    """Two shards, a 3x straggler: transfers into a shard never overlap, each gradient streams in once,
    and the extra gradients (updates of one gradient) come at most ``max_stale`` per worker per round."""
    steps = 30
    _, t = train(mpi_tmp_path / f"hsp{max_stale}.h5", paradigm="hsp", servers=2, steps=steps,
                 hsp_max_stale=max_stale, slowdown=["4=3"])
    facts = None
    if world.rank == 0:
        tr, up = t["servers/transfers"], t["servers/updates"]
        overlaps, per_shard, longest = 0, {}, 0
        for shard in (0, 1):
            mine = np.sort(tr[tr["shard"] == shard], order="t_begin")
            overlaps += int((mine["t_begin"][1:] < mine["t_end"][:-1]).sum())
            per_shard[shard] = sorted(mine["worker"].tolist())
        it, first = t["workers/iterations"], up[up["shard"] == 0]
        size = {int(v): int((first["version"] == v).sum()) for v in np.unique(first["version"])}
        extras = []  # (worker rank, clock) of gradients computed on the parameters of the one before
        for w in (2, 3, 4):
            mine, run = np.sort(it[it["rank"] == w], order="step"), 0
            for prev, row in zip(mine[:-1], mine[1:]):
                run = run + 1 if prev["pull_s"] == 0.0 else 0  # no pull in between: an extra
                longest = max(longest, run)
                if run:
                    extras.append((w, int(row["step"]) + 1))
        applied = {(int(r["worker"]), int(r["worker_clock"])): r for r in first}
        extras_alone = all(size[int(applied[e]["version"])] == 1 for e in extras)
        extras_stale = all(int(applied[e]["staleness"]) >= 1 for e in extras)
        facts = {"overlaps": overlaps, "per_shard": per_shard, "longest": longest, "n_extras": len(extras),
                 "extras_alone": extras_alone, "extras_stale": extras_stale,
                 "applied": int(t["summary"]["gradients_applied"])}
    facts = share(world, facts)
    assert facts["overlaps"] == 0
    expected = sorted(w for w in (2, 3, 4) for _ in range(steps))
    assert facts["per_shard"] == {0: expected, 1: expected}  # every gradient streamed into each shard once
    assert facts["applied"] == 3 * steps
    assert 0 < facts["n_extras"] and facts["longest"] <= max_stale, facts
    assert facts["extras_alone"]  # applied on its own, not averaged into a round
    assert facts["extras_stale"]  # and read only after its round closed




def test_grouped_by_speed_pairs_each_group_server_with_workers_of_its_speed(world, mpi_tmp_path):
    """5 ranks, 2 groups of 1 worker: by rank, group server 1 gets worker 3; by speed (3 is 4x slower)
    the fastest group comes first, so group server 1 gets worker 4."""
    facts = {}
    for group_by in ("rank", "speed"):
        _, t = train(mpi_tmp_path / f"by-{group_by}.h5", paradigm="grouped", groups=2, group_by=group_by, steps=10,
                     slowdown=["3=4"], compute_time=0.003)
        if world.rank == 0:
            facts[group_by] = (json.loads(t["attrs"]["groups"]), int(t["summary"]["gradients_applied"]))
    facts = share(world, facts)
    assert facts["rank"] == ({"1": [3], "2": [4]}, 20)
    assert facts["speed"] == ({"1": [4], "2": [3]}, 20)

