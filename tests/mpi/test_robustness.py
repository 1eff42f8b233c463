"""Randomised robustness: many short seeded runs over paradigms, shard counts and slowdowns.

Every run must end (pytest-timeout turns a deadlock into a failure), lose
nothing, and keep its paradigm's bound (eager: its lag; hsp: one transfer
at a time). CI runs 12 configurations; a local soak runs more: HPCPS_SOAK_RUNS=200 mpiexec -n 5 python -m pytest --with-mpi tests/mpi/test_robustness.py
"""

import os
import random

import numpy as np
import pytest

from hpcps.cluster.layout import Layout
from mpitest import clocks_at, share, train

pytestmark = pytest.mark.mpi(min_size=5)

RUNS = int(os.environ.get("HPCPS_SOAK_RUNS", "12"))


def _configuration(rng: random.Random) -> dict:
    paradigm = rng.choice(["bsp", "asp", "ssp", "dssp", "eager", "hsp", "grouped"])
    servers = rng.choice([1, 1, 2])
    groups = rng.choice([1, 2]) if paradigm == "grouped" and servers == 1 else (1 if paradigm == "grouped" else 0)
    workers = range(servers + groups, 5)
    slow = rng.sample(list(workers), rng.randint(0, 2))
    cfg = {"paradigm": paradigm, "servers": servers, "groups": groups,
           "steps": rng.randint(5, 15), "seed": rng.randint(0, 99), "staleness": rng.randint(0, 3),
           "slowdown": [f"{w}={rng.choice([1.5, 2, 3])}" for w in slow], "batch_size": rng.choice([8, 16, 32])}
    if cfg["paradigm"] == "dssp":
        cfg["staleness_max"] = cfg["staleness"] + rng.randint(0, 3)
    if cfg["paradigm"] == "hsp":
        cfg["hsp_max_stale"] = rng.randint(0, 2)
    cfg["checkpoint_every"] = rng.choice([None, None, 3, 7])  # periodic checkpoints, now and then
    partition = rng.choice([0.0, 0.0, 0.004])  # partitioned pulls, now and then (not eager's: it pulls behind)
    cfg["partition_mb"] = 0.0 if paradigm == "eager" else partition
    if rng.random() < 0.3:  # emulated compute, part of it in the passes (pushes during backward overlap it)
        cfg.update(compute_time=0.002, compute_forward=rng.choice([0.0, 0.3]), compute_backward=rng.choice([0.0, 0.5]))
    return cfg


@pytest.mark.timeout(600)
def test_random_configurations_end_lose_nothing_and_keep_their_bounds(world, mpi_tmp_path):
    rng = random.Random(20261121)  # the same draws on every rank
    failures = []
    for i in range(RUNS):
        cfg = _configuration(rng)
        ckdir = mpi_tmp_path / f"r{i}-checkpoints"
        _, t = train(mpi_tmp_path / f"r{i}.h5", checkpoint_dir=str(ckdir), **cfg)
        problems = None
        if world.rank == 0:
            problems = _check(cfg, t) + _check_checkpoints(cfg, ckdir, t["servers/updates"])
        problems = share(world, problems)
        if problems:
            failures.append((cfg, problems))
    assert not failures, failures


def _check_checkpoints(cfg: dict, ckdir, updates: np.ndarray) -> list[str]:
    """Every periodic checkpoint is a consistent cut: each shard applied exactly the cut's gradients (the
    gradients it applied below its version are each worker's first ``clock``, one update per version; no
    gradient is dropped in these runs), bsp's and hsp's between rounds (every worker's last gradient in
    the cut in one update); grouped's central version is the groups' rounds."""
    from hpcps.runtime.checkpoints.files import read_checkpoint

    problems = []
    for path in sorted(ckdir.glob("step-*.h5")) if cfg.get("checkpoint_every") else ():
        c = read_checkpoint(str(path), complete=True)
        versions = [c.shard_version(s) for s in range(cfg["servers"])]
        if cfg["groups"]:  # a central version per group round: each group's rounds are its members' clock
            layout = Layout(5, cfg["servers"], cfg["groups"])
            expected = sum(int(c.worker_clocks[layout.worker_index(members[0])])
                           for members in layout.group_members())
            if versions != [expected] * cfg["servers"]:
                problems.append(f"{path.name}: shard versions {versions} for clocks {c.worker_clocks}")
            continue
        workers = range(cfg["servers"], 5)
        clocks = dict(zip(workers, c.worker_clocks.tolist()))
        cut = sorted((w, k) for w, n in clocks.items() for k in range(1, n + 1))
        for shard, version in enumerate(versions):
            mine = updates[updates["shard"] == shard]
            below = mine[mine["version"] < version]
            if sorted(zip(below["worker"].tolist(), below["worker_clock"].tolist())) != cut or \
                    len(set(below["version"].tolist())) != version:
                problems.append(f"{path.name}: shard {shard} at version {version} applied other gradients than "
                                f"the cut's, clocks {c.worker_clocks}")
            last = {int(mine["version"][(mine["worker"] == w) & (mine["worker_clock"] == k)][0])
                    for w, k in clocks.items() if k > 0 and k < cfg["steps"]}
            if cfg["paradigm"] in ("bsp", "hsp") and len(last) > 1:
                problems.append(f"{path.name}: shard {shard} cut inside a round (last updates {sorted(last)})")
    return problems


def _check(cfg: dict, t: dict) -> list[str]:
    it, up, s = t["workers/iterations"], t["servers/updates"], t["summary"]
    servers, steps = cfg["servers"], cfg["steps"]
    workers = list(range(servers + cfg["groups"], 5))
    problems = []
    if not (s["gradients_pushed"] == s["gradients_applied"] + s["gradients_dropped"] == len(workers) * steps):
        problems.append(f"counts {dict(s)}")
    expected = sorted((w, c) for w in workers for c in range(1, steps + 1))
    for shard in range(1 if cfg["groups"] else servers):  # group servers record every gradient as shard 0
        mine = up[up["shard"] == shard]
        if sorted(zip(mine["worker"].tolist(), mine["worker_clock"].tolist())) != expected:
            problems.append(f"shard {shard} did not record every gradient exactly once")
    bound = {"bsp": 0, "ssp": cfg["staleness"], "dssp": cfg.get("staleness_max")}.get(cfg["paradigm"])
    if cfg["groups"]:
        g = t["groups/updates"]
        if len(g) != servers * cfg["groups"] * steps:
            problems.append(f"{len(g)} group updates, expected {servers * cfg['groups'] * steps}")
    if bound is not None and servers == 1:
        gaps = [int(r["step"]) - min(clocks_at(up, int(r["version"]), workers).values()) for r in it]
        if max(gaps) > bound:
            problems.append(f"clock gap {max(gaps)} > bound {bound}")
    if cfg["paradigm"] == "eager" and it["lag"].max() > cfg["staleness"]:
        problems.append(f"eager lag {it['lag'].max()} > --staleness {cfg['staleness']}")
    if cfg["paradigm"] == "hsp":
        tr = t["servers/transfers"]
        for shard in range(servers):
            mine = np.sort(tr[tr["shard"] == shard], order="t_begin")
            if len(mine) != len(workers) * steps or (mine["t_begin"][1:] < mine["t_end"][:-1]).any():
                problems.append(f"shard {shard}: {len(mine)} transfers, or two overlapped")
    if cfg["paradigm"] == "bsp" and np.abs(up["staleness"]).max() != 0:
        problems.append("stale gradient under bsp")
    return problems
