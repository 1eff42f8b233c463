"""Run-through on Open MPI's ULFM (``mpirun --with-ft ulfm``): a worker SIGKILLed mid-run, the others finish
their planned steps in the same job, nothing restarted (subprocess, bounded by a timeout).

Open MPI only (CI's second stage, .ci/openmpi): under MPICH mpi4py's ULFM calls are fallbacks, and the
launcher ends the job on a rank's death. CI kills worker rank 3 at step 15 under asp, ssp and dssp, and at
round 15 of ssp's rounds of 2 local steps with ``--overlap-steps 1`` (a pull deferred past the push); the soak
(``HPCPS_SOAK_RUNTHROUGH=N python -m pytest tests/cli/test_runthrough.py``) also runs eager, bsp and the
asynchronous local-SGD form with and without overlap, N times each with the step drawn at random (the seed
is printed). With ``--spare-workers 1`` CI kills worker rank 3 at step 15 under asp, ssp, dssp, eager, ssp
on two shards and ssp's rounds of local steps with overlap: a spare takes its place and the run trains its
planned amount; also killed right after its push's headers, or between a payload and its verdict, a
second death with the spare taken, a spare that dies in its place, and checkpoints after a join. With
``--respawn`` and no spare CI kills a worker at step 15 under asp, ssp on two shards and eager: the run stops,
the survivors spawn a process in its place, and across the two run files every gradient is trained once.
"""

import json
import os
import random
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpcps.cluster.launcher import ULFM_LAUNCH
from launching import FAMILY, MPIEXEC, OVERSUBSCRIBE, failure, launch, needs_mpiexec, run_bounded

pytestmark = [needs_mpiexec, pytest.mark.skipif(FAMILY != "openmpi", reason="run-through needs Open MPI's ULFM "
                                                                             "(mpirun --with-ft ulfm)")]

STEPS, KILLED = 60, 3
SOAK = int(os.environ.get("HPCPS_SOAK_RUNTHROUGH", "0") or 0)
SOAKED = [pytest.param(p, marks=pytest.mark.skipif(not SOAK, reason="soak only: HPCPS_SOAK_RUNTHROUGH=N"))
          for p in ("eager", "bsp", "asp-local", "asp-overlap")]


def ulfm_train(*args: str, out, n: int = 5, timeout: float = 150) -> subprocess.CompletedProcess:
    steps = [] if "--steps" in args else ["--steps", str(STEPS)]
    return launch(n, "--with-ft", "ulfm", sys.executable, "-m", "hpcps", "train", *steps,
                  "--no-progress", "--out", str(out), *args, timeout=timeout)


def ran_through(done: subprocess.CompletedProcess) -> None:
    """The job ended by itself with exit status 0, and no rank failed. Under ULFM a rank that fails (an
    exception, not the test's kill) kills itself, and the others run through its death as they do a killed
    worker's: mpirun still says 0, and only the rank's line on stderr tells the two apart."""
    assert done.returncode == 0, failure(done.stderr)
    assert re.search(r"rank \d+ failed: ", done.stderr) is None, failure(done.stderr)


def tables(path) -> dict:
    with h5py.File(path, "r") as f:
        return {"it": f["workers/iterations"][()], "up": f["servers/updates"][()], "lost": f["servers/lost"][()],
                "summary": dict(f["summary"].attrs)}


def clocks_at(up: np.ndarray, version: int, workers) -> dict[int, int]:
    """Each worker's clock on shard 0 once the updates before ``version`` were applied."""
    rows = up[(up["shard"] == 0) & (up["version"] < version)]
    return {w: int(rows["worker_clock"][rows["worker"] == w].max(initial=0)) for w in workers}


# the soak launches N jobs in one test, each bounded by its own 150 s: the test's limit grows with N
@pytest.mark.timeout(240 + 150 * max(SOAK - 1, 0))
@pytest.mark.parametrize("paradigm", ["asp", "ssp", "dssp", "ssp-overlap", *SOAKED])
def test_a_worker_killed_mid_run_is_run_through_with_every_gradient_accounted_for(tmp_path, paradigm):
    """Worker rank 3 SIGKILLs itself at step 15 of 60: the job ends by itself with exit status 0, the three
    others having pushed all their 60 steps; shard 0 names the dead worker, and what it pushed is what the
    shard applied, dropped and lost of it; every gradient of the living is applied or dropped. The survivors
    never stalled for as long as 5 s, and under ssp (a slow worker making the bound bind) no worker started a
    step more than s ahead of the slowest living worker."""
    seed = random.randrange(1 << 30)
    for attempt in range(max(SOAK, 1)):
        pushes = STEPS // 2 if "-" in paradigm else STEPS  # rounds of 2 local steps
        at = random.Random(seed + attempt).randrange(2, pushes - 2) if SOAK else 15
        print(f"{paradigm}: worker rank {KILLED} killed at step {at} (seed {seed + attempt})")
        killed_at(tmp_path / f"{attempt}", paradigm, at)


def killed_at(tmp_path, paradigm: str, at: int) -> None:
    s = 1
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / f"{paradigm}.h5"
    name, _, form = paradigm.partition("-")
    # rounds of 2 local steps; "overlap": the next round's first step computed while the pull is deferred
    local = {"": [], "local": ["--local-steps", "2"], "overlap": ["--local-steps", "2", "--overlap-steps", "1"]}[form]
    done = ulfm_train("--paradigm", name, "--staleness", str(s), *local,
                      "--compute-time", "0.01", "--slowdown", "4=3", "--fault", f"kill@{KILLED}:{at}", out=out)
    ran_through(done)
    assert f"worker rank {KILLED} died after its gradient" in done.stderr, failure(done.stderr)
    t = tables(out)
    it, up, lost, summary = t["it"], t["up"], t["lost"], t["summary"]
    living = [1, 2, 4]
    rounds = STEPS // 2 if local else STEPS
    for w in living:  # every step of the living, pushed and recorded
        assert sorted(it["step"][it["rank"] == w].tolist()) == list(range(rounds))
    died = lost[(lost["reason"] == 0) & (lost["shard"] == 0)]
    assert died["worker"].tolist() == [KILLED]
    first = up[up["shard"] == 0]
    theirs = first[first["worker"] == KILLED]
    cut_off = lost[(lost["worker"] == KILLED) & (lost["reason"] > 0) & (lost["shard"] == 0)]
    pushed = sorted(theirs["worker_clock"].tolist() + cut_off["worker_clock"].tolist())
    assert pushed == list(range(1, len(pushed) + 1))  # each of its pushes once, applied, dropped or lost
    assert at <= len(pushed) <= at + 2  # it died at its push (a round, under local steps; eager: 2 in flight)
    for w in living:
        assert sorted(first["worker_clock"][first["worker"] == w].tolist()) == list(range(1, rounds + 1))
    assert summary["gradients_pushed"] == 3 * rounds + len(pushed)
    assert summary["gradients_pushed"] == (summary["gradients_applied"] + summary["gradients_dropped"]
                                           + summary["gradients_lost"])
    assert summary["workers_lost"] == 1
    for w in living:  # time lost: the longest pause between two steps of a living worker
        mine = np.sort(it["t_start"][it["rank"] == w])
        assert np.diff(mine).max() < 5.0
    if name == "ssp":
        death = float(died["t"][0])
        # the bound holds where a round's pull is granted: before its start, or (overlap: its first step computed
        # while the pull is deferred) before its end; a grant before the death counted the dead worker
        granted_by = "t_end" if form == "overlap" else "t_start"
        for row in it[np.isin(it["rank"], living)]:
            alive = living + ([KILLED] if row[granted_by] < death else [])
            clocks = clocks_at(up, int(row["version"]), alive)
            assert int(row["step"]) - min(clocks.values()) <= s, (row, clocks)


SPARE = 5  # --spare-workers 1 in a world of 6 (7 with two shards): the last rank


@pytest.mark.timeout(240)
@pytest.mark.parametrize("paradigm", ["asp", "ssp", "dssp", "ssp-2shards", "eager", "ssp-local"])
def test_a_spare_takes_a_dead_workers_place_and_the_run_trains_its_planned_amount(tmp_path, paradigm):
    """Worker rank 3 SIGKILLs itself at step 15 of 60 with one spare launched: shard 0 hands the spare the dead
    worker's place at the clock it had received whole, every shard takes the spare in, and the run trains
    every worker index's 60 gradients: shard 0 applied each clock of the dead worker's index once, from the
    dead worker up to the join and from the spare after it, and the spare computed exactly the steps from
    there on. pushed = applied + dropped + lost; under ssp no worker started a step more than s ahead of the
    slowest living one, the spare counted at the dead worker's clock from its join."""
    name, _, form = paradigm.partition("-")
    shards = 2 if form == "2shards" else 1
    spare, killed = SPARE + shards - 1, KILLED
    slow = f"{spare - 1}=3"  # the last regular worker: a straggler the bound waits for
    local = ["--local-steps", "2", "--overlap-steps", "1"] if form == "local" else []
    rounds = STEPS // 2 if local else STEPS
    out, s = tmp_path / f"{paradigm}.h5", 1
    done = ulfm_train("--paradigm", name, "--staleness", str(s), "--servers", str(shards), *local,
                      "--compute-time", "0.01", "--slowdown", slow, "--fault", f"kill@{killed}:15",
                      "--spare-workers", "1", out=out, n=4 + shards + 1)
    ran_through(done)
    for shard in range(shards):
        assert f"shard {shard}: spare rank {spare} takes the place of worker rank {killed}" in done.stderr, \
            failure(done.stderr)
    t = tables(out)
    it, up, lost, summary = t["it"], t["up"], t["lost"], t["summary"]
    with h5py.File(out) as f:
        joins = f["servers/joins"][()]
    first = joins[joins["shard"] == 0]
    assert first["worker"].tolist() == [killed] and first["spare"].tolist() == [spare]
    assert len(joins) == shards
    handed = int(first["worker_clock"][0])
    assert 1 <= handed <= rounds - 1
    rows = up[(up["shard"] == 0) & (up["applied"] == 1)]
    dead = sorted(rows["worker_clock"][rows["worker"] == killed].tolist())
    by_spare = sorted(rows["worker_clock"][rows["worker"] == spare].tolist())
    assert dead == list(range(1, handed + 1))  # a gradient cut off at shard 0 is the spare's to push again
    assert by_spare == list(range(handed + 1, rounds + 1))
    assert sorted(it["step"][it["rank"] == spare].tolist()) == list(range(handed, rounds))
    living = [r for r in range(shards, shards + 4) if r != killed]
    for w in living:
        steps = sorted(it["step"][it["rank"] == w].tolist())
        # (a failure says which: the worker stopped early, or its rows were lost on their way to the file)
        applied = sorted(rows["worker_clock"][rows["worker"] == w].tolist())
        assert steps == list(range(rounds)), (f"worker rank {w}: {len(steps)} iteration rows, the last steps "
                                              f"{steps[-3:]}; shard 0 applied {len(applied)} of its gradients, the "
                                              f"last clocks {applied[-3:]}; summary {summary}\n" + failure(done.stderr))
    assert summary["workers_lost"] == 1 and summary["workers_joined"] == 1
    assert summary["gradients_applied"] + summary["gradients_dropped"] == 4 * rounds
    assert summary["gradients_pushed"] == (summary["gradients_applied"] + summary["gradients_dropped"]
                                           + summary["gradients_lost"])
    if name == "ssp":
        death = float(lost["t"][(lost["reason"] == 0) & (lost["shard"] == 0)][0])
        joined = float(first["t"][0])
        for row in it[np.isin(it["rank"], living + [spare])]:
            t0 = float(row["t_start"])
            at = up[(up["shard"] == 0) & (up["version"] < int(row["version"]))]
            clocks = [int(at["worker_clock"][at["worker"] == w].max(initial=0)) for w in living]
            if t0 < death or t0 >= joined:  # the dead worker's index: its clock, the dead's or the spare's
                clocks.append(int(at["worker_clock"][np.isin(at["worker"], [killed, spare])].max(initial=0)))
            assert int(row["step"]) - min(clocks) <= s, (row, clocks)


@pytest.mark.timeout(240)
def test_a_second_death_with_the_spare_taken_runs_through_without_one(tmp_path):
    """ssp, one spare: worker rank 3 dies at step 15 and the spare takes its place; worker rank 2 dies at step
    30 with no spare left: shard 0 says so, the run goes on without it, and ends by itself with every
    gradient accounted for: 60 each of ranks 1 and 4 and of the first dead worker's index, 30 of the second."""
    out = tmp_path / "ssp.h5"
    done = ulfm_train("--paradigm", "ssp", "--compute-time", "0.01", "--fault", "kill@3:15", "--fault", "kill@2:30",
                      "--spare-workers", "1", out=out, n=6)
    ran_through(done)
    assert "shard 0: spare rank 5 takes the place of worker rank 3" in done.stderr, failure(done.stderr)
    assert "shard 0: no spare worker left to take the place of worker rank 2" in done.stderr, failure(done.stderr)
    summary = tables(out)["summary"]
    assert summary["workers_lost"] == 2 and summary["workers_joined"] == 1
    assert summary["gradients_applied"] + summary["gradients_dropped"] + summary["gradients_lost"] == \
        summary["gradients_pushed"]
    assert 3 * STEPS + 30 <= summary["gradients_pushed"] <= 3 * STEPS + 32


@pytest.mark.timeout(240)
@pytest.mark.parametrize("paradigm,shards", [("asp", 1), ("ssp", 2)])
def test_a_worker_killed_right_after_its_push_header_is_replaced_and_its_late_header_dropped(tmp_path, paradigm,
                                                                                           shards):
    """Worker rank 3 sends its step-15 push's headers to every shard, then SIGKILLs itself before any payload:
    each shard holds a header of a dead worker (lost, a row of servers/lost), and shard 0 hands the spare the
    clock it received whole. The run trains every index's gradients: shard 0 applied each clock of the dead
    worker's index once, and pushed = applied + dropped + lost. (Here ULFM reports the death after the header
    is in, so the header delivered after a join, which killed the shard, is test_late_messages.py's.)"""
    spare = 4 + shards
    out = tmp_path / f"{paradigm}.h5"
    done = ulfm_train("--paradigm", paradigm, "--servers", str(shards), "--compute-time", "0.01",
                      "--fault", "killhead@3:15", "--spare-workers", "1", out=out, n=4 + shards + 1)
    ran_through(done)
    assert f"shard 0: spare rank {spare} takes the place of worker rank 3" in done.stderr, failure(done.stderr)
    t = tables(out)
    up, summary = t["up"], t["summary"]
    rows = up[(up["shard"] == 0) & (up["applied"] == 1) & np.isin(up["worker"], [3, spare])]
    assert sorted(rows["worker_clock"].tolist()) == list(range(1, STEPS + 1))
    assert summary["workers_lost"] == 1 and summary["workers_joined"] == 1
    assert summary["gradients_applied"] + summary["gradients_dropped"] + summary["gradients_lost"] == \
        summary["gradients_pushed"]


@pytest.mark.timeout(240)
def test_a_worker_killed_between_its_payload_and_its_verdict_has_that_gradient_dropped(tmp_path):
    """asp with pushes during backward (``--partition-mb``: each push's verdict follows its payload): worker
    rank 3 sends its step-15 payload whole (its gradient 16), then SIGKILLs itself before the verdict. The
    shard drops that gradient, says so, and the spare takes the place from gradient 17: shard 0 applied each
    other clock of the index once, and pushed = applied + dropped + lost. (Before, the shard's wait for the
    verdict raised MPI_ERR_PROC_FAILED and ended the job.)"""
    out = tmp_path / "asp.h5"
    done = ulfm_train("--paradigm", "asp", "--compute-time", "0.01", "--partition-mb", "0.01",
                      "--fault", "killverdict@3:15", "--spare-workers", "1", out=out, n=6)
    ran_through(done)
    assert "shard 0: worker rank 3 died before the verdict on its gradient 16: dropped" in done.stderr, \
        failure(done.stderr)
    assert "shard 0: spare rank 5 takes the place of worker rank 3, from its gradient 17 on" in done.stderr, \
        failure(done.stderr)
    t = tables(out)
    up, summary = t["up"], t["summary"]
    rows = up[(up["shard"] == 0) & (up["applied"] == 1) & np.isin(up["worker"], [3, 5])]
    assert sorted(rows["worker_clock"].tolist()) == [c for c in range(1, STEPS + 1) if c != 16]
    assert summary["gradients_dropped"] >= 1 and summary["gradients_applied"] == 4 * STEPS - 1
    assert summary["gradients_applied"] + summary["gradients_dropped"] + summary["gradients_lost"] == \
        summary["gradients_pushed"]


@pytest.mark.timeout(240)
def test_a_spare_that_dies_in_its_place_is_replaced_by_the_next(tmp_path):
    """asp, two spares (ranks 5 and 6): worker rank 3 dies at step 15, spare rank 5 takes its place and dies
    at its step 40, spare rank 6 takes the place from there: shard 0 applied each of the index's 60 clocks
    once, from the three ranks in turn, and the run counts two deaths and two joins."""
    out = tmp_path / "asp.h5"
    done = ulfm_train("--paradigm", "asp", "--compute-time", "0.01", "--fault", "kill@3:15", "--fault", "kill@5:40",
                      "--spare-workers", "2", out=out, n=7)
    ran_through(done)
    assert "shard 0: spare rank 5 takes the place of worker rank 3" in done.stderr, failure(done.stderr)
    assert "shard 0: spare rank 6 takes the place of worker rank 5" in done.stderr, failure(done.stderr)
    t = tables(out)
    up, summary = t["up"], t["summary"]
    rows = up[(up["shard"] == 0) & (up["applied"] == 1) & np.isin(up["worker"], [3, 5, 6])]
    assert sorted(rows["worker_clock"].tolist()) == list(range(1, STEPS + 1))
    for a, b in ((3, 5), (5, 6)):  # each rank's clocks before the next one's
        assert rows["worker_clock"][rows["worker"] == a].max() < rows["worker_clock"][rows["worker"] == b].min()
    assert summary["workers_lost"] == 2 and summary["workers_joined"] == 2
    assert summary["gradients_applied"] + summary["gradients_dropped"] == 4 * STEPS


def test_a_paradigm_that_does_not_run_through_ends_the_job_instead_of_hanging(tmp_path):
    """hsp has no run-through: its shard, finding the worker dead, ends; the others find it dead in turn
    and end, within seconds. (Under ULFM MPI_Abort ends no one and a nonzero exit hangs the job: a failing
    rank kills itself instead.)"""
    done = ulfm_train("--paradigm", "hsp", "--compute-time", "0.01", "--fault", f"kill@{KILLED}:15",
                      out=tmp_path / "hsp.h5", timeout=90)
    assert "does not run through a dead worker" in done.stderr, failure(done.stderr)
    assert "rank 0 failed" in done.stderr, failure(done.stderr)  # the shard: the first to find the worker dead
    assert "done in" not in done.stderr, failure(done.stderr)


def test_a_checkpoint_taken_after_the_death_gives_the_dead_workers_steps_back_to_a_resumed_job(tmp_path):
    """ssp with periodic checkpoints: the cuts go on after worker rank 3 died at step 15 of 40, and keep its
    clock at 15. Resumed from the newest (a plain launch), the job trains the steps each worker lacked, the
    dead one's 25 included: across both runs every worker pushed its 40 once."""
    ck = tmp_path / "ck"
    done = ulfm_train("--paradigm", "ssp", "--steps", "40", "--compute-time", "0.02", "--checkpoint-interval", "0.2",
                      "--checkpoint-dir", str(ck), "--fault", f"kill@{KILLED}:15", out=tmp_path / "first.h5")
    ran_through(done)
    newest = sorted(ck.glob("step-*.h5"))[-1]
    with h5py.File(newest) as f:
        clocks = f.attrs["worker_clocks"].tolist()
    assert clocks[KILLED - 1] == 15 and min(clocks[i] for i in (0, 1, 3)) > 15  # taken after the death
    resumed = launch(5, sys.executable, "-m", "hpcps", "train", "--paradigm", "ssp", "--steps", "40", "--no-progress",
                     "--resume", str(newest), "--out", str(tmp_path / "second.h5"), timeout=150)
    ran_through(resumed)
    it = tables(tmp_path / "second.h5")["it"]
    assert [int((it["rank"] == w).sum()) for w in (1, 2, 3, 4)] == [40 - c for c in clocks]


@pytest.mark.timeout(300)
def test_checkpoints_after_a_join_carry_the_dead_workers_index_on_through_the_spare(tmp_path):
    """ssp on two shards with periodic checkpoints and a spare: worker rank 4 dies at step 15 of 40 and the spare
    (rank 6) takes its place. The newest checkpoint's clock of that worker index is past 15, where the spare
    brought it (a cut counts the spare's pushes as the index's), and a job resumed from it without spares trains
    exactly what each index lacked."""
    ck = tmp_path / "ck"
    done = ulfm_train("--paradigm", "ssp", "--servers", "2", "--steps", "40", "--compute-time", "0.02",
                      "--checkpoint-interval", "0.2", "--checkpoint-dir", str(ck), "--fault", "kill@4:15",
                      "--spare-workers", "1", out=tmp_path / "first.h5", n=7)
    ran_through(done)
    assert "shard 1: spare rank 6 takes the place of worker rank 4" in done.stderr, failure(done.stderr)
    newest = sorted(ck.glob("step-*.h5"))[-1]
    with h5py.File(newest) as f:
        clocks = f.attrs["worker_clocks"].tolist()
    assert len(clocks) == 4 and clocks[2] > 16, clocks  # worker index 2 is rank 4
    resumed = launch(6, sys.executable, "-m", "hpcps", "train", "--paradigm", "ssp", "--servers", "2", "--steps", "40",
                     "--no-progress", "--resume", str(newest), "--out", str(tmp_path / "second.h5"), timeout=150)
    ran_through(resumed)
    it = tables(tmp_path / "second.h5")["it"]
    assert [int((it["rank"] == w).sum()) for w in (2, 3, 4, 5)] == [40 - c for c in clocks]


OWN_LOOP = '''
import os, signal, sys
import torch
import torch.nn.functional as F
import hpcps
from hpcps.transport.failures import deaths_seen

def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

ps = hpcps.init(net, optimizer="sgd", lr=0.05, paradigm="asp", steps=40, out=sys.argv[1])
if ps.is_worker:
    g = torch.Generator().manual_seed(ps.worker_index)
    x, y = torch.randn(64, 8, generator=g).to(ps.device), torch.randint(0, 2, (64,), generator=g).to(ps.device)
    step = 0
    while ps.running:
        loss = F.cross_entropy(ps.model(x), y)
        ps.optimizer.zero_grad(); loss.backward(); ps.step(); step += 1
        if ps.rank == %(killed)d and step == 15:
            os.kill(os.getpid(), signal.SIGKILL)
        if step %% 10 == 0:
            print(f"mean at {step}: {ps.mean(float(ps.worker_index)):.6f}", flush=True)
            if step == 20:
                print(f"deaths seen at 20: {deaths_seen()}", flush=True)
ps.close()
if deaths_seen():  # (MPI_Finalize would wait for the dead across nodes)
    os._exit(0)
''' % {"killed": KILLED}


def test_an_own_loop_whose_worker_dies_goes_on_and_its_ps_mean_averages_the_living(tmp_path):
    """hpcps.init's loop under asp: worker rank 3 (worker 2) SIGKILLs itself at step 15 of 40; ps.mean of each
    worker's index is 1.5 at step 10 (all four) and 4/3 from step 20 on (0, 1, 3: the living), on each of the
    three living workers, who know of the death from then on (deaths_seen), and the job ends by itself with every
    living gradient applied."""
    script = tmp_path / "own.py"
    script.write_text(OWN_LOOP)
    done = launch(5, "--with-ft", "ulfm", sys.executable, str(script), str(tmp_path / "own.h5"), timeout=150)
    ran_through(done)
    # (found in the stream, not by line: unbuffered, print writes its text and its newline apart, and the
    # launcher can put another rank's line between them)
    means = sorted(re.findall(r"mean at \d+: [0-9.]+", done.stdout))
    assert means == sorted([f"mean at 10: {1.5:.6f}"] * 4 + [f"mean at {s}: {4 / 3:.6f}" for s in (20, 30, 40)] * 3)
    assert "the workers' collectives go on over the 3 living" in done.stderr, failure(done.stderr)
    # each living worker knows of the death from its collective (its loop may os._exit at the end)
    assert re.findall(r"deaths seen at \d+: \w+", done.stdout) == \
        ["deaths seen at 20: True"] * 3
    summary = tables(tmp_path / "own.h5")["summary"]
    assert summary["workers_lost"] == 1 and summary["gradients_pushed"] == 3 * 40 + 15
    assert summary["gradients_pushed"] == summary["gradients_applied"] + summary["gradients_dropped"] + \
        summary["gradients_lost"]


def test_a_paradigm_that_does_not_run_through_is_restarted_by_the_supervisor_though_mpirun_says_0(tmp_path):
    """hsp under --with-ft ulfm, worker rank 3 SIGKILLed at step 30 of 60, periodic checkpoints, under
    ``hpcps supervise``: the job ends and Open MPI's launcher says 0, but rank 0 never marked the run
    finished, so the supervisor launches it again; the second launch resumes and finishes, pushing exactly
    what the checkpoint lacked of every worker's 60."""
    out = tmp_path / "hsp.h5"
    proc = run_bounded([sys.executable, "-m", "hpcps", "supervise", "--delay", "0", "--restarts", "2", "--",
                        MPIEXEC, "-n", "5", "--with-ft", "ulfm", sys.executable, "-m", "hpcps", "train",
                        "--paradigm", "hsp", "--steps", str(STEPS), "--compute-time", "0.02", "--checkpoint-every",
                        "40", "--seed", "1", "--no-progress", "--out", str(out), "--resume", "auto",
                        "--fault", f"kill@{KILLED}:30"], timeout=240, env=OVERSUBSCRIBE, cwd=str(tmp_path))
    assert proc.returncode == 0, failure(proc.stderr)
    assert "launch 1 ended with status 0, its run unfinished" in proc.stderr
    assert "finished after 2 launch(es)" in proc.stderr
    assert not list(tmp_path.glob(".hpcps-launch.*"))
    with h5py.File(out) as f:
        resumed, s = f.attrs["resumed_from"], f["summary"].attrs
        pushed, handled = int(s["gradients_pushed"]), int(s["gradients_applied"] + s["gradients_dropped"])
    with h5py.File(resumed) as f:
        cut = int(f.attrs["worker_clocks"].sum())
    assert 0 < cut < 4 * STEPS and pushed == handled and pushed + cut == 4 * STEPS, (pushed, cut)


@pytest.mark.timeout(120)
def test_a_process_spawned_after_a_death_joins_the_shrunk_job_and_forms_a_window_with_it(tmp_path):
    """What a replacement launched after a death will build on (tools/probe_join.py): under ULFM the survivors
    shrink, ``MPI_Comm_spawn`` one process, merge with it, sum over the merged group and form an RMA window."""
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "probe_join.py")
    proc = run_bounded([sys.executable, tool, "--ways", "spawn", "--ranks", "3"], timeout=100, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + failure(proc.stderr)
    assert re.search(r"^\| spawn \| joined: allreduce and window over the merged group \| \d+\.\d\d \|$", proc.stdout,
                     re.M), proc.stdout[-2000:]


def applied_clocks(path, shard: int = 0) -> dict[int, list[int]]:
    """Each worker rank's clocks of the gradients shard ``shard`` applied in the run file ``path``."""
    up = tables(path)["up"]
    rows = up[(up["shard"] == shard) & (up["applied"] == 1)]
    return {int(w): sorted(rows["worker_clock"][rows["worker"] == w].tolist()) for w in np.unique(rows["worker"])}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("paradigm", ["asp", "ssp-2shards", "eager"])
def test_a_worker_killed_under_respawn_is_replaced_by_a_spawned_process_and_every_gradient_is_trained(tmp_path,
                                                                                                      paradigm):
    """--respawn: worker rank KILLED SIGKILLs itself at step 15 of 60. A shard stops the run at a checkpoint, the
    survivors spawn a process in its place (MPI_Comm_spawn, after the death: no spare was launched), and the job
    resumes on the grown communicator, the newcomer at the dead rank's number. Across the two run files every
    shard applied each worker index's gradients 1..60 exactly once: the dead worker's up to its death, the
    newcomer's from there; the second file names the respawn and its newcomer's first step comes after it. The
    job, launched recoverable as docs/running.md says, ends by itself with exit status 0."""
    name, _, form = paradigm.partition("-")
    shards = 2 if form == "2shards" else 1
    killed = KILLED + shards - 1
    out = tmp_path / f"{name}.h5"
    done = launch(4 + shards, *ULFM_LAUNCH, sys.executable, "-m", "hpcps", "train", "--steps", str(STEPS),
                  "--no-progress", "--out", str(out), "--paradigm", name, "--staleness", "1", "--servers", str(shards),
                  "--compute-time", "0.01", "--fault", f"kill@{killed}:15", "--respawn", timeout=150)
    ran_through(done)
    assert f"rank(s) {killed} died: spawning 1 process(es) in their place" in done.stderr, failure(done.stderr)
    second = tmp_path / f"{name}-respawn1.h5"
    first_summary, second_summary = tables(out)["summary"], tables(second)["summary"]
    assert first_summary["stopped_by"] == "respawn" and first_summary["workers_lost"] == 1
    assert second_summary["stopped_by"] == "" and second_summary["workers_lost"] == 0
    workers = range(shards, shards + 4)
    for shard in range(shards):
        before, after = applied_clocks(out, shard), applied_clocks(second, shard)
        for w in workers:
            both = before.get(w, []) + after.get(w, [])
            assert sorted(both) == list(range(1, STEPS + 1)), (shard, w, before.get(w), after.get(w))
        assert 1 <= len(before[killed]) <= 15 and after[killed][0] == len(before[killed]) + 1
    with h5py.File(second) as f:
        note, clock_start = json.loads(f.attrs["respawn"]), float(f.attrs["clock_start"])
        it = f["workers/iterations"][()]
    assert note["ranks"] == [killed] and note["spawned"] <= note["formed"] <= clock_start
    mine = it[it["rank"] == killed]
    assert int(mine["step"].min()) == len(applied_clocks(out)[killed])  # where the dead one's gradients stopped
    assert float(mine["t_start"].min()) >= 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("then", ["run-through", "respawn"])
def test_a_worker_killed_in_the_run_paradigm_auto_chose_is_run_through_and_the_choice_is_kept(tmp_path, then):
    """--paradigm auto choosing between asp and ssp (trials of 10 steps, the run going on from them), worker rank
    KILLED SIGKILLs itself at step 40 of 60, in the run: the job ends by itself with exit status 0 and no rank
    failed (the run's end once held a barrier over every rank, the dead one too, and every living rank failed
    in it), the run file keeps the choice (under --respawn, both parts' files), and under --respawn the newcomer
    trained the dead worker's remaining steps."""
    out = tmp_path / "auto.h5"
    respawn = ["--respawn"] if then == "respawn" else []
    launch_args = ULFM_LAUNCH if respawn else ("--with-ft", "ulfm")
    done = launch(5, *launch_args, sys.executable, "-m", "hpcps", "train", "--steps", str(STEPS), "--no-progress",
                  "--out", str(out), "--paradigm", "auto", "--paradigms", "asp", "ssp", "--trial-steps", "10",
                  "--staleness", "1", "--compute-time", "0.01", "--fault", f"kill@{KILLED}:40", *respawn,
                  timeout=200)
    ran_through(done)
    assert f"worker rank {KILLED} died after its gradient" in done.stderr, failure(done.stderr)
    last = tmp_path / "auto-respawn1.h5" if respawn else out
    with h5py.File(last) as f:
        choice = json.loads(f.attrs["paradigm_choice"])
        it = f["workers/iterations"][()]
    assert choice["chosen"] in ("asp", "ssp"), choice
    if respawn:
        assert tables(out)["summary"]["stopped_by"] == "respawn"
        with h5py.File(out) as f:
            assert json.loads(f.attrs["paradigm_choice"])["chosen"] == choice["chosen"]
        assert int(it["step"][it["rank"] == KILLED].max()) == STEPS - 1  # the newcomer's last step
    else:
        assert tables(out)["summary"]["workers_lost"] == 1
        for w in (1, 2, 4):  # every living worker stepped to the end
            assert int(it["step"][it["rank"] == w].max()) == STEPS - 1


@pytest.mark.timeout(180)
def test_ranks_that_end_without_finalize_part_ways_first_and_every_rank_gets_the_last_broadcast():
    """The end of a run that saw a death: rank 0 broadcasts, and every rank ends without MPI_Finalize, which
    ULFM reports to the others as a death; rank r comes to the broadcast 0.05 r s late. With the ranks parting
    ways between the two (hpcps.transport.failures.part_ways, as a run's end and --respawn's last part do),
    every rank gets the broadcast and the job ends by itself with exit status 0, in each of three jobs. Without
    it (the script's ``leave`` mode) a receive failed with MPI_ERR_PROC_FAILED, the root gone, in 9 of 16 jobs
    (none of 16 with it)."""
    script = os.path.join(os.path.dirname(__file__), "ulfm_parting.py")
    for _ in range(3):
        done = launch(5, *ULFM_LAUNCH, sys.executable, script, "0.2", "part", timeout=50)
        assert done.returncode == 0, failure(done.stderr)
        got = sorted(int(r) for r in re.findall(r"rank (\d+) got 'the word'", done.stdout))
        assert got == list(range(5)), done.stdout + failure(done.stderr)
