"""Every benchmark in tools/ starts and explains itself (``--help``), so a broken import shows in CI."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.parametrize("script", sorted(p.name for p in TOOLS.glob("bench_*.py")))
def test_benchmark_help(script):
    proc = subprocess.run([sys.executable, str(TOOLS / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=TOOLS)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_the_policy_benchmark_runs_every_paradigm_to_the_end():
    """Small sizes: every simulated worker pushes all its gradients (a policy that never granted would
    leave the loop with events missing and the push count short), and the table has every row."""
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_policies
    finally:
        sys.path.remove(str(TOOLS))
    for paradigm in bench_policies.PARADIGMS:
        assert bench_policies.cost_per_push(paradigm, 8, 3) > 0
    proc = subprocess.run([sys.executable, str(TOOLS / "bench_policies.py"), "--workers", "4", "16", "--pushes", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ")][1:] == \
        list(bench_policies.PARADIGMS)


def test_the_bound_of_a_step_is_compute_plus_what_cannot_overlap_it():
    """bench_allreduce's bounds, closed form: 4 nodes at 1 Gbit/s, a 4 MB model: each phase carries 3/4 of it,
    24 ms at the line rate; 60 ms of compute, 20 in the forward pass and 30 in backward, 10 before them."""
    sys.path.insert(0, str(TOOLS))
    try:
        from bench_allreduce import step_bounds
    finally:
        sys.path.remove(str(TOOLS))
    b = step_bounds(0.060, 1 / 3, 0.5, 4_000_000, 4, 1e9)
    assert b["bsp"] == pytest.approx(0.010 + 0.030 + 0.024)  # the push hides in backward; the pull 20 of 24 ms
    assert b["allreduce"] == pytest.approx(0.030 + 0.048)  # 48 ms of reduction after backward began
    # compute-bound: nothing left to overlap
    assert step_bounds(1.0, 0.3, 0.6, 4_000_000, 4, 1e9)["bsp"] == pytest.approx(1.0)


def test_bench_paradigms_takes_an_accuracy_or_a_loss_as_its_target():
    """A number is an accuracy to reach; ``loss<=V`` a loss (a language model's evaluation has no accuracy);
    a metric the evaluation's table lacks is refused by name."""
    sys.path.insert(0, str(TOOLS))
    try:
        from bench_paradigms import goal, label
    finally:
        sys.path.remove(str(TOOLS))
    import argparse
    accuracy, loss = goal("0.85"), goal("loss<=2.5")
    assert (label(accuracy), label(loss)) == ("85%", "loss 2.5")
    t = np.array([1.0, 2.0, 3.0])
    assert loss.first_time(t, np.array([3.1, 2.5, 2.4])) == 2.0
    assert accuracy.first_time(t, np.array([0.5, 0.84, 0.86])) == 3.0
    with pytest.raises(argparse.ArgumentTypeError, match="val_bpc"):
        goal("val_bpc<=1.2")
    with pytest.raises(argparse.ArgumentTypeError, match="expected METRIC"):
        goal("loss=2")


def test_bench_paradigms_layout_is_a_name_and_the_options_its_runs_add():
    """``--layout NAME=OPTIONS``: the options split as a shell splits them; a spec without a name or options is
    refused with an example."""
    sys.path.insert(0, str(TOOLS))
    try:
        from bench_paradigms import layout
    finally:
        sys.path.remove(str(TOOLS))
    import argparse
    assert layout("reads 1 MB=--pull get --partition-mb 1") == ("reads 1 MB", ["--pull", "get", "--partition-mb", "1"])
    assert layout("a=--x 'b=c d'") == ("a", ["--x", "b=c d"])
    for bad in ("--pull get", "=--pull get", "reads=", "reads=  "):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=OPTIONS"):
            layout(bad)
    # two layouts of one name would write one row over the other: refused before any run
    twice = subprocess.run([sys.executable, str(TOOLS / "bench_paradigms.py"), "--paradigms", "bsp",
                            "--layout", "a=--pull get", "--layout", "a=--pull send", "--layout", "b=--servers 1"],
                           capture_output=True, text=True, timeout=120)
    assert twice.returncode == 2 and "--layout names ['a'] twice" in twice.stderr, twice.stderr


def test_bench_peers_reads_torchft_events_in_closed_form():
    """bench_peers' torchft figures from a synthetic job: 3 replicas let go at t=100, a step every 0.1 s;
    replica 2 killed at 105.05; replicas 0 and 1 throw away one step each and commit again at 106.2 and 106.3;
    the replacement, relaunched at 105.1, throws its first step away and commits its second at 109.1."""
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_peers
    finally:
        sys.path.remove(str(TOOLS))

    def step(replica, t, committed=True, participants=3):
        return {"event": "step", "replica": replica, "t": t, "committed": committed, "participants": participants}
    evs = [step(r, 100 + 0.1 * k) for k in range(1, 51) for r in range(3)]
    evs += [{"event": "kill", "replica": 2, "t": 105.05}, step(0, 105.2, False), step(1, 105.2, False),
            step(0, 106.2, participants=2), step(1, 106.3, participants=2),
            step(2, 108.0, False), step(2, 109.1), step(0, 120.0), step(1, 120.0),
            {"event": "end", "replica": 0, "t": 120.1, "test_loss": 0.5}]
    out = bench_peers.torchft_figures(evs, bench_peers.Outcome(), 2, 100.0, 105.1, steps=100)
    assert out.step_s == pytest.approx(0.2)  # (120 - 100) / 100
    assert out.recovery_s == pytest.approx(106.3 - 105.05)  # every survivor's next committed step
    assert out.thrown == 2
    assert out.rejoin_s == pytest.approx(109.1 - 105.1)  # the replacement's first step with a peer
    assert out.loss == 0.5
    clean = bench_peers.torchft_figures(evs[:150], bench_peers.Outcome(), None, 100.0, None, steps=50)
    assert clean.step_s == pytest.approx(0.1) and np.isnan(clean.recovery_s) and np.isnan(clean.rejoin_s)


def test_bench_peers_starts_torchfts_processes_on_their_nodes_in_a_box():
    """With ``--box`` a torchft process runs inside its node's namespace, gloo on the node's interface, and
    is reached at the node's address; without, as it is, at 127.0.0.1. The launcher of hpcps's runs is
    ``hpcps emulate`` (with ``--ulfm`` for a run through), one node a rank."""
    import argparse

    from hpcps.box.spec import NODE_IFACE, make_cluster

    sys.path.insert(0, str(TOOLS))
    try:
        import bench_peers
    finally:
        sys.path.remove(str(TOOLS))
    cluster = make_cluster(5, ["1gbit"], buffer="512kb", prefix="hpcps42-")
    boxed, here = bench_peers.Nodes(cluster), bench_peers.Nodes()
    assert boxed.argv(3, ["python", "r.py"]) == ["ip", "netns", "exec", "hpcps42-n3", "env",
                                                 f"GLOO_SOCKET_IFNAME={NODE_IFACE}", "python", "r.py"]
    assert boxed.address(3) == cluster.address(3) != boxed.address(0)
    assert here.argv(3, ["python", "r.py"]) == ["python", "r.py"] and here.address(3) == "127.0.0.1"
    args = argparse.Namespace(box=True, link="100mbit", buffer="1mb")
    assert bench_peers.launcher(args, 6, ulfm=True)[2:] == ["hpcps", "emulate", "--ulfm", "--nodes", "6", "--link",
                                                             "100mbit", "--buffer", "1mb", "--"]
    assert "--ulfm" not in bench_peers.launcher(args, 5, ulfm=False)


def test_gloo_meets_at_node_0_on_the_nodes_link_in_a_box_and_on_loopback_elsewhere(monkeypatch):
    """benchlib.gloo_addresses, for every gloo group and torchft replica of the benchmarks: in a box each process
    listens at its node's address with gloo on the node's interface (it would pick another alone)."""
    sys.path.insert(0, str(TOOLS))
    try:
        from benchlib import box_node, gloo_addresses
    finally:
        sys.path.remove(str(TOOLS))
    from hpcps.box.spec import NODE_IFACE, Cluster

    monkeypatch.delenv("HPCPS_NODE", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert box_node() is None and gloo_addresses() == ("127.0.0.1", "127.0.0.1")
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("HPCPS_NODE", "3")
    assert box_node() == 3 and gloo_addresses() == (Cluster.address(3), Cluster.address(0))
    assert os.environ["GLOO_SOCKET_IFNAME"] == NODE_IFACE
    assert Cluster.address(3) != Cluster.address(0)


def test_a_benchmarks_failed_job_says_its_last_lines_on_stderr_not_only_its_exit_status():
    """benchlib.run_quietly: a job that ends non-zero raises RunFailed (still a CalledProcessError, which
    bench_gpu catches), and its message carries the job's last lines on stderr, its own error among them."""
    sys.path.insert(0, str(TOOLS))
    try:
        from benchlib import RunFailed, run_quietly
    finally:
        sys.path.remove(str(TOOLS))
    script = "import sys; print('ignored'); [print(f'line {i}', file=sys.stderr) for i in range(30)]; sys.exit(3)"
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_quietly([sys.executable, "-c", script], dict(os.environ), 60)
    said = str(failed.value)
    assert isinstance(failed.value, RunFailed) and failed.value.returncode == 3
    status, tail = said.split(" Its last lines on stderr:\n")
    assert status.endswith("exit status 3.") and tail == "\n".join(f"line {i}" for i in range(10, 30))
    with pytest.raises(RunFailed, match="It wrote nothing to stderr"):
        run_quietly([sys.executable, "-c", "raise SystemExit(2)"], dict(os.environ), 60)
    run_quietly([sys.executable, "-c", "pass"], dict(os.environ), 60)  # (a job that ends well: no error)


def test_a_diverged_run_is_a_row_of_bench_paradigms_and_any_other_failure_ends_it(tmp_path, monkeypatch):
    """benchlib.train(diverged_ok=True): a job that exits 3 with a run file saying ``stopped_by = diverged``
    is read as the others are (bench_paradigms' row then says which seeds diverged, their final figures
    left out); exit 3 without that file, or another exit status, or without ``diverged_ok``, still raises."""
    import h5py

    sys.path.insert(0, str(TOOLS))
    try:
        import benchlib
        from bench_paradigms import stopped_note
    finally:
        sys.path.remove(str(TOOLS))
    out = tmp_path / "run.h5"
    with h5py.File(out, "w") as f:
        f.attrs.update(world_size=3, paradigm="ssp", start_time="2026-12-04T20:40:00")
        f["workers/iterations"] = np.zeros(2, [("step", "i8")])
        f["servers/updates"] = np.zeros(2, [("version", "i8")])
        f["eval"] = np.zeros(1, [("t", "f8"), ("loss", "f8")])
        f.create_group("summary").attrs["stopped_by"] = "diverged"

    def exits(status):
        def run_quietly(cmd, env, timeout):
            raise benchlib.RunFailed(status, cmd, None, b"training diverged")
        monkeypatch.setattr(benchlib, "run_quietly", run_quietly)

    exits(3)
    assert benchlib.train(3, out, [], diverged_ok=True)["summary"]["stopped_by"] == "diverged"
    with pytest.raises(benchlib.RunFailed):
        benchlib.train(3, out, [])  # (not asked for)
    with pytest.raises(benchlib.RunFailed):
        benchlib.train(3, tmp_path / "none.h5", [], diverged_ok=True)  # (no file says why)
    exits(1)
    with pytest.raises(benchlib.RunFailed):
        benchlib.train(3, out, [], diverged_ok=True)
    runs = [{"stopped": ""}, {"stopped": "diverged"}, {"stopped": "diverged"}]
    assert stopped_note(runs, [0, 1, 2]) == " (diverged: seeds 1, 2)"
    assert stopped_note(runs[:2], [4, 5]) == " (diverged: seed 5)" and stopped_note(runs[:1], [0]) == ""
