"""The real command line under mpiexec, as a user runs it (subprocess, bounded by a timeout).

A deadlock makes ``subprocess.run`` time out, the test kills the job and
fails; nothing here can hang the suite.
"""

import json
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch

from hpcps.cluster.launcher import clean_environ
from launching import failure, launch, needs_mpiexec

pytestmark = needs_mpiexec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def hpcps(n: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``mpiexec -n N python -m hpcps ARGS``."""
    return launch(n, sys.executable, "-m", "hpcps", *args, timeout=timeout)


def test_hpcps_check_prints_the_table_and_the_verdict_of_the_mpi_it_runs_on(tmp_path):
    from hpcps.transport.mpilib import library_version

    proc = hpcps(5, "check", "--seconds", "0.1", "--busy", "0.5")
    assert proc.returncode == 0, proc.stdout[-3000:] + failure(proc.stderr)
    rows = dict(line.split(None, 1) if "  " not in line else [x.strip() for x in line.split("  ", 1)]
                for line in proc.stdout.splitlines()[:8])
    assert rows["MPI library"] == library_version()  # this venv's mpi4py's MPI, which the job ran
    assert rows["nodes"] == "1; ranks per node: 5 on 1 node(s)"
    assert rows["RMA memory model"].startswith(("unified", "separate"))
    assert "rank 1 pulled from rank 0 while it computed 0.50 s" in proc.stdout
    assert "within " in proc.stdout and proc.stdout.rstrip().splitlines()[-1].startswith("verdict: hpcps works here")
    assert proc.stdout.count("verdict:") == 1  # rank 0 alone prints


def test_hpcps_check_refuses_a_nonpositive_duration_in_one_line():
    proc = hpcps(2, "check", "--seconds", "0")
    assert proc.returncode == 2
    ours = [line for line in proc.stderr.splitlines() if line.startswith("hpcps")]  # (Open MPI's mpirun adds a block)
    assert ours == ["hpcps: error: hpcps check: --seconds and --busy take a positive number of seconds"]


def test_default_bsp_run_reaches_90_percent_and_writes_a_valid_file(tmp_path):
    out = tmp_path / "bsp.h5"
    proc = hpcps(5, "train", "--paradigm", "bsp", "--out", str(out), "--progress-every", "0.2")
    assert proc.returncode == 0, proc.stderr
    assert "INFO: progress: " in proc.stderr and " gradients (" in proc.stderr  # stderr is a pipe: status lines
    with h5py.File(out) as f:
        s = f["summary"].attrs
        assert f.attrs["paradigm"] == "bsp" and f.attrs["n_workers"] == 4 and f.attrs["world_size"] == 5
        assert s["gradients_pushed"] == len(f["workers/iterations"]) == 4 * 500
        assert s["gradients_applied"] + s["gradients_dropped"] == s["gradients_pushed"]
        assert s["final_accuracy"] >= 0.90
        assert f["eval"]["accuracy"][-1] == s["final_accuracy"]
    assert proc.stderr.count("final evaluation loss") == 1  # one summary line, not two
    assert "accuracy nan" not in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--paradigm", "nope"], "--paradigm: unknown paradigm 'nope'"),
    (["--servers", "3"], "world of 3 rank(s) is too small for --servers 3"),
    (["--slowdown", "0=3"], "--slowdown 0=...: rank 0 is a server, not a worker (workers are ranks 1-2)"),
    (["--dataset", "/nonexistent/data.h5"], "--dataset /nonexistent/data.h5: no such file"),
    (["--lr", "-1"], "--lr: Input should be greater than 0"),
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (["--groups", "1"], "--groups 1: paradigm 'dssp' does not use group servers"),
    (["--paradigm", f"{EXAMPLES}/backup_workers.py:BackupWorkers", "--checkpoint-every", "5"],
     "holds gradients its own way, and periodic checkpoints cut only paradigms that hold rounds or apply every "
     "gradient on arrival"),
    (["--paradigm", "bsp", "--resume", "/nonexistent/ck.h5"], "--resume /nonexistent/ck.h5: no such file"),
    (["--fault", "nan@0:3"], "--fault nan@0:3: rank 0 is not a worker"),
    (["--paradigm", "grouped"], "--paradigm grouped needs --groups G"),
    (["--paradigm", "grouped", "--groups", "many"], "--groups: Input should be a valid integer"),
    (["--model", "nosuch/net.py:net"], "--model nosuch/net.py: no such file"),
    (["--model", f"{EXAMPLES}/cnn_plugin.py:missing"], "cnn_plugin.py has no attribute 'missing'"),
    (["--model", "builtins:dict"], "--model builtins:dict: returned a dict, not a torch.nn.Module"),
    (["--dataset", "hpcps_nosuch_pkg.data:load"], "--dataset hpcps_nosuch_pkg.data: no module named 'hpcps_nosuch_pkg'"),
    (["--dataset", f"{EXAMPLES}/cnn_plugin.py:cnn"], "cnn_plugin.py:cnn: calling it failed: TypeError"),
    (["--loss", "l1"], "--loss: unknown loss 'l1'"),
    (["--optimizer", "adam", "--momentum", "0.9"], "--momentum is for --optimizer sgd"),
])
def test_bad_input_ends_every_rank_with_one_clear_line(tmp_path, args, message):
    proc = hpcps(3, "train", "--out", str(tmp_path / "x.h5"), *args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_groups_auto_puts_the_straggler_only_with_slow_peers(tmp_path):
    """7 ranks: 1 server, 2 group servers, 4 workers; rank 4 is 4x slower, so it gets a group of its own.
    On the CPU: the straggler is the emulated one alone (on a GPU shared by the 4 workers and the other
    tests' jobs, another worker's measured passes once came out as slow, from the queue on the device)."""
    out = tmp_path / "auto.h5"
    proc = hpcps(7, "train", "--device", "cpu", "--paradigm", "grouped", "--groups", "auto", "--slowdown", "4=4",
                 "--compute-time", "0.005", "--steps", "20", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out) as f:
        assert json.loads(f.attrs["groups"]) == {"1": [3, 5, 6], "2": [4]}
        assert f["summary"].attrs["gradients_applied"] == 4 * 20
        assert json.loads(f.attrs["config"])["group_by"] == "speed"
    assert "groups by measured speed" in proc.stderr


def test_an_option_the_paradigm_does_not_read_is_one_warning_line_and_the_run_goes_on(tmp_path):
    """Sweeping one set of flags over every paradigm is how they are compared: --staleness under asp is
    named once (rank 0, at start-up), and the run trains."""
    out = tmp_path / "asp.h5"
    proc = hpcps(3, "train", "--paradigm", "asp", "--staleness", "3", "--steps", "10", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "has no effect" in line]
    assert len(said) == 1 and "--staleness has no effect under --paradigm asp" in said[0], proc.stderr
    with h5py.File(out) as f:
        assert f["summary"].attrs["gradients_applied"] == 2 * 10


def test_a_spare_no_death_needs_waits_idle_and_ends_with_the_run(tmp_path):
    """Without run-through (no --with-ft ulfm) a spare cannot take anyone's place: one warning says so, the
    spare trains nothing, and shard 0 releases it at the end, so the job ends as it would without it."""
    out = tmp_path / "ssp.h5"
    proc = hpcps(4, "train", "--paradigm", "ssp", "--steps", "10", "--spare-workers", "1", "--no-progress",
                 "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "--spare-workers 1: the spares stay idle" in proc.stderr
    assert "2 worker(s) (rank 1-2), 1 spare worker(s) (rank 3-3)" in proc.stderr
    with h5py.File(out) as f:
        assert f["ranks"]["role"].tolist() == [b"server", b"worker", b"worker", b"spare"]
        assert sorted(set(f["workers/iterations"]["rank"].tolist())) == [1, 2]
        assert len(f["servers/joins"]) == 0
        assert f["summary"].attrs["gradients_applied"] == 2 * 10 and f["summary"].attrs["workers_joined"] == 0


def test_module_entry_point_and_version():
    proc = subprocess.run([sys.executable, "-m", "hpcps", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("hpcps ")


#: a worker's inner optimizer is built after the run's start; whatever of torch's that imports counts in the clock
INNER_IMPORTS = """
import sys
from mpi4py import MPI
import hpcps.training.local as local
from hpcps.options.config import make_config
from hpcps.runtime.run import run_training

imported = []
build = local.LocalSteps.__init__
def probed(self, *args, **kwargs):
    before = set(sys.modules)
    build(self, *args, **kwargs)
    imported.extend(sorted(m for m in set(sys.modules) - before if m.split(".")[0] == "torch"))
local.LocalSteps.__init__ = probed
run_training(make_config({"paradigm": "localsgd", "local_steps": 2, "steps": 2, "dataset": "digits",
                          "out": sys.argv[1], "progress": False}), MPI.COMM_WORLD)
if MPI.COMM_WORLD.rank == 1:
    print("IMPORTED", imported)
"""


def test_a_workers_inner_optimizer_imports_nothing_of_torchs_after_the_start(tmp_path):
    """torch imports its compiler (torch._dynamo, 1.5-2.5 s) at a process's first optimizer: before the run's
    start, so the worker's inner optimizer, built after it, finds it there (a 10-round localsgd run took 2.7 s
    here, 2.5 of them that import)."""
    probe = tmp_path / "probe.py"
    probe.write_text(INNER_IMPORTS)
    proc = launch(2, sys.executable, str(probe), str(tmp_path / "m.h5"), timeout=120)
    assert proc.returncode == 0, failure(proc.stderr)
    assert "IMPORTED []" in proc.stdout, proc.stdout[-2000:]


def test_launcher_with_several_tasks_but_a_world_of_one_fails_naming_the_fix(tmp_path):
    env = clean_environ(SLURM_STEP_NUM_TASKS="4")  # what srun without the right --mpi plugin leaves each task
    proc = subprocess.run([sys.executable, "-m", "hpcps", "train", "--out", str(tmp_path / "x.h5")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "srun started 4 tasks but MPI sees a world of 1" in proc.stderr and "--mpi=pmi2" in proc.stderr


@pytest.mark.parametrize("fault,message", [
    (["--nonfinite", "abort", "--fault", "nan@2:60"], "rank 0 failed: RunAborted: worker rank 2 pushed a non-finite"),
    (["--fault", "raise@3:60"], "rank 3 failed: InjectedFault"),
    (["--fault", "exit@3:60"], None),  # a rank that dies: mpiexec ends the job
    (["--paradigm", "bsp", "--fault", "hang@2:60", "--stall-warn", "1", "--stall-abort", "3"],
     # rank 2 alone: a worker whose push waits for the shard's buffer (bsp's round sum keeps the last
     # buffer for rank 2's gradient) is not silent
     "RunAborted: stall: shard 0: no message from worker rank(s) 2 (silent"),
])
def test_a_failing_rank_ends_the_job_promptly_and_keeps_the_metrics(tmp_path, fault, message):
    out = tmp_path / "x.h5"
    proc = hpcps(5, "train", "--paradigm", "asp", "--steps", "400", "--compute-time", "0.005", "--out", str(out),
                 *fault, timeout=120)  # a hung rank must not hang the job: the timeout would fail the test
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpcps: error:")]
    if message is not None:
        assert len(errors) == 1 and message in errors[0], failure(proc.stderr)
    # readable (without HDF5's lock: rank 0 may still be exiting), with what was recorded before the failure
    with h5py.File(out, "r", locking=False) as f:
        assert len(f["workers/iterations"]) > 0 and len(f["servers/updates"]) > 0
        assert f["workers/iterations"]["step"].max() < 400


def test_a_failing_workers_last_rows_reach_the_file_before_the_job_ends(tmp_path):
    """bsp, worker rank 2 raising at its step 30: its 30 rows are in the file (a worker sends its rows to rank
    0 in batches every 0.25 s, and those it held were lost with it); rank 0 flushes within the 0.5 s the
    failing rank waits before MPI_Abort."""
    out = tmp_path / "last.h5"
    proc = hpcps(5, "train", "--paradigm", "bsp", "--steps", "400", "--compute-time", "0.002", "--out", str(out),
                 "--fault", "raise@2:30", timeout=120)
    assert proc.returncode != 0 and "rank 2 failed: InjectedFault" in proc.stderr, failure(proc.stderr)
    with h5py.File(out, "r", locking=False) as f:
        it = f["workers/iterations"][()]
    assert sorted(it["step"][it["rank"] == 2].tolist()) == list(range(30))


def test_mnist1d_is_generated_once_and_the_papers_cnn_trains_on_it(tmp_path):
    pytest.importorskip("mnist1d", reason="--dataset mnist1d needs the mnist1d package (pip install mnist1d)")
    cache, out = tmp_path / "cache", tmp_path / "m1d.h5"
    proc = launch(5, sys.executable, "-m", "hpcps", "train", "--paradigm", "bsp", "--dataset", "mnist1d",
                  "--model", "cnn1d", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05", "--steps", "150",
                  "--out", str(out), timeout=240, env={"HPCPS_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, failure(proc.stderr)
    assert [p.name for p in cache.iterdir()] == ["mnist1d-5000.npz"]  # one file, written once, no leftovers
    with h5py.File(out) as f:
        assert f["summary"].attrs["gradients_applied"] == 4 * 150
        assert f["summary"].attrs["final_accuracy"] > 0.3  # 10 classes; ~0.9 after 1000 steps
        assert f.attrs["dataset_kind"] == "builtin"
    assert "mnist1d (4000 train / 1000 test)" in proc.stderr and "cnn1d (28298 parameters" in proc.stderr


def test_a_divergent_run_stops_long_before_its_last_step_with_one_line_saying_what_to_try(tmp_path):
    out = tmp_path / "diverged.h5"
    # 5 ms a step: the stop's delay (rank 0's watch reads the rows as the shards pass them on) is time, and a
    # step of the bare model (well under a millisecond) let a busy CI machine's workers push 3,854 gradients in it
    proc = hpcps(5, "train", "--paradigm", "asp", "--lr", "50", "--steps", "2000", "--out", str(out),
                 "--eval-interval", "0.5", "--compute-time", "0.005", timeout=300)
    assert proc.returncode == 3, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "training diverged under asp" in x]
    assert len(lines) == 1, proc.stderr
    assert "applied as its own update at 12.5 (--lr 50 / 4): try a smaller --lr" in lines[0]
    with h5py.File(out) as f:
        s = f["summary"].attrs
        assert s["stopped_by"] == "diverged" and s["checkpoint"] == ""
        assert s["gradients_pushed"] < 4 * 2000 // 4  # stopped within the first quarter of its steps
        assert s["gradients_applied"] + s["gradients_dropped"] == s["gradients_pushed"]
    # the same run told to train on does not stop
    proc = hpcps(5, "train", "--paradigm", "asp", "--lr", "50", "--steps", "100", "--divergence", "ignore",
                 "--out", str(tmp_path / "on.h5"), timeout=300)
    assert proc.returncode == 0 and "diverged" not in proc.stderr
    with h5py.File(tmp_path / "on.h5") as f:
        assert f["summary"].attrs["gradients_pushed"] == 400 and f["summary"].attrs["stopped_by"] == ""


def test_a_four_worker_two_shard_checkpoint_resumes_on_three_workers_and_on_one_shard(tmp_path):
    """The job resubmitted on a smaller allocation: the bsp checkpoint of 4 workers and 2 shards (6 ranks)
    resumes on 3 workers (5 ranks) and on 1 shard (5 ranks); each run finishes the steps and says what
    changed, in its log and in its file."""
    ck = tmp_path / "ck"
    common = ["train", "--paradigm", "bsp", "--momentum", "0.9", "--steps", "20"]
    proc = hpcps(6, *common, "--servers", "2", "--checkpoint-every", "10", "--checkpoint-dir", str(ck),
                 "--out", str(tmp_path / "six.h5"))
    assert proc.returncode == 0, failure(proc.stderr)
    path = str(ck / "step-000010.h5")
    for servers, workers, shape in (("2", 3, "4 worker(s) at clocks [10, 10, 10, 10] -> 3 at clock 10"),
                                    ("1", 4, "2 shard(s) -> 1")):
        out = tmp_path / f"five-{servers}.h5"
        proc = hpcps(5, *common, "--servers", servers, "--resume", path, "--out", str(out),
                     "--checkpoint-dir", str(tmp_path / f"again-{servers}"))
        assert proc.returncode == 0, failure(proc.stderr)
        assert f"on another shape: {shape}" in proc.stderr
        with h5py.File(out) as f:
            assert f.attrs["resumed_shape"] == shape
            assert f["summary"].attrs["gradients_pushed"] == workers * 10
            assert f["summary"].attrs["final_accuracy"] > 0.5


def test_a_diloco_job_killed_mid_run_resumes_from_its_newest_checkpoint_and_ends_as_the_uninterrupted_one(tmp_path):
    """A worker dies at round 13 of 20 (two local steps each, inner sgd with momentum: its state matters). The
    resumed job takes each worker's inner state back from its files, pushes exactly the rounds the checkpoint
    lacks, and saves the very model of the job nobody killed."""
    common = ["train", "--paradigm", "diloco", "--local-steps", "2", "--steps", "40", "--inner-momentum", "0.9",
              "--inner-lr", "0.05", "--seed", "2", "--checkpoint-every", "4"]
    proc = hpcps(5, *common, "--checkpoint-dir", str(tmp_path / "ck-full"), "--out", str(tmp_path / "full.h5"))
    assert proc.returncode == 0, failure(proc.stderr)
    ck = tmp_path / "ck"
    proc = hpcps(5, *common, "--fault", "exit@2:13", "--checkpoint-dir", str(ck), "--out", str(tmp_path / "k.h5"))
    assert proc.returncode != 0
    complete = [p for p in sorted(ck.glob("step-*.h5")) if (ck / (p.stem + ".optim-0.pt")).exists()]
    newest = complete[-1]
    with h5py.File(newest) as f:
        clocks = f.attrs["worker_clocks"].tolist()
    assert clocks == [12] * 4  # the round's checkpoint before the death (every 4 rounds)
    assert sorted(p.name for p in (ck / "inner").iterdir() if ".round-12." in p.name) == [
        f"worker-{w}.round-12.pt" for w in range(4)]
    proc = hpcps(5, *common, "--resume", str(newest), "--checkpoint-dir", str(tmp_path / "ck2"),
                 "--out", str(tmp_path / "resumed.h5"))
    assert proc.returncode == 0, failure(proc.stderr)
    assert "inner optimizer state" not in proc.stderr  # no worker started its inner state afresh
    with h5py.File(tmp_path / "resumed.h5") as f:
        assert f["summary"].attrs["gradients_pushed"] == f["summary"].attrs["gradients_applied"] == 4 * (20 - 12)
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert full.keys() == resumed.keys()
    assert all(torch.equal(full[k], resumed[k]) for k in full)


def test_the_log_and_the_run_file_say_where_the_shards_slices_are(tmp_path):
    """``--server-device cpu``: one log line for every shard's slice, and each shard's ``devices`` entry in the
    run file says it too (the workers' say only their own device)."""
    out = tmp_path / "sd.h5"
    proc = hpcps(4, "train", "--servers", "2", "--server-device", "cpu", "--device", "cpu", "--steps", "5",
                 "--out", str(out))
    assert proc.returncode == 0, failure(proc.stderr)
    assert ("server shards' slices, optimizer state and sums on cpu, pushes and publishes copied through host "
            "memory (2 shards)") in proc.stderr, failure(proc.stderr)
    with h5py.File(out) as f:
        devices = json.loads(f.attrs["devices"])
    assert devices == ["cpu; slice on cpu, pushes and publishes copied through host memory"] * 2 + ["cpu"] * 2
