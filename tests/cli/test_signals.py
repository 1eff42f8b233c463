"""Ctrl-C under mpiexec: one line, no traceback, the run's metrics and a checkpoint written (bounded by timeouts)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import h5py
import pytest

from hpcps.cluster.launcher import clean_environ
from launching import FAMILY, LAUNCHER_FAILED_TO_START, MPIEXEC, OVERSUBSCRIBE, failure, needs_mpiexec

pytestmark = needs_mpiexec


def _start(n: int, tmp_path, *train_args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``mpiexec -n N python -m hpcps train ARGS`` in its own session (so the test can kill the whole job),
    with ``env`` added to its environment."""
    return subprocess.Popen([MPIEXEC, "-n", str(n), sys.executable, "-m", "hpcps", "train", *train_args],
                            env=clean_environ(PYTHONUNBUFFERED="1", **OVERSUBSCRIBE, **(env or {})), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _ended(proc: subprocess.Popen, after: str) -> str:
    """The job's stderr once it has ended, 120 s at most after ``after``; one that does not end is killed and
    fails the test."""
    try:
        return proc.communicate(timeout=120)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the job did not end after {after}\n{proc.communicate()[1][-3000:]}") from None


def test_ctrl_c_under_mpiexec_ends_every_rank_cleanly_with_summary_and_checkpoint(tmp_path):
    """MPICH's mpiexec forwards Ctrl-C to every rank as SIGINT and their output to the end. Open MPI's sends
    the ranks SIGTERM, stops forwarding their output and exits 1 (the launcher's doing): there the run's
    file and checkpoint are what hpcps answers for."""
    out = tmp_path / "dssp.h5"
    proc = _start(5, tmp_path, "--paradigm", "dssp", "--steps", "100000", "--compute-time", "0.005", "--out",
                  str(out), "--log-every", "0.2")
    lines: list[str] = []  # rank 0's log as it comes (its evaluation's lines name the version)
    readers = [threading.Thread(target=lambda f=f, keep=keep: [keep.append(x) for x in f], daemon=True)
               for f, keep in ((proc.stderr, lines), (proc.stdout, []))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 120  # on a busy machine start-up takes a while: wait for applied gradients
    while (time.monotonic() < deadline and proc.poll() is None
           and not any(int(v) > 0 for x in list(lines) for v in re.findall(r"version=(\d+)", x))):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends mpiexec
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the job did not end after Ctrl-C\n" + "".join(lines)[-3000:]) from None
    for reader in readers:
        reader.join(timeout=10)
    stderr = "".join(lines)
    signal_name = "SIGTERM" if FAMILY == "openmpi" else "SIGINT"
    assert "Traceback" not in stderr and "Error" not in stderr, failure(stderr)
    if FAMILY != "openmpi":
        assert proc.returncode == 0, failure(stderr)
        assert stderr.count("hpcps: SIGINT received: stopping after the current step") == 1  # one line, rank 0's
    with h5py.File(out) as f:
        s = f["summary"].attrs
        assert s["stopped_by"] == signal_name and s["interrupted"] == (signal_name == "SIGINT")
        assert 0 < s["gradients_pushed"] < 4 * 100000
        assert s["gradients_applied"] + s["gradients_dropped"] == s["gradients_pushed"] == len(f["workers/iterations"])
        assert len(f["eval"]) > 0
        checkpoint = s["checkpoint"]
    assert checkpoint.startswith(str(tmp_path / "dssp-checkpoints")) and os.path.exists(checkpoint)
    if FAMILY != "openmpi":
        assert f"--resume {checkpoint}" in stderr


def _caught(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (its SigCgt mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signum - 1) & 1)


def _ranks_of(out) -> list[int]:
    """The pids of the ranks writing ``out`` (their command line names it)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            launcher = any(arg.endswith((b"mpiexec", b"mpiexec.hydra", b"mpirun", b"prterun")) for arg in cmd)
            if str(out).encode() in cmd and b"hpcps" in cmd and not launcher:
                pids.append(int(entry))
    return pids


def test_sigusr1_during_start_up_stops_the_run_at_its_first_step_with_a_checkpoint(tmp_path):
    """SIGUSR1 to every rank while they still start up (handlers installed, the run file not yet created:
    torch being imported, the data loaded): the run starts, stops at once, and writes its summary and a
    checkpoint (the ranks used to die without one)."""
    if not os.path.isdir("/proc/self"):
        import pytest
        pytest.skip("needs /proc to see when the ranks have installed their handlers")
    out = tmp_path / "early.h5"
    proc = _start(5, tmp_path, "--paradigm", "asp", "--steps", "100000", "--dataset", "mnist1d", "--out", str(out))
    deadline, sent = time.monotonic() + 60, False
    while time.monotonic() < deadline and proc.poll() is None:
        ranks = _ranks_of(out)
        if len(ranks) == 5 and all(_caught(pid, signal.SIGUSR1) for pid in ranks):
            assert not out.exists(), "start-up was over before the signal could be sent"
            for pid in ranks:
                os.kill(pid, signal.SIGUSR1)  # as Slurm's --signal reaches every task
            sent = True
            break
        time.sleep(0.01)
    if not sent:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the ranks never installed their handlers")
    stderr = _ended(proc, "SIGUSR1")
    assert proc.returncode == 0, failure(stderr)
    assert "Traceback" not in stderr, failure(stderr)
    with h5py.File(out) as f:
        s = f["summary"].attrs
        assert s["stopped_by"] == "SIGUSR1"
        assert s["gradients_pushed"] <= 4 * 2  # each worker stops at its first step or its second
        assert s["gradients_applied"] + s["gradients_dropped"] == s["gradients_pushed"]
        assert os.path.exists(s["checkpoint"])


@pytest.mark.parametrize("paradigm", ["dssp", "hsp"])
def test_a_run_killed_with_sigkill_resumes_from_its_last_periodic_checkpoint_with_the_accounting_exact(
        tmp_path, paradigm):
    """dssp (a cut at clocks) or hsp (a cut at a round's close) on 2 shards, a checkpoint every 100
    versions; the whole job killed with SIGKILL (a node lost: no signal, no summary) once one is written.
    Resumed from the newest checkpoint, the run completes: both shards are at one version in it (dssp's:
    the sum of the cut's clocks), and the cut's clocks plus the resumed run's pushes are every worker's
    steps, each pushed gradient applied or dropped."""
    from hpcps.runtime.checkpoints.files import read_checkpoint

    out, ckdir = tmp_path / "killed.h5", tmp_path / "killed-checkpoints"
    options = ["--paradigm", paradigm, "--servers", "2", "--steps", "300", "--compute-time", "0.01",
               "--checkpoint-every", "100"]
    for attempt in (1, 2):
        proc = _start(6, tmp_path, *options, "--out", str(out))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not list(ckdir.glob("step-*.h5")):
            time.sleep(0.05)
        time.sleep(0.3)  # the run goes on past its checkpoint
        if proc.poll() is None:
            break
        err = proc.communicate()[1]
        if attempt == 1 and any(line in err for line in LAUNCHER_FAILED_TO_START) and not ckdir.exists():
            continue  # the launcher itself did not start the job (once in CI, Open MPI's): no rank ran; again
        pytest.fail(f"the job ended (exit {proc.returncode}) before it was killed: {err[-3000:]}")
    os.killpg(proc.pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert "held for" in stderr, failure(stderr)  # shard 0 says what each checkpoint cost
    newest = sorted(ckdir.glob("step-*.h5"))[-1]
    cut = read_checkpoint(str(newest))
    assert cut.shard_versions[0] == cut.shard_versions[1] > 0
    if paradigm == "dssp":  # every gradient an update of its own
        assert cut.shard_versions[0] == cut.worker_clocks.sum()
    resumed = tmp_path / "resumed.h5"
    proc = subprocess.run([MPIEXEC, "-n", "6", sys.executable, "-m", "hpcps", "train", *options, "--out",
                           str(resumed), "--resume", str(newest), "--checkpoint-dir", str(tmp_path / "again")],
                          env=clean_environ(PYTHONUNBUFFERED="1", **OVERSUBSCRIBE), cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, failure(proc.stderr)
    with h5py.File(resumed) as f:
        s = f["summary"].attrs
        assert s["gradients_pushed"] + cut.worker_clocks.sum() == 4 * 300
        assert s["gradients_applied"] + s["gradients_dropped"] == s["gradients_pushed"]
        assert s["stopped_by"] == ""


START_UP_STUCK = """
import sys, time
from mpi4py import MPI
from hpcps.runtime import agree
from hpcps.runtime.agree import agree as agree_on, run_or_end
from hpcps.runtime.signals import catch_early

agree.SIGNAL_GRACE = 2.0  # (30 s in a run: a batch system's kill comes 30 s after its SIGTERM)
catch_early()
comm = MPI.COMM_WORLD
sys.stdout.write("ready\\n"); sys.stdout.flush()  # one write: print() makes two, which the launcher can interleave
if comm.rank == 0:  # a peer that never comes: a dead node, a box whose namespaces were taken down
    time.sleep(300)
_, status = run_or_end(comm, lambda: agree_on(comm, lambda: None))
sys.exit(status)
"""


@pytest.mark.timeout(180)
def test_sigterm_ends_ranks_waiting_at_start_up_for_a_peer_that_never_comes(tmp_path):
    """Ranks in a start-up collective whose peer will not come (before: they spun in the allgather for good,
    and SIGTERM, caught to stop the run cleanly later, did nothing): a SIGTERM ends them SIGNAL_GRACE
    seconds later, with one line saying so, and the job ends. (Open MPI: the job ends, but its mpirun
    drops the ranks' output after a signal, so the line is asked of MPICH only.)"""
    script = tmp_path / "stuck.py"
    script.write_text(START_UP_STUCK)
    proc = subprocess.Popen([MPIEXEC, "-n", "3", sys.executable, str(script)],
                            env=clean_environ(PYTHONUNBUFFERED="1", **OVERSUBSCRIBE), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready = 0
        while ready < 3:  # counted in the stream, not by lines: the launcher merges the ranks' output
            line = proc.stdout.readline()
            assert line, "the job ended before every rank was ready"
            ready += line.count("ready")
        time.sleep(1.0)  # ranks 1 and 2 in the start-up wait
        t = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # as a batch system's scancel: every process of the job
        err = _ended(proc, "SIGTERM")
        assert time.monotonic() - t < 60
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    if FAMILY == "mpich":  # Open MPI's mpirun stops forwarding the ranks' output once it has a signal
        assert "SIGTERM received while rank" in err and "waited at start-up for every rank" in err, err[-3000:]


@pytest.mark.timeout(200)
def test_sigterm_ends_a_job_stuck_in_a_wait_within_the_signal_grace(tmp_path):
    """A worker hung for good (``--fault hang``) with stall limits far away: before, SIGTERM was answered with
    'stopping after the current step', which never ended, and the job lived until the stall abort (1000 s
    here). Now every watched wait ends the job SIGNAL_GRACE after the signal, with one line: 30 s, here the 5 s
    HPCPS_SIGNAL_GRACE gives (under MPICH's mpiexec, which forwards the signal, not before them; well before 30
    under either launcher: Open MPI's mpirun ends the job itself)."""
    out = tmp_path / "stuck.h5"
    proc = _start(4, tmp_path, "--paradigm", "bsp", "--steps", "400", "--compute-time", "0.005", "--out", str(out),
                  "--fault", "hang@2:20", "--stall-warn", "300", "--stall-abort", "1000",
                  env={"HPCPS_SIGNAL_GRACE": "5"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:  # until the hang has stopped the rounds
        time.sleep(1.0)
        if out.exists():
            try:
                with h5py.File(out, "r", locking=False) as f:
                    if len(f["workers/iterations"]) >= 2 * 20:
                        break
            except (OSError, KeyError):
                pass
    time.sleep(2.0)
    t = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    err = _ended(proc, "SIGTERM")
    ended = time.monotonic() - t
    assert ended < 25, f"the job ended {ended:.1f} s after SIGTERM, its grace 5 s"
    assert proc.returncode != 0
    if FAMILY == "mpich":  # Open MPI's mpirun ends the job itself on a signal, and stops forwarding output
        assert ended >= 5, f"the job ended {ended:.1f} s after SIGTERM, before its grace of 5 s"
        assert "SIGTERM received" in err and "the step under way will not end; ending the job " \
            "(HPCPS_SIGNAL_GRACE 5 s)" in err, err[-3000:]
