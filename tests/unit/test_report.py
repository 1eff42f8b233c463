"""hpcps report on synthetic run files whose numbers are known exactly (no MPI)."""

import csv
import json

import numpy as np
import pytest

from hpcps.cli import main
from hpcps.errors import UserError
from hpcps.metrics.runfile import RunFile
from hpcps.metrics.schema import EVAL, ITERATION, RANK, TRANSFER, UPDATE
from hpcps.report import load_run, make_report, summary_rows

PNG = b"\x89PNG\r\n\x1a\n"


def _fake_run(path, paradigm, *, accuracies, iteration_ms, wait_ms, staleness, transfers=0, ranks=False):
    """Two workers (ranks 1, 2), 10 iterations each of ``iteration_ms``; one eval every 0.1 s."""
    it = np.zeros(20, ITERATION)
    for k in range(20):
        rank, step = 1 + k % 2, k // 2
        it[k] = (rank, step, step * iteration_ms / 1e3, (step + 1) * iteration_ms / 1e3,
                 1e-3, 1e-4, 2e-4, wait_ms / 1e3, step, staleness, 0.1, 1.0, 2e-4, staleness, 0)
    up = np.zeros(20, UPDATE)
    for k in range(20):
        up[k] = (0, 0, k * 0.01, 1 + k % 2, k // 2 + 1, k, staleness, 2 + (k > 10), 1, 0)
    ev = np.array([(0.1 * (i + 1), i, 1.0 - a, a) for i, a in enumerate(accuracies)], EVAL)
    config = {"staleness": 2, "staleness_max": 4}
    with RunFile(path, {"paradigm": paradigm, "config": json.dumps(config)}) as rf:
        rf.append("workers/iterations", it)
        rf.append("servers/updates", up)
        rf.append("eval", ev)
        if transfers:  # one worker after the other into shard 0, 1 ms each
            rf.append("servers/transfers", np.array([(0, 0, 1 + k % 2, k * 1e-3, (k + 1) * 1e-3)
                                                     for k in range(transfers)], TRANSFER))
        if ranks:
            rf.append("ranks", np.array([(0, b"server", b"node-a", 300 * 2 ** 20, 0, 0.0, 0.0),
                                         (2, b"worker", b"node-b", 200 * 2 ** 20, 640, 1.5e-3, 2e-5),
                                         (1, b"worker", b"node-a", 100 * 2 ** 20, 640, 0.0, 0.0)], RANK))
        rf.write_summary({"wall_s": 1.0, "final_accuracy": accuracies[-1], "gradients_applied": 20,
                          "stopped_by": "SIGUSR1" if ranks else ""})
    return path


@pytest.fixture
def runs(tmp_path):
    return [
        _fake_run(tmp_path / "a-bsp.h5", "bsp", accuracies=[0.5, 0.8, 0.91, 0.95], iteration_ms=50, wait_ms=4,
                  staleness=0, ranks=True),
        _fake_run(tmp_path / "b-dssp.h5", "dssp", accuracies=[0.7, 0.92, 0.93], iteration_ms=20, wait_ms=1,
                  staleness=3),
        _fake_run(tmp_path / "c-hsp.h5", "hsp", accuracies=[0.6, 0.85, 0.9], iteration_ms=30, wait_ms=2,
                  staleness=1, transfers=20),
    ]


def test_table_numbers_follow_from_the_files(runs):
    rows = summary_rows([load_run(p) for p in runs], target=0.9)
    bsp, dssp, _ = rows
    assert bsp["time_to_0.9_s"] == pytest.approx(0.3) and dssp["time_to_0.9_s"] == pytest.approx(0.2)
    assert bsp["iterations_per_s_per_worker"] == pytest.approx(20.0)  # 10 iterations in 0.5 s
    assert dssp["iterations_per_s_per_worker"] == pytest.approx(50.0)
    assert (bsp["mean_wait_ms"], dssp["mean_wait_ms"]) == (pytest.approx(4.0), pytest.approx(1.0))
    assert (bsp["mean_staleness"], dssp["mean_staleness"]) == (0.0, 3.0)
    assert np.isnan(summary_rows([load_run(runs[0])], target=0.99)[0]["time_to_0.99_s"])


def test_report_writes_every_plot_and_both_tables(runs, tmp_path):
    out = tmp_path / "report"
    written = make_report([str(p) for p in runs], out, target=0.9)
    names = sorted(p.name for p in written)
    assert names == ["accuracy.png", "breakdown.png", "ranks.csv", "ranks.md", "staleness.png", "summary.csv",
                     "summary.md", "thresholds.png", "throughput.png", "transfers.png"]
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000
    with open(out / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["paradigm"] for r in table] == ["bsp", "dssp", "hsp"]
    assert "| b-dssp | dssp | 2 | 0.2 |" in (out / "summary.md").read_text()
    assert [r["stopped_by"] for r in table] == ["SIGUSR1", "-", "-"]
    with open(out / "ranks.csv") as f:
        ranks = list(csv.DictReader(f))  # only the run that has a /ranks table, in rank order
    assert [(r["run"], r["rank"], r["role"], r["host"], r["peak_rss_mb"]) for r in ranks] == [
        ("a-bsp", "0", "server", "node-a", "300.0"), ("a-bsp", "1", "worker", "node-a", "100.0"),
        ("a-bsp", "2", "worker", "node-b", "200.0")]
    assert ranks[2]["clock_offset_ms"] == "1.5" and ranks[2]["samples_read"] == "640"


def test_no_thresholds_or_transfers_plot_without_a_dssp_or_hsp_run(runs, tmp_path):
    written = make_report([str(runs[0])], tmp_path / "r")
    assert not {"thresholds.png", "transfers.png"} & {p.name for p in written}


def test_cli_report_and_its_errors(runs, tmp_path, capsys):
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "cli")]) == 0
    assert "accuracy.png" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing.h5"), "--out", str(tmp_path / "x")]) == 2
    assert "missing.h5: no such file" in capsys.readouterr().err
    junk = tmp_path / "junk.h5"
    junk.write_text("nope")
    with pytest.raises(UserError, match="not an hpcps metrics file"):
        load_run(junk)


def test_offline_tools_never_import_mpi():
    import subprocess
    import sys

    code = ("import sys, hpcps.report, hpcps.cli, hpcps.metrics.runfile, hpcps.metrics.schema, hpcps.policies; "
            "sys.exit('mpi4py' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
