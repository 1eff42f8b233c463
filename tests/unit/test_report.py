"""hpcps report on synthetic run files whose numbers are known exactly (no MPI)."""

import csv
import json

import h5py
import numpy as np
import pytest

from hpcps.cli import main
from hpcps.errors import UserError
from hpcps.metrics.runfile import RunFile
from hpcps.metrics.schema import EVAL, ITERATION, JOIN, RANK, SCALAR, TRANSFER, UPDATE
from hpcps.analysis.report import Run, load_run, make_report, mean_step, places, step_means, summary_rows

PNG = b"\x89PNG\r\n\x1a\n"


def _fake_run(path, paradigm, *, accuracies, iteration_ms, wait_ms, staleness, transfers=0, ranks=False,
              cluster=None):
    """Two workers (ranks 1, 2), 10 iterations each of ``iteration_ms``; one eval every 0.1 s."""
    it = np.zeros(20, ITERATION)
    for k in range(20):
        rank, step = 1 + k % 2, k // 2
        it[k] = (rank, step, step * iteration_ms / 1e3, (step + 1) * iteration_ms / 1e3,
                 1e-3, 1e-4, 2e-4, wait_ms / 1e3, step, staleness, 0.1, 1.0, 2e-4, staleness, 0)
    up = np.zeros(20, UPDATE)
    for k in range(20):
        up[k] = (0, 0, k * 0.01, 1 + k % 2, k // 2 + 1, k, staleness, 2 + (k > 10), 1, 0, 0.1, 0.9)
    ev = np.array([(0.1 * (i + 1), i, 1.0 - a, a) for i, a in enumerate(accuracies)], EVAL)
    config = {"staleness": 2, "staleness_max": 4}
    attrs = {"paradigm": paradigm, "config": json.dumps(config),
             **({"cluster": json.dumps(cluster)} if cluster is not None else {})}
    with RunFile(path, attrs) as rf:
        rf.append("workers/iterations", it)
        rf.append("servers/updates", up)
        rf.append("eval", ev)
        if transfers:  # one worker after the other into shard 0, 1 ms each
            rf.append("servers/transfers", np.array([(0, 0, 1 + k % 2, k * 1e-3, (k + 1) * 1e-3)
                                                     for k in range(transfers)], TRANSFER))
        if ranks:
            rf.append("ranks", np.array([(0, b"server", b"node-a", 300 * 2 ** 20, 0, 0.0, 0.0, b"cpu"),
                                         (2, b"worker", b"node-b", 200 * 2 ** 20, 640, 1.5e-3, 2e-5, b"cuda:1"),
                                         (1, b"worker", b"node-a", 100 * 2 ** 20, 640, 0.0, 0.0, b"cuda:0")], RANK))
        rf.write_summary({"wall_s": 1.0, "final_accuracy": accuracies[-1], "gradients_applied": 20,
                          "stopped_by": "SIGUSR1" if ranks else ""})
    return path


@pytest.fixture
def runs(tmp_path):
    return [
        _fake_run(tmp_path / "a-bsp.h5", "bsp", accuracies=[0.5, 0.8, 0.91, 0.95], iteration_ms=50, wait_ms=4,
                  staleness=0, ranks=True),
        _fake_run(tmp_path / "b-dssp.h5", "dssp", accuracies=[0.7, 0.92, 0.93], iteration_ms=20, wait_ms=1,
                  staleness=3, cluster={"emulated": True, "nodes": 3, "link_bps": [4e9, 1e9, 1e9],
                                        "ranks_per_node": [1, 1, 1], "node_of_rank": [0, 1, 2],
                                        "buffer_bytes": 64000}),
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
    assert bsp["cluster"] == "-"  # a real cluster: nothing emulated
    assert dssp["cluster"] == ("3 nodes (node 0 at 4 Gbit/s, nodes 1-2 at 1 Gbit/s), 3 ranks (1/1/1 per node), "
                               "switch buffer 64,000 bytes per port")


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
    assert [r["device"] for r in ranks] == ["cpu", "cuda:0", "cuda:1"]


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

    code = ("import sys, hpcps.analysis.report, hpcps.cli, hpcps.metrics.runfile, hpcps.metrics.schema, hpcps.policies; "
            "sys.exit('mpi4py' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@pytest.fixture
def figures(monkeypatch):
    """The figures the plots would save, kept open for inspection."""
    import hpcps.analysis.report

    kept = {}

    def keep(plt, fig, path):
        fig.canvas.draw()
        kept[path.name] = fig
        return path

    monkeypatch.setattr(hpcps.analysis.report, "_save", keep)
    yield kept
    import matplotlib.pyplot as plt
    for fig in kept.values():
        plt.close(fig)


def _run_with(name, ranks, *, slowdown=None, staleness=(0,)):
    it = np.zeros(2 * len(ranks), ITERATION)
    for k in range(len(it)):
        it[k]["rank"], it[k]["step"], it[k]["t_end"] = ranks[k % len(ranks)], k // len(ranks), 0.1 * (k + 1)
    up = np.zeros(len(staleness), UPDATE)
    up["staleness"], up["applied"] = staleness, 1
    return Run(name=name, paradigm=name, config={"slowdown": slowdown or {}}, iterations=it, updates=up,
               evals=np.zeros(0, EVAL), summary={})


def test_throughput_labels_each_runs_bars_with_its_own_ranks_and_marks_the_straggler(figures, tmp_path):
    from hpcps.analysis.report import plot_throughput

    runs = [_run_with("bsp", [1, 2, 3, 4]), _run_with("grouped", [3, 4, 5, 6], slowdown={"6": 3.0})]
    plot_throughput(runs, tmp_path)
    ax = figures["throughput.png"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "3", "4", "3", "4", "5", "6"]
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_x() > ax.patches[4].get_x()  # the grouped run's last bar
    assert [t.get_text() for t in ax.texts] == ["3x slower"]


def test_staleness_is_one_filled_bar_per_run_in_shared_bins(figures, tmp_path):
    from hpcps.analysis.report import plot_staleness

    plot_staleness([_run_with("asp", [1], staleness=(0, 2, 2, 3)), _run_with("ssp", [1], staleness=(1, 1))],
                   tmp_path)
    ax = figures["staleness.png"].axes[0]
    bars = ax.patches
    assert len(bars) == 2 * 4 and all(b.get_fill() for b in bars)  # staleness 0..3, two runs each
    heights = [round(b.get_height(), 3) for b in bars]
    assert heights == [0.25, 0.0, 0.5, 0.25, 0.0, 1.0, 0.0, 0.0]
    assert len({round(b.get_x(), 6) for b in bars}) == 8  # side by side, nothing drawn over another


def test_threshold_labels_sit_outside_the_axes_clear_of_the_lines(figures, runs, tmp_path):
    from hpcps.analysis.report import plot_thresholds

    plot_thresholds([load_run(p) for p in runs], tmp_path)
    ax = figures["thresholds.png"].axes[0]
    labels = [t for t in ax.texts if t.get_text().startswith(("s_lo", "s_hi"))]
    assert [t.get_text() for t in labels] == ["s_lo = 2", "s_hi = 4"]
    assert all(t.get_position()[0] > 1.0 for t in labels)  # axes coordinates: right of the plot area


def test_simulator_lines_differ_in_marker_and_style_and_the_axis_names_the_worker_counts(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from unittest import mock

    from hpcps.analysis.simulate import Prediction, write_outputs

    preds = [Prediction(p, n, 100 * n, 1.0, 0.0, 0.0, {w: 100.0 for w in range(n)})
             for p in ("bsp", "asp", "ssp", "eager") for n in (4, 16, 64)]
    with mock.patch("hpcps.analysis.report._save", side_effect=lambda plt, fig, path: (fig.canvas.draw(), fig)[1]):
        fig = write_outputs(preds, tmp_path, "9,610 parameters, straggler 3x")[1]
    ax = fig.axes[0]
    styles = {(line.get_marker(), line.get_linestyle()) for line in ax.get_lines()}
    assert len(styles) == 4  # identical throughputs, yet every line distinguishable
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "16", "64"]
    assert "straggler 3x" in ax.get_title()


def test_the_clock_gap_comes_from_the_timestamps_alone():
    """Worker 1 starts step 3 at t=1.0, when worker 2 has 1 gradient applied: a lead of 2. Worker 2's own
    starts see worker 1 ahead, never behind; a worker that finished all its steps no longer holds others."""
    from hpcps.metrics.schema import ITERATION, UPDATE
    from hpcps.analysis.report import max_clock_gap

    it = np.zeros(5, ITERATION)
    it["rank"], it["step"] = [1, 1, 1, 1, 2], [0, 1, 2, 3, 1]
    it["t_start"] = [0.0, 0.3, 0.6, 1.0, 0.5]
    up = np.zeros(4, UPDATE)
    up["worker"], up["t"] = [1, 1, 2, 1], [0.2, 0.5, 0.4, 0.9]
    assert max_clock_gap(it, up, steps=10) == 2
    # with 1 step each, worker 2 is done once its gradient is in (t=0.4): only before that does it hold
    # worker 1 back (step 1 at t=0.3: a lead of 1)
    assert max_clock_gap(it, up, steps=1) == 1


def test_a_run_that_never_wrote_its_summary_is_not_shown_as_a_finished_one(runs, tmp_path):
    with h5py.File(runs[1], "a") as f:  # as a crashed or killed run leaves it: the group, no attributes
        for key in list(f["summary"].attrs):
            del f["summary"].attrs[key]
    table = summary_rows([load_run(p) for p in runs], 0.9)
    assert [r["stopped_by"] for r in table] == ["SIGUSR1", "no summary (crashed?)", "-"]


def test_the_loops_own_numbers_are_plotted_and_tabled_and_no_evaluation_is_not_never(tmp_path):
    """A step-API run: no evaluation (no test data), the loop logged val_loss per worker with ps.log."""
    path = tmp_path / "loop.h5"
    it = np.zeros(4, ITERATION)
    for k in range(4):
        it[k]["rank"], it[k]["step"], it[k]["t_start"], it[k]["t_end"] = 1 + k % 2, k // 2, k * 0.1, k * 0.1 + 0.1
    scalars = np.array([(1, 0, 0.1, b"val_loss", 2.0), (2, 0, 0.12, b"val_loss", 2.2), (1, 1, 0.3, b"val_loss", 1.5),
                        (2, 1, 0.31, b"val_loss", 1.7), (1, 1, 0.32, b"lr", 0.01)], SCALAR)
    with RunFile(path, {"paradigm": "bsp", "config": "{}"}) as rf:
        rf.append("workers/iterations", it)
        rf.append("workers/scalars", scalars)
        rf.write_summary({"wall_s": 0.5, "gradients_applied": 4, "stopped_by": "loop: plateau"})
    out = tmp_path / "report"
    written = {p.name for p in make_report([str(path)], out)}
    assert {"scalars.png", "scalars.md", "scalars.csv"} <= written
    assert (out / "scalars.png").read_bytes()[:8] == PNG
    with open(out / "scalars.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["name"], r["count"], r["first"], r["last"], r["min"], r["max"]) for r in rows] == [
        ("val_loss", "4", "2.0", "1.7", "1.5", "2.2"), ("lr", "1", "0.01", "0.01", "0.01", "0.01")]
    summary = (out / "summary.md").read_text()
    assert "never" not in summary and "loop: plateau" in summary
    with open(out / "summary.csv") as f:
        row = next(csv.DictReader(f))
    assert (row["time_to_0.9_s"], row["final_accuracy"], row["final_loss"]) == ("-", "-", "-")


def test_a_run_that_went_on_without_a_dead_worker_says_so_and_an_older_file_says_none(runs, tmp_path):
    with h5py.File(runs[0], "a") as f:  # as run-through writes it (the others predate schema 9: no such attrs)
        f["summary"].attrs["workers_lost"], f["summary"].attrs["gradients_lost"] = 1, 2
        f["summary"].attrs["workers_joined"] = 1  # a spare took its place (schema 10)
    table = summary_rows([load_run(p) for p in runs], 0.9)
    assert [(r["workers_lost"], r["gradients_lost"], r["workers_joined"]) for r in table] == [
        (1, 2, 1), (0, 0, 0), (0, 0, 0)]


def test_local_steps_name_the_overlap_where_a_run_had_one(runs):
    """``local_steps``: H, or "H, T overlapped" under --overlap-steps T, "-" without local steps."""
    for path, config in zip(runs, [{"local_steps": 32, "overlap_steps": 24}, {"local_steps": 8, "overlap_steps": 0},
                                   {}]):
        with h5py.File(path, "a") as f:
            f.attrs["config"] = json.dumps(config)
    table = summary_rows([load_run(p) for p in runs], 0.9)
    assert [r["local_steps"] for r in table] == ["32, 24 overlapped", 8, "-"]


def test_a_spare_in_a_dead_workers_place_is_not_another_worker(tmp_path):
    """``workers`` counts places, not ranks with rows: worker rank 2 died after 2 iterations, spare rank 3 took
    its place for 3 more, and the run had 2 workers; the place's rate is its 5 rows over the time to its last.
    A spare that dies in its turn passes the place on (rank 4 after rank 3: still rank 2's place)."""
    rows = [(1, k, 0.1 * (k + 1)) for k in range(5)] + [(2, 0, 0.1), (2, 1, 0.2), (3, 2, 0.6), (3, 3, 0.7),
                                                          (3, 4, 0.8)]
    it = np.zeros(len(rows), ITERATION)
    for k, (rank, step, t_end) in enumerate(rows):
        it[k]["rank"], it[k]["step"], it[k]["t_end"] = rank, step, t_end
    joins = np.array([(0, 0, 0.4, 2, 3, 2), (5, 1, 0.4, 2, 3, 2)], JOIN)  # one row per shard
    run = Run(name="r", paradigm="asp", config={}, iterations=it, updates=np.zeros(0, UPDATE),
              evals=np.zeros(0, EVAL), summary={}, joins=joins)
    row = summary_rows([run], 0.9)[0]
    assert row["workers"] == 2
    assert row["iterations_per_s_per_worker"] == round((5 / 0.5 + 5 / 0.8) / 2, 1)
    assert places(np.array([(0, 0, 0.4, 2, 3, 2), (0, 0, 0.9, 3, 4, 4)], JOIN)) == {3: 2, 4: 2}
    path = tmp_path / "r.h5"  # and from a file: the joins are read with the rest
    with RunFile(path, {"paradigm": "asp", "config": "{}"}) as rf:
        rf.append("workers/iterations", it)
        rf.append("servers/updates", np.zeros(0, UPDATE))
        rf.append("eval", np.zeros(0, EVAL))
        rf.append("servers/joins", joins)
    assert summary_rows([load_run(path)], 0.9)[0]["workers"] == 2


def test_the_mean_step_is_the_slowest_workers_wall_time_over_its_timed_steps():
    """Worker 1: 8 steps of 10 ms back to back, the first two 50 ms (start-up); worker 2: 8 steps of 12 ms.
    All steps: (2 x 50 + 6 x 10) / 8 = 20 ms against 12 ms; two steps of warm-up left out: 10 against 12."""
    it = np.zeros(16, ITERATION)
    for i, (rank, times) in enumerate([(1, [0.05, 0.05] + [0.01] * 6), (2, [0.012] * 8)]):
        ends = np.cumsum(times)
        rows = it[8 * i:8 * i + 8]
        rows["rank"], rows["step"], rows["t_start"], rows["t_end"] = rank, np.arange(8), ends - times, ends
        it[8 * i:8 * i + 8] = rows
    shuffled = it[np.random.default_rng(0).permutation(16)]  # rows as they come, in no order
    assert mean_step(shuffled) == pytest.approx(0.020)
    assert mean_step(shuffled, warmup=2) == pytest.approx(0.012)
    assert mean_step(shuffled, warmup=5) == pytest.approx(0.012)  # (at most a quarter: 2 of 8 left out)
    assert step_means(shuffled, warmup=2) == pytest.approx({1: 0.010, 2: 0.012})


def test_a_trials_measure_counts_every_workers_batches_a_second_and_the_applied_gradients_staleness(tmp_path):
    """--paradigm auto's measure of a trial (hpcps.runtime.tune.paradigm_trial): workers of 10 and 30 ms
    steps train 1/0.01 + 1/0.03 = 133.3 batches a second (under 4 local steps a row, 4x that); the
    slowest's step is the mean step; the dropped gradient's staleness is not counted."""
    from hpcps.runtime.tune import WARMUP_STEPS, paradigm_trial

    it = np.zeros(40, ITERATION)
    for i, (rank, step_s) in enumerate([(1, 0.01), (2, 0.03)]):
        rows = it[20 * i:20 * i + 20]
        rows["rank"], rows["step"] = rank, np.arange(20)
        rows["t_start"], rows["t_end"] = np.arange(20) * step_s, np.arange(1, 21) * step_s
        it[20 * i:20 * i + 20] = rows
    up = np.zeros(4, UPDATE)
    up["shard"], up["staleness"], up["applied"] = [0, 0, 0, 1], [1, 2, 9, 7], [1, 1, 0, 1]
    path = tmp_path / "trial.h5"
    with RunFile(path, {"paradigm": "asp", "config": "{}"}) as rf:
        rf.append("workers/iterations", it)
        rf.append("servers/updates", up)
        rf.write_summary({"stopped_by": "diverged"})
    assert WARMUP_STEPS == 5
    t = paradigm_trial(str(path), "asp", 1)
    assert (t.paradigm, t.workers, t.staleness, t.stopped_by) == ("asp", 2, 1.5, "diverged")
    assert t.batches_per_s == pytest.approx(1 / 0.01 + 1 / 0.03) and t.mean_step_s == pytest.approx(0.03)
    local = paradigm_trial(str(path), "asp", 4)
    assert local.batches_per_s == pytest.approx(4 * t.batches_per_s) and local.mean_step_s == pytest.approx(0.03 / 4)
