"""Restarts without a person (no MPI): ``--resume auto``'s choice, what a restart cost, which endings a
supervisor launches again, and faults that fire in the first launch only."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpcps.options.config import make_config
from hpcps.errors import UserError
from hpcps.jobs.supervise import Supervisor, describe, verdict
from hpcps.runtime.checkpoints.files import checkpoint_path, optimizer_state_path, write_checkpoint
from hpcps.runtime.checkpoints.schedule import PROGRESS_NOTE, resolve_resume, restart_cost
from hpcps.options.faults import parse_fault
from hpcps.runtime import faults
from hpcps.runtime.faults import ATTEMPT_VAR, MARK_VAR, armed, inject, mark_launch


def _checkpoint(directory, version, clocks, parts=(0,)):
    cfg = make_config({"paradigm": "asp"}).as_json_dict()
    path = write_checkpoint(checkpoint_path(str(directory), version), np.zeros(4, np.float32), version=version,
                            worker_clocks=clocks, config=cfg, n_servers=2)
    for shard in parts:
        open(optimizer_state_path(path, shard), "wb").close()
    return path


def test_resume_auto_takes_the_newest_complete_checkpoint_and_clears_what_a_failed_launch_left(tmp_path):
    ck = tmp_path / "ck"
    older = _checkpoint(ck, 40, [10, 10], parts=(0, 1))
    done = _checkpoint(ck, 80, [20, 20], parts=(0, 1))
    _checkpoint(ck, 120, [30, 30], parts=(1,))  # shard 0's part never written: incomplete
    open(ck / "step-000160.optim-0.pt", "wb").close()  # a part whose main file never came
    cfg = resolve_resume(make_config({"paradigm": "asp", "resume": "auto", "checkpoint_dir": str(ck)}))
    assert cfg.resume == done
    assert sorted(p.name for p in ck.iterdir()) == sorted(
        os.path.basename(p) for p in [older, optimizer_state_path(older, 0), optimizer_state_path(older, 1),
                                      done, optimizer_state_path(done, 0), optimizer_state_path(done, 1)])


def test_resume_auto_starts_afresh_where_there_is_no_checkpoint_and_needs_a_directory_that_lasts(tmp_path,
                                                                                                 monkeypatch):
    cfg = resolve_resume(make_config({"paradigm": "bsp", "resume": "auto", "out": str(tmp_path / "r.h5")}))
    assert cfg.resume is None
    named = make_config({"paradigm": "bsp", "resume": str(tmp_path / "x.h5")})
    assert resolve_resume(named) is named
    monkeypatch.delenv("HPCPS_RUN_DIR", raising=False)
    with pytest.raises(UserError, match="--resume auto needs a checkpoint directory"):
        resolve_resume(make_config({"paradigm": "bsp", "resume": "auto"}))


def test_a_restart_costs_the_gradients_past_the_checkpoint_and_the_time_since_the_last_note_or_the_checkpoint(tmp_path):
    path = _checkpoint(tmp_path, 80, [20, 20], parts=(0, 1))
    assert restart_cost(path, [20, 20], time.time()) is None  # no note: nothing known
    written = os.path.getmtime(path)
    (tmp_path / PROGRESS_NOTE).write_text(json.dumps({"clocks": [26, 23], "time": written + 1.5}))
    cost = restart_cost(path, np.array([20, 20]), written + 4.0)
    assert cost == {"checkpoint": path, "attempt": 1, "gradients_repeated": 9, "training_lost_s": 1.5,
                    "restart_s": 2.5}
    (tmp_path / PROGRESS_NOTE).write_text(json.dumps({"clocks": [19, 20], "time": written - 1}))
    # a note older than the checkpoint: the launch ended within a note period of it; counted from the checkpoint
    assert restart_cost(path, [20, 20], written + 4.0) == {
        "checkpoint": path, "attempt": 1, "gradients_repeated": 0, "training_lost_s": 0.0, "restart_s": 4.0}


@pytest.mark.parametrize("status,stopped,final", [
    (0, False, True), (2, False, True), (3, False, True), (1, False, False), (9, False, False),
    (137, False, False), (-9, False, False), (1, True, True)])
def test_only_a_failure_that_is_not_the_users_is_launched_again(status, stopped, final):
    assert (verdict(status, stopped) is not None) == final


def test_statuses_are_described_as_a_shell_would():
    assert describe(-9) == "killed by SIGKILL" and describe(1) == "status 1"
    assert describe(137) == "status 137 (a rank killed by SIGKILL?)"


def _script(tmp_path, statuses):
    """A command that exits with the next of ``statuses`` per launch, recording the attempt it was told."""
    seen = tmp_path / "seen"
    code = (f"import os, sys; p = {str(seen)!r}; n = len(open(p).read().split()) if os.path.exists(p) else 0; "
            f"open(p, 'a').write(os.environ[{ATTEMPT_VAR!r}] + ' '); sys.exit({list(statuses)!r}[n])")
    return [sys.executable, "-c", code], seen


def test_the_supervisor_launches_again_until_the_job_ends_well(tmp_path):
    command, seen = _script(tmp_path, [1, 137, 0, 1])
    supervisor = Supervisor(command + ["--resume", "auto"], restarts=5, delay=0)
    assert supervisor.run() == 0
    assert seen.read_text().split() == ["1", "2", "3"] and len(supervisor.launches) == 3


def test_a_status_0_whose_run_began_and_never_finished_is_launched_again(tmp_path):
    """Open MPI's launcher under --with-ft ulfm says 0 whatever the ranks did: a launch's mark that says its
    run started and never finished makes it a failure; one that finished, or none at all, is taken at 0."""
    seen = tmp_path / "seen"
    code = (f"import os; p = {str(seen)!r}; n = len(open(p).read().split()) if os.path.exists(p) else 0; "
            f"open(p, 'a').write('x '); open(os.environ[{MARK_VAR!r}], 'w').write(['started', 'started', "
            f"'finished'][n])")
    supervisor = Supervisor([sys.executable, "-c", code], restarts=5, delay=0)
    assert supervisor.run() == 0 and len(supervisor.launches) == 3
    assert [launch.unfinished for launch in supervisor.launches] == [True, True, False]
    assert not list(tmp_path.glob(".hpcps-launch.*")) and not list(Path.cwd().glob(".hpcps-launch.*"))
    seen.unlink()
    assert Supervisor([sys.executable, "-c", code], restarts=0, delay=0).run() == 1  # started, no restarts left
    assert verdict(0, False, unfinished=True) is None and verdict(0, False) == "finished"
    assert "unfinished" in describe(0, unfinished=True)


def test_rank_0_marks_the_launch_only_where_the_supervisor_named_a_file(tmp_path):
    mark = tmp_path / "mark"
    mark_launch("started", {})
    mark_launch("started", {MARK_VAR: str(mark)})
    assert mark.read_text() == "started"
    mark_launch("finished", {MARK_VAR: str(tmp_path / "no" / "such" / "dir")})  # left out, no error


def test_the_supervisor_stops_at_bad_input_and_after_its_last_restart(tmp_path):
    command, seen = _script(tmp_path, [1, 2, 0])
    assert Supervisor(command, restarts=5, delay=0).run() == 2 and seen.read_text().split() == ["1", "2"]
    command, seen = _script(tmp_path, [1, 1, 1, 1])
    seen.unlink()
    assert Supervisor(command, restarts=2, delay=0).run() == 1 and seen.read_text().split() == ["1", "2", "3"]


def test_faults_fire_in_the_first_launch_only():
    faults = [parse_fault("kill@2:30")]
    assert armed(faults, {}) == faults and armed(faults, {ATTEMPT_VAR: "1"}) == faults
    assert armed(faults, {ATTEMPT_VAR: "2"}) == []


def test_a_kill_fault_says_when_on_the_runs_clock_before_it_kills(monkeypatch, caplog):
    """The line bench_peers reads the death's time from: the run's clock at the SIGKILL, then the signal."""
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(sig))

    class Worker:
        clock = staticmethod(lambda: 12.34567)
    with caplog.at_level("WARNING", logger="hpcps"):
        inject(parse_fault("kill@3:100"), Worker())
    assert killed == [signal.SIGKILL]
    assert caplog.messages == ["worker rank 3: --fault kill@3:100: SIGKILL at t=12.3457 s"]


def test_a_slurm_relaunch_runs_on_the_nodes_still_alive():
    from hpcps.jobs.supervise import alive_nodes, srun_on

    sinfo = ["n1 alloc", "n2 down*", "n3 mix", "n4 drain", "n5 idle*", "n3 mix", "n6 alloc"]
    assert alive_nodes(sinfo) == ["n1", "n3", "n6"]
    command = ["srun", "--kill-on-bad-exit=1", "hpcps", "train"]
    assert srun_on(command, ["n1", "n3"], 4) == ["srun", "--nodes=2", "--ntasks=8", "--nodelist=n1,n3",
                                                  "--kill-on-bad-exit=1", "hpcps", "train"]
    assert srun_on(["mpirun", "-n", "8", "hpcps"], ["n1"], 4) == ["mpirun", "-n", "8", "hpcps"]


def test_a_rendered_job_with_restarts_supervises_its_launch_and_resumes_itself():
    from hpcps.jobs.render import JobSpec, render

    text = render(JobSpec("slurm", nodes=2, ntasks_per_node=4, restarts=2, train_args=["--paradigm", "asp"]))
    assert "#SBATCH --no-kill\n" in text
    assert ("hpcps supervise --restarts 2 -- srun --kill-on-bad-exit=1 hpcps train --paradigm asp "
            "--out \"$RUN_DIR/metrics.h5\" --resume auto\n") in text
    plain = render(JobSpec("slurm", train_args=["--paradigm", "asp"]))
    assert "--no-kill" not in plain and "supervise" not in plain and "--resume auto" not in plain
    given = render(JobSpec("pbs", restarts=1, train_args=["--resume", "x.h5"]))
    assert "hpcps supervise --restarts 1 -- mpiexec -n 5 hpcps train --resume x.h5 --out" in given
    assert "--resume auto" not in given


def test_a_chaos_schedule_is_parsed_in_time_order_and_random_nodes_are_reproducible():
    from hpcps.box.chaos import Fault, parse

    faults = parse(["down:2@30/5", "kill:1@20", "down:3@40"], nodes=5)
    assert faults == [Fault("kill", 1, 20.0), Fault("down", 2, 30.0, 5.0), Fault("down", 3, 40.0)]
    drawn = [parse(["kill:random@10"] * 3, nodes=5, seed=s) for s in (7, 7, 8)]
    assert drawn[0] == drawn[1] and all(0 < f.node < 5 for f in drawn[0])
    for bad, message in [("kill:9@1", "nodes 0-4"), ("kill:1@5/2", "/SECONDS is for down"),
                         ("boom:1@2", "expected KIND:NODE@SECONDS")]:
        with pytest.raises(ValueError, match=message):
            parse([bad], nodes=5)


def test_a_supervised_relaunch_of_the_box_inflicts_no_chaos_again(monkeypatch, capsys):
    from hpcps.cli import main

    monkeypatch.setenv(ATTEMPT_VAR, "2")
    assert main(["emulate", "--nodes", "3", "--chaos", "kill:1@5", "--dry-run", "--", "hpcps", "train"]) == 0
    out, err = capsys.readouterr()
    assert "--chaos is for the first launch only; this is launch 2" in err and "# chaos at" not in out
    monkeypatch.setenv(ATTEMPT_VAR, "1")
    assert main(["emulate", "--nodes", "3", "--chaos", "kill:1@5", "--dry-run", "--", "hpcps", "train"]) == 0
    assert "# chaos at 5 s: node 1's processes killed (SIGKILL)" in capsys.readouterr().out


def test_a_bsp_checkpoint_whose_loop_part_is_not_written_yet_is_incomplete(tmp_path):
    """Regression: worker 0 writes a periodic bsp checkpoint's loop part (ps.state, the rates the loop set, the
    integer buffers) at its next training pass; a failure in that gap left a checkpoint that --resume auto took,
    and the run resumed without them, saying nothing. Now the checkpoint says a loop part is due (loop_part) and
    counts as complete only with it."""
    from hpcps.runtime.checkpoints.files import LoopState, read_checkpoint, user_state_path, write_user_state

    ck = tmp_path / "ck"
    cfg = make_config({"paradigm": "bsp"}).as_json_dict()

    def periodic(version):
        path = write_checkpoint(checkpoint_path(str(ck), version), np.zeros(4, np.float32), version=version,
                                worker_clocks=[version, version], config=cfg, n_servers=1, loop_part=True)
        open(optimizer_state_path(path, 0), "wb").close()
        return path

    older, newer = periodic(10), periodic(20)
    write_user_state(older, LoopState())  # an empty loop's part still counts: it was written
    with pytest.raises(UserError, match=r"incomplete checkpoint, missing .*step-000020\.user\.pt"):
        read_checkpoint(newer, complete=True)
    resumed = resolve_resume(make_config({"paradigm": "bsp", "resume": "auto", "checkpoint_dir": str(ck)}))
    assert resumed.resume == older
    assert os.path.exists(user_state_path(older)) and read_checkpoint(older, complete=True).version == 10
