"""Features combined, drawn by Hypothesis: paradigm x local steps x shards (reached all at once or one at a
time) x partitions x compression x periodic checkpoints x bsp's rounds sent or read (``--pull``), the loop
(hpcps's own or the user's, through hpcps.init), group servers, an injected NaN gradient and placement; each
run's file is checked for what holds across shards.

* a gradient is applied by every shard or by none;
* under local steps, a NaN the user's loop computes at one inner step is skipped once, and no round dropped;
* every shard records every gradient once, and pushed = applied + dropped, the dropped being exactly
  the gradients no shard applied (the injected NaN among them);
* ssp's and dssp's clock gap (from the shards' rows) and eager's lag stay within their bounds;
* in the user's own loop, the parameters read after ``ps.step()`` are those the next forward pass uses.

Every rank draws the same combinations (derandomized, no example database) and sees the same verdict
(rank 0's facts, shared), so the ranks run each combination together, shrinking included. An error on one
rank (in a run, or in the check on rank 0) is gathered and raised on every rank alike: raised on that rank
alone, it made Hypothesis replay the combination there while the others went on, and the ranks hung in
each other's collectives (seen twice, an ssp run of the user's loop whose error was never shown). CI runs the
fast profile; the soak runs more with shrinking:
``HPCPS_COMBINATIONS=200 mpiexec -n 5 python -m pytest --with-mpi tests/mpi/test_combinations_mpi.py``.
``HPCPS_COMBINATIONS_SEED=N`` draws another set than the fixed one (the same on every rank: the seed is
Hypothesis's, not derandomized; a soak repeated without it repeats its draws).
``HPCPS_COMBINATIONS_PARTITIONS=1`` partitions every run (``tools/soak.py`` runs the soak in each transport
cell with it). ``HPCPS_COMBINATIONS_SHOW=1`` prints each combination run, with its dropped gradients and torn steps. A
failure found is kept as an ``@example`` of the test: a named regression every run replays first (the
soak of 200 combinations that came with the test found none; a later one found a false alarm of the check's
own, once and not again on replay: a dropped gradient's clock counted late, mended in ``mpitest.clocks_at``).
"""

from __future__ import annotations

import os
import traceback

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, reject, seed, settings
from hypothesis import strategies as st
from mpi4py import MPI

import hpcps
from hpcps.options.planning import plan
from hpcps.options.config import make_config
from hpcps.data.sharding import batch_indices
from hpcps.data.loaders import load_dataset
from hpcps.errors import UserError
from mpitest import clocks_at, read_tables, share, train

pytestmark = pytest.mark.mpi(min_size=5)

SOAK = int(os.environ.get("HPCPS_COMBINATIONS", "0"))
#: every drawn run partitioned (``--partition-mb``; eager, which takes none, is not drawn): tools/soak.py's knob
PARTITIONED = os.environ.get("HPCPS_COMBINATIONS_PARTITIONS") == "1"
RUNS = SOAK or 10
#: another set of draws (every rank the same): tools/soak.py --seed; unset, the draws are derandomized (fixed)
SEED = os.environ.get("HPCPS_COMBINATIONS_SEED")
PHASES = (Phase.explicit, Phase.generate, Phase.shrink) if SOAK else (Phase.explicit, Phase.generate)
WORLD = 5


@st.composite
def combinations(draw) -> dict:
    paradigm = draw(st.sampled_from(["bsp", "asp", "ssp", "dssp", *([] if PARTITIONED else ["eager"]), "hsp", "grouped"]))
    servers = draw(st.sampled_from([1, 2]))
    groups = (draw(st.sampled_from([1, 2])) if servers == 1 else 1) if paradigm == "grouped" else 0
    steps = draw(st.integers(5, 9))
    cfg = {"paradigm": paradigm, "servers": servers, "groups": groups, "steps": steps,
           "seed": draw(st.integers(0, 99)), "batch_size": 16,
           "placement": draw(st.sampled_from(["spread", "rank"])),
           "compress": draw(st.sampled_from(["none", "bf16", "topk:0.3"])),
           "checkpoint_every": draw(st.sampled_from([None, 3])),
           "partition_mb": 0.0 if paradigm == "eager" else draw(st.sampled_from([0.004] if PARTITIONED else [0.0, 0.004])),
           "shards_at_once": draw(st.sampled_from([0, 1])),  # pushes and pulls one shard at a time
           "loop": draw(st.sampled_from(["builtin", "own"]))}
    if paradigm in ("ssp", "dssp", "eager"):
        cfg["staleness"] = draw(st.integers(0, 2))
    if paradigm == "dssp":
        cfg["staleness_max"] = cfg["staleness"] + draw(st.integers(0, 2))
    if paradigm in ("bsp", "asp", "ssp", "dssp"):  # the local-SGD family: a push per round of H batches
        cfg["local_steps"] = draw(st.sampled_from([None, None, 2, 3]))
        if cfg["local_steps"] is not None:  # the next round's first steps hide the outer step (or none)
            cfg["overlap_steps"] = draw(st.integers(0, cfg["local_steps"] - 1))
    if paradigm == "bsp":  # the shards send each round's parameters (fp32, to every worker at once), or not
        cfg["pull"] = draw(st.sampled_from(["get", "send"]))
        if cfg["pull"] == "send":
            cfg.update(shards_at_once=0, compress="none" if cfg["compress"] == "bf16" else cfg["compress"])
            if cfg.get("overlap_steps"):
                cfg["overlap_steps"] = 0
    rounds = _rounds(cfg)
    if cfg["loop"] == "own" and cfg.get("local_steps") and draw(st.booleans()):
        # one worker's loop computes a NaN gradient at one inner step: skipped by its inner optimizer, never pushed
        cfg["inner_nan"] = (draw(st.integers(servers + groups, WORLD - 1)), draw(st.integers(0, steps - 1)))
    elif draw(st.booleans()):  # one worker pushes a NaN gradient (pseudo-gradient) once
        worker = draw(st.integers(servers + groups, WORLD - 1))
        at = draw(st.integers(1, steps - 2)) if rounds == steps else draw(st.integers(0, rounds - 1))
        cfg["fault"] = [f"nan@{worker}:{at}"]
    return cfg


def _rounds(cfg: dict) -> int:
    """Pushes per worker: its steps, or its rounds of ``local_steps``."""
    every = cfg.get("local_steps")
    return cfg["steps"] if every is None else -(-cfg["steps"] // every)


def _own_loop(out, options: dict, comm, inner_nan: tuple[int, int] | None = None) -> int:
    """The user's own loop on the digits (hpcps.init), its batches where ``ps.device`` says (a GPU where
    one is visible): return how many steps read, after ``ps.step()``, parameters other than those the next
    forward pass used (on a worker; 0 elsewhere)."""
    data = load_dataset("digits")
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)

    def make():
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    batch = options.pop("batch_size")
    ps = hpcps.init(make, out=str(out), progress=False, exit_on_error=False, comm=comm, **options)
    torn = 0
    with ps:
        while ps.running:
            read = torch.cat([p.detach().flatten().clone() for p in ps.model.parameters()])
            idx = batch_indices(len(y), batch_size=batch, n_workers=ps.n_workers, worker=ps.worker_index,
                                step=ps.iteration, seed=options["seed"])
            loss = F.cross_entropy(ps.model(x[idx].to(ps.device)), y[idx].to(ps.device))
            torn += not torch.equal(read, torch.cat([p.detach().flatten() for p in ps.model.parameters()]))
            loss.backward()
            if inner_nan is not None and (ps.rank, ps.iteration) == tuple(inner_nan):
                next(ps.model.parameters()).grad.view(-1)[0] = float("nan")
            ps.step(loss)
    return torn


def _run(world, out, cfg: dict) -> tuple[dict | None, int]:
    """Run ``cfg``; rank 0's tables and the torn steps summed over the ranks."""
    options = {k: v for k, v in cfg.items() if k not in ("loop", "inner_nan") and v is not None}
    options["checkpoint_dir"] = str(out) + "-checkpoints"
    tables, torn, error = None, 0, None
    try:
        if cfg["loop"] == "builtin":
            _, tables = train(out, world, **options)
        else:
            torn = _own_loop(out, options, world, cfg.get("inner_nan"))
            if world.rank == 0:
                tables = read_tables(out)
    except Exception as exc:  # said on every rank below: one rank's error must not leave the others waiting
        error = f"rank {world.rank}: " + "".join(traceback.format_exception(exc)[-3:])
    errors = [e for e in world.allgather(error) if e is not None]
    if errors:
        raise AssertionError(f"{cfg}: " + "\n".join(errors))
    return tables, world.allreduce(torn, op=MPI.SUM)


def _checked(cfg: dict, t: dict) -> list[str]:
    """:func:`_problems`, or the error the check itself raised, as a problem (rank 0's, shared)."""
    try:
        return _problems(cfg, t)
    except Exception as exc:
        return [f"the check raised: {''.join(traceback.format_exception(exc)[-3:])}"]


def _problems(cfg: dict, t: dict) -> list[str]:
    """What does not hold across the shards of ``cfg``'s run file ``t``."""
    it, up, s = t["workers/iterations"], t["servers/updates"], t["summary"]
    servers, steps, groups = cfg["servers"], _rounds(cfg), cfg["groups"]
    workers = list(range(servers + groups, WORLD))
    problems = []
    pushed = len(workers) * steps
    if not s["gradients_pushed"] == s["gradients_applied"] + s["gradients_dropped"] == pushed:
        problems.append(f"counts: pushed {s['gradients_pushed']}, applied {s['gradients_applied']}, "
                        f"dropped {s['gradients_dropped']}, {pushed} expected")
    expected = sorted((w, c) for w in workers for c in range(1, steps + 1))
    shards = range(1 if groups else servers)  # group servers record each worker's gradient as shard 0
    applied = {}
    for shard in shards:
        mine = up[up["shard"] == shard]
        if sorted(zip(mine["worker"].tolist(), mine["worker_clock"].tolist())) != expected:
            problems.append(f"shard {shard} did not record every gradient exactly once")
        for r in mine:
            applied.setdefault((int(r["worker"]), int(r["worker_clock"])), set()).add(int(r["applied"]))
    torn = sorted(k for k, v in applied.items() if len(v) > 1)
    if torn:
        problems.append(f"gradients applied by some shards and not others: {torn[:4]}")
    nobody = sum(1 for v in applied.values() if v == {0})
    if nobody != s["gradients_dropped"]:
        problems.append(f"{nobody} gradients applied by no shard, the summary says {s['gradients_dropped']} dropped")
    if cfg.get("fault") and nobody < 1:
        problems.append("the injected NaN gradient was applied")
    if cfg.get("inner_nan"):
        rank, _ = cfg["inner_nan"]
        sc = t["workers/scalars"]
        skipped = sc[sc["name"] == b"inner_nonfinite"]
        if [(int(r["rank"]), float(r["value"])) for r in skipped] != [(rank, 1.0)]:
            problems.append(f"the inner NaN at {cfg['inner_nan']} was not skipped once: {skipped.tolist()}")
        if s["gradients_dropped"]:
            problems.append(f"an inner NaN skipped in the loop, yet {s['gradients_dropped']} rounds dropped")
    bound = {"bsp": 0, "ssp": cfg.get("staleness"), "dssp": cfg.get("staleness_max")}.get(cfg["paradigm"])
    if bound is not None and servers == 1 and not groups:
        gaps = [int(r["step"]) - min(clocks_at(up, int(r["version"]), workers).values()) for r in it]
        if gaps and max(gaps) > bound:
            problems.append(f"clock gap {max(gaps)} > bound {bound}")
    if cfg["paradigm"] == "eager" and len(it) and it["lag"].max() > cfg["staleness"]:
        problems.append(f"eager lag {it['lag'].max()} > --staleness {cfg['staleness']}")
    return problems


@pytest.mark.timeout(1800 if SOAK else 600)
@(seed(int(SEED)) if SEED is not None else lambda test: test)  # (none where unset: a seed() overrides derandomize)
@settings(max_examples=RUNS, derandomize=SEED is None, database=None, deadline=None, phases=PHASES,
          suppress_health_check=list(HealthCheck), print_blob=False)
@given(cfg=combinations())
def test_combinations_hold_across_shards(world, mpi_tmp_path, cfg):
    try:  # a combination hpcps refuses is one error line, the same on every rank: not a run to check
        plan(make_config({k: v for k, v in cfg.items() if k not in ("loop", "inner_nan")} | (
            {"dataset": "own-loop"} if cfg["loop"] == "own" else {})), world.size)
    except UserError as exc:
        assert "\n" not in str(exc)
        reject()
    n = share(world, np.random.default_rng().integers(1 << 30) if world.rank == 0 else None)
    tables, torn = _run(world, mpi_tmp_path / f"c{n}.h5", cfg)
    problems = share(world, _checked(cfg, tables) if world.rank == 0 else None)
    if world.rank == 0 and os.environ.get("HPCPS_COMBINATIONS_SHOW"):
        print("COMBO", cfg, dict(tables["summary"]).get("gradients_dropped"), torn, flush=True)
    assert torn == 0, f"{cfg}: {torn} steps read parameters the next pass did not use"
    assert not problems, f"{cfg}: {problems}"
