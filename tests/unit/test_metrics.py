"""Schema, run file round trip, summary consistency (h5py, no MPI)."""

import math
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpcps.metrics.runfile import RunFile
from hpcps.metrics.schema import EVAL, ITERATION, JOIN, LOST, SCHEMA_VERSION, SUMMARY_ATTRS, UPDATE, summarize


def _updates(rows):
    return np.array([row + (0.1, 0.0) for row in rows], dtype=UPDATE)


def test_summary_counts_each_gradient_once_over_shards():
    it = np.zeros(3, ITERATION)
    up = _updates([(0, 0, 0.1, 1, 1, 0, 0, -1, 1, 0), (1, 1, 0.1, 1, 1, 0, 0, -1, 1, 0),
                   (0, 0, 0.2, 2, 1, 1, 1, -1, 1, 0), (1, 1, 0.2, 2, 1, 1, 1, -1, 1, 0),
                   (0, 0, 0.3, 2, 2, 2, 0, -1, 0, 1), (1, 1, 0.3, 2, 2, 2, 0, -1, 0, 1)])
    ev = np.array([(0.5, 1, 1.0, 0.80), (1.0, 2, 0.5, 0.95), (1.5, 3, 0.4, 0.93)], dtype=EVAL)
    s = summarize(it, up, ev, wall_s=2.0, target=0.9)
    assert s == {"wall_s": 2.0, "gradients_pushed": 3, "gradients_applied": 2, "gradients_dropped": 1,
                 "gradients_lost": 0, "workers_lost": 0, "workers_joined": 0, "final_accuracy": 0.93,
                 "final_loss": 0.4, "time_to_target_s": 1.0}
    assert math.isnan(summarize(it, up, ev, wall_s=2.0, target=0.99)["time_to_target_s"])
    assert set(s) == set(SUMMARY_ATTRS)


def test_a_dead_workers_pushes_are_counted_from_the_shards_side():
    """Run-through: worker rank 2 died after its gradient 2 reached both shards, its gradient 3 cut off at
    both. Its one iteration row that reached rank 0 does not count; what shard 0 applied and lost of it
    does: 2 + 1, with rank 1's 2 rows."""
    it = np.zeros(3, ITERATION)
    it["rank"] = [1, 1, 2]
    up = _updates([(0, 0, 0.1, 1, 1, 0, 0, -1, 1, 0), (0, 0, 0.1, 2, 1, 1, 0, -1, 1, 0),
                   (0, 0, 0.2, 1, 2, 2, 0, -1, 1, 0), (0, 0, 0.2, 2, 2, 3, 0, -1, 1, 0)])
    lost = np.array([(0, 0, 0.3, 2, 2, 0), (0, 0, 0.3, 2, 3, 1), (1, 1, 0.3, 2, 2, 0), (1, 1, 0.3, 2, 3, 1)],
                    dtype=LOST)
    s = summarize(it, up, np.zeros(0, EVAL), wall_s=1.0, lost=lost)
    assert (s["gradients_pushed"], s["gradients_applied"], s["gradients_lost"], s["workers_lost"]) == (5, 4, 1, 1)
    assert s["gradients_pushed"] == s["gradients_applied"] + s["gradients_dropped"] + s["gradients_lost"]


def test_a_spares_pushes_are_its_own_rows_and_the_join_is_counted_once_over_shards():
    """Worker rank 2 died after its gradient 1; spare rank 3 took its place and pushed gradient 2: its row
    counts as a living worker's, the dead worker's from shard 0's side, and the join once (two shards' rows)."""
    it = np.zeros(3, ITERATION)
    it["rank"] = [1, 1, 3]
    up = _updates([(0, 0, 0.1, 1, 1, 0, 0, -1, 1, 0), (0, 0, 0.1, 2, 1, 1, 0, -1, 1, 0),
                   (0, 0, 0.2, 1, 2, 2, 0, -1, 1, 0), (0, 0, 0.3, 3, 2, 3, 0, -1, 1, 0)])
    lost = np.array([(0, 0, 0.15, 2, 1, 0), (1, 1, 0.15, 2, 1, 0)], dtype=LOST)
    joins = np.array([(0, 0, 0.16, 2, 3, 1), (1, 1, 0.17, 2, 3, 1)], dtype=JOIN)
    s = summarize(it, up, np.zeros(0, EVAL), wall_s=1.0, lost=lost, joins=joins)
    assert (s["gradients_pushed"], s["gradients_applied"], s["workers_lost"], s["workers_joined"]) == (4, 4, 1, 1)


def test_the_time_to_target_reads_any_metric_the_evaluation_returned():
    """A language model's goal is a low validation loss, not an accuracy it does not have."""
    from hpcps.metrics.schema import EVAL_METRIC
    from hpcps.options.targets import Target

    it, up = np.zeros(1, ITERATION), _updates([(0, 0, 0.1, 1, 1, 0, 0, -1, 1, 0)])
    ev = np.array([(0.5, 1, 2.0, np.nan), (1.0, 2, 1.4, np.nan), (1.5, 3, 1.2, np.nan)], dtype=EVAL)
    assert summarize(it, up, ev, wall_s=2.0, target=Target.parse("loss<=1.4"))["time_to_target_s"] == 1.0
    named = np.array([(0.5, 1, b"perplexity", 9.0), (1.5, 3, b"perplexity", 3.0)], dtype=EVAL_METRIC)
    assert summarize(it, up, ev, wall_s=2.0, target=Target.parse("perplexity<4"),
                     eval_metrics=named)["time_to_target_s"] == 1.5
    assert math.isnan(summarize(it, up, ev, wall_s=2.0, target=Target.parse("accuracy>=0.5"))["time_to_target_s"])
    with pytest.raises(ValueError, match="expected METRIC<=VALUE or METRIC>=VALUE"):
        Target.parse("loss=1")


def test_run_file_appends_in_batches_and_reads_back(tmp_path):
    path = tmp_path / "sub" / "run.h5"
    with RunFile(path, {"paradigm": "bsp", "world_size": 5}) as rf:
        rf.append("eval", np.array([(0.1, 1, 2.0, 0.5)], EVAL))
        rf.append("eval", np.array([(0.2, 2, 1.0, 0.7), (0.3, 3, 0.5, 0.9)], EVAL))
        rf.write_summary({"wall_s": 1.0})
    with h5py.File(path) as f:
        assert f.attrs["schema_version"] == SCHEMA_VERSION and f.attrs["paradigm"] == "bsp"
        assert list(f["eval"]["version"]) == [1, 2, 3]
        assert f["eval"].chunks is not None and f["eval"].maxshape == (None,)
        assert f["workers/iterations"].dtype == ITERATION and f["servers/updates"].dtype == UPDATE
        assert f["summary"].attrs["wall_s"] == 1.0


def test_a_live_run_file_reads_as_the_docs_open_it_while_its_run_writes(tmp_path):
    """docs/metrics.md opens with ``locking=False``: rank 0 holds HDF5's lock while the run writes."""
    path = tmp_path / "live.h5"
    rows = np.zeros(3, ITERATION)
    rows["step"] = [0, 1, 2]
    rf = RunFile(path, {"paradigm": "asp"})
    try:
        rf.append("workers/iterations", rows)
        rf.flush()
        def read(*how: str) -> subprocess.CompletedProcess:  # another process, as a user's analysis is
            code = f"import h5py; f = h5py.File({str(path)!r}, 'r'{''.join(how)}); print(f['workers/iterations']['step'].tolist())"
            return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

        refused = read()  # what the recipe did before
        assert refused.returncode != 0 and "lock" in refused.stderr
        live = read(", locking=False")
        assert live.returncode == 0 and live.stdout.strip() == "[0, 1, 2]", live.stderr
    finally:
        rf.close()


def test_rank_0_holds_the_rows_that_come_and_writes_each_table_once_an_interval(tmp_path):
    """Rank 0 is a shard: a write per batch as it came held its rounds up. Rows come (here from this rank
    itself, over COMM_SELF, as another rank's batches come), their watchers see them at once, and they
    reach the file in one append per table once ``interval`` has passed, or at close."""
    from mpi4py import MPI

    from hpcps.metrics.recorder import FileRecorder, ForwardingRecorder

    rf = RunFile(tmp_path / "run.h5", {"paradigm": "bsp"})
    writes = []
    append = rf.append
    rf.append = lambda table, rows: (writes.append((table, len(rows))), append(table, rows))
    sender = ForwardingRecorder(MPI.COMM_SELF, batch_rows=1)  # a batch a row, to rank 0 (itself)
    recorder = FileRecorder(MPI.COMM_SELF, rf, interval=3600.0)
    seen = []
    recorder.watchers["eval"] = [lambda rows: seen.append(rows["version"].tolist())]
    for version in (1, 2, 3):
        sender.add("eval", (0.1 * version, version, 1.0, 0.5))
    assert recorder.drain(limit=None)
    assert seen == [[1], [2], [3]] and writes == [] and len(rf.read("eval")) == 0  # seen, held
    recorder.interval = 0.0  # the interval has passed: the next drain writes what it holds
    sender.add("eval", (0.4, 4, 1.0, 0.5))
    assert recorder.drain(limit=None)
    assert writes == [("eval", 4)] and rf.read("eval")["version"].tolist() == [1, 2, 3, 4]
    recorder.interval = 3600.0
    sender.add("eval", (0.5, 5, 1.0, 0.5))  # (sent at once; no close marker: COMM_SELF has no other rank)
    recorder.close()  # every row in the file after
    assert writes == [("eval", 4), ("eval", 1)] and rf.read("eval")["version"].tolist() == [1, 2, 3, 4, 5]
    sender.flush()  # (its sends, received now, complete and are freed)
    rf.close()
