"""hpcps tune under mpiexec: trials of the layouts the options leave open, ranked, with commands that keep the
user's own words; nothing of the trials left behind."""

from __future__ import annotations

import json
import re
import shlex
import sys

import h5py
import pytest

from hpcps.runtime.tune import FROM_TRIALS
from launching import failure, launch, needs_mpiexec

pytestmark = needs_mpiexec

ROW = re.compile(r"^\| (\d+) \| (.+?)( \(as given\))? \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$")


@pytest.mark.timeout(240)
def test_tune_ranks_every_open_layout_by_batches_a_second_and_prints_commands_that_keep_the_users_words(tmp_path):
    user = ["--paradigm", "bsp", "--partition-mb", "0", "--shards-at-once", "0", "--steps", "99",
            "--out", "runs/mine.h5"]
    proc = launch(5, sys.executable, "-m", "hpcps", "tune", "--trial-steps", "8", *user, timeout=200, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + failure(proc.stderr)
    rows = [ROW.match(line) for line in proc.stdout.splitlines() if ROW.match(line)]
    # one node of 5 ranks: 1 or 2 shards, each pull; the partitions and rotation as the user set them
    layouts = {row[2] for row in rows}
    assert layouts == {f"--servers {s} --pull {p} --partition-mb 0 --shards-at-once 0"
                       for s in (1, 2) for p in ("get", "send")}, proc.stdout
    assert [int(row[1]) for row in rows] == [1, 2, 3, 4]
    rates = [float(row[6]) for row in rows]
    assert rates == sorted(rates, reverse=True)
    for row in rows:  # batches a second: the workers over the mean step (one shard leaves 4 workers, two 3)
        workers, step_ms = int(row[4]), float(row[5])
        assert workers == (4 if row[2].startswith("--servers 1 ") else 3)
        assert float(row[6]) == pytest.approx(workers / (step_ms / 1e3), rel=0.03)
    given = [row[2] for row in rows if row[3]]
    assert given == ["--servers 1 --pull get --partition-mb 0 --shards-at-once 0"]  # what auto chose on one node
    assert "the options as given, tried first and last:" in proc.stdout
    commands = [line.split(None, 1)[1] for line in proc.stdout.splitlines() if line.strip().startswith(("0", "1", "2",
                "3", "4", "5", "6", "7", "8", "9")) and "hpcps train" in line]
    assert len(commands) == 3
    for line in commands:
        words = shlex.split(line)
        assert words[:5] == ["mpiexec", "-n", "5", "hpcps", "train"] and words[5:5 + len(user)] == user
        assert words[5 + len(user)::2] == ["--servers", "--pull"] and "--trial-steps" not in words
    assert not (tmp_path / "runs").exists()  # the trials wrote where the user's run would not


#: worker rank 4 three times slower: asp's other workers run on, bsp's round would wait (tests/mpi/test_paradigm_auto_mpi.py)
STRAGGLED = ["--paradigms", "bsp", "asp", "--compute-time", "0.01", "--slowdown", "4=3", "--trial-steps", "10"]
AUTO_ROW = re.compile(r"^\| (\w+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (.*) \|$")


@pytest.mark.timeout(180)
def test_train_under_paradigm_auto_runs_the_trials_then_the_paradigm_chosen_and_keeps_the_choice(tmp_path):
    proc = launch(5, sys.executable, "-m", "hpcps", "train", "--paradigm", "auto", *STRAGGLED, "--steps", "40",
                  "--out", "run.h5", "--no-progress", timeout=150, cwd=str(tmp_path))
    assert proc.returncode == 0, failure(proc.stderr)
    assert "--paradigm auto: trial 1 of up to 2: asp, steps 1-10 of the training" in proc.stderr
    assert "--paradigm auto: no trial of bsp: at most " in proc.stderr  # (the straggler's pace: its own line)
    assert "--paradigm auto: asp, the most batches a second" in proc.stderr
    assert "the run goes on from the 10 steps they trained" in proc.stderr and "(not tried: bsp)" in proc.stderr
    rows = [AUTO_ROW.match(line) for line in proc.stderr.splitlines() if AUTO_ROW.match(line)]
    assert [(r[1], r[6].strip()) for r in rows] == [("asp", "chosen")], proc.stderr
    with h5py.File(tmp_path / "run.h5") as f:
        config = json.loads(f.attrs["config"])
        assert f.attrs["paradigm"] == "asp" and config["paradigm"] == "asp"
        # it went on from the trials, whose checkpoint went with them: the same command trains from the start
        assert f.attrs["resumed_from"] == FROM_TRIALS and config["resume"] is None
        record = json.loads(f.attrs["paradigm_choice"])
        steps = f["workers/iterations"]["step"]
    # the run trained faster than bsp could have: the skip was right
    assert record["chosen"] == "asp" and list(record["skipped"]) == ["bsp"]
    assert record["measured"]["batches_per_s"] > 4 / record["trials"][0]["slowest_compute_s"]
    assert record["trained_steps"] == 10
    # the run's own steps, going on from the trial's 10: each of the other 30 once, on each worker
    assert sorted(steps.tolist()) == sorted(list(range(10, 40)) * 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5", "run.pt"]  # (the trials' files gone)


@pytest.mark.timeout(180)
def test_tune_under_paradigm_auto_with_adam_tries_bsp_alone_and_prints_what_it_left_out_and_why(tmp_path):
    """``--optimizer adam`` and no ``--paradigms``: the paradigms of single gradients are left out before any
    trial (hpcps.options.paradigm_choice.choices); tune's table says so, one line each, not only the log."""
    proc = launch(5, sys.executable, "-m", "hpcps", "tune", "--paradigm", "auto", "--optimizer", "adam",
                  "--compute-time", "0.01", "--trial-steps", "6", timeout=150, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + failure(proc.stderr)
    assert "hpcps tune: 1 of 1 paradigms tried on 5 ranks" in proc.stdout
    assert [AUTO_ROW.match(line)[1] for line in proc.stdout.splitlines() if AUTO_ROW.match(line)] == ["bsp"]
    left = [line for line in proc.stdout.splitlines() if line.startswith("left out: ")]
    assert [line.split(":")[1].strip() for line in left] == ["ssp", "dssp", "asp"], proc.stdout
    assert all("--optimizer adam: trains less per sample than bsp" in line for line in left)


@pytest.mark.timeout(180)
def test_tune_under_paradigm_auto_ranks_the_paradigms_and_prints_each_command_with_the_paradigm_typed(tmp_path):
    alike = ["--paradigms", "bsp", "asp", "--compute-time", "0.01", "--trial-steps", "10"]
    proc = launch(5, sys.executable, "-m", "hpcps", "tune", "--paradigm", "auto", *alike, "--steps", "99",
                  timeout=150, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + failure(proc.stderr)
    # workers alike: asp's trial leaves bsp within reach (4 batches per 10 ms of compute), so bsp is tried too
    assert "hpcps tune: 2 of 2 paradigms tried on 5 ranks" in proc.stdout and "not tried" not in proc.stdout
    rows = [AUTO_ROW.match(line) for line in proc.stdout.splitlines() if AUTO_ROW.match(line)]
    assert sorted(r[1] for r in rows) == ["asp", "bsp"], proc.stdout
    rates = [float(r[3]) for r in rows]
    assert rates == sorted(rates, reverse=True)
    chosen = [r[1] for r in rows if r[6].strip() == "chosen"]
    assert len(chosen) == 1
    commands = [shlex.split(line.split(None, 1)[1]) for line in proc.stdout.splitlines() if "hpcps train" in line]
    kept = ["--compute-time", "0.01", "--steps", "99"]
    order = chosen + [p for p in ("asp", "bsp") if p != chosen[0]]
    assert commands == [["mpiexec", "-n", "5", "hpcps", "train", *kept, "--paradigm", p] for p in order]
