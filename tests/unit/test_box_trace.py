"""The links' trace of ``hpcps emulate --link-trace`` (:mod:`hpcps.box.trace`): what it reads and what it says,
on counters whose shape is known."""

import h5py
import numpy as np
import pytest

from hpcps.box.trace import (busy, describe, phase_row, port_files, profile_lines, read_counts, step_profile,
                             traffic_span)

RATE = 1e9  # bit/s: 125 MB/s


def test_the_ports_counters_are_read_in_the_order_asked_and_again_at_each_sample(tmp_path):
    """sysfs's layout, ``PORT/statistics/{rx,tx}_bytes``: each read is the file as it is now, from its start."""
    for port, rx, tx in (("p0", 1234567, 7654321), ("p1", 12, 34)):
        (tmp_path / port / "statistics").mkdir(parents=True)
        (tmp_path / port / "statistics" / "rx_bytes").write_text(f"{rx}\n")
        (tmp_path / port / "statistics" / "tx_bytes").write_text(f"{tx}\n")
    files = port_files(["p1", "p0"], root=str(tmp_path))
    assert read_counts(files) == [(12, 34), (1234567, 7654321)]
    (tmp_path / "p1" / "statistics" / "rx_bytes").write_text("99\n")
    assert read_counts(files) == [(99, 34), (1234567, 7654321)]
    with pytest.raises(FileNotFoundError):
        port_files(["p7"], root=str(tmp_path))


def _trace(t, received, sent, rate=RATE):
    return {"t": np.asarray(t, float), "received": np.asarray(received, np.int64).reshape(len(t), -1),
            "sent": np.asarray(sent, np.int64).reshape(len(t), -1), "rate_bps": np.array([rate])}


def test_a_link_full_half_the_time_is_half_used_and_idle_half_the_time():
    """1 s at the line rate, then 1 s with nothing: a mean of 50% and half of the 10 ms stretches idle."""
    t = np.arange(0, 2.0001, 0.001)
    count = np.where(t <= 1.0, t, 1.0) * RATE / 8
    mean, idle = busy(t, count, RATE)
    assert mean == pytest.approx(0.5, rel=1e-6)
    assert idle == pytest.approx(0.5, abs=0.011)
    assert busy(t[:1], count[:1], RATE) == (0.0, 0.0)  # nothing to say of one sample


def test_the_traffic_span_leaves_out_the_quiet_start_and_end():
    """Quiet for 1 s (the ranks' imports), 2 s of traffic at a quarter of the rate, quiet 1 s (teardown): the
    summary covers the 2 s, in which the link is a quarter used and never idle."""
    t = np.arange(0, 4.0001, 0.001)
    count = np.clip(t - 1.0, 0.0, 2.0) * RATE / 8 / 4
    trace = _trace(t, count, np.zeros_like(count))
    first, last = traffic_span(trace)
    assert first == pytest.approx(1.0, abs=0.011) and last == pytest.approx(3.0, abs=0.011)
    lines = describe(trace)
    assert lines[0].startswith("hpcps emulate: the links from their first traffic to their last (2.0 s)")
    assert lines[1] == "  node 0: 25% of its rate in, 0% out; idle (under 10%) 0% and 100% of the time, by 10 ms"


def _steps_full_for(full: float, steps: int = 10, step: float = 0.1, dt: float = 0.0005):
    """Counters sampled every ``dt`` over ``steps`` steps of ``step`` seconds, each carrying the line rate for
    its first ``full`` seconds and nothing after."""
    per = round(step / dt)
    i = np.arange(steps * per + 1)
    within = np.minimum((i % per) * dt, full)
    return i * dt, ((i // per) * full + within) * RATE / 8


def test_a_step_profile_folds_the_link_onto_the_average_step():
    """Steps of 100 ms, each with its link full for its first 40 ms and idle after: the profile in 20 ms
    columns is full, full, idle, idle, idle, whatever the steps' number; a step the trace does not cover
    whole is left out."""
    t, count = _steps_full_for(0.04)
    starts = np.arange(0.0, 1.0, 0.1) + 1e-9
    profile = step_profile(t, count, RATE, starts, 0.1, 0.02)
    assert profile == pytest.approx([1, 1, 0, 0, 0], abs=1e-6)
    assert step_profile(t, count, RATE, np.array([5.0]), 0.1, 0.02) == pytest.approx([0] * 5)


def test_the_profile_finds_each_node_s_worker_in_the_run_file(tmp_path):
    """A run file of one worker on node 1 (rank 1, host ``vm/n1``) and its shard on node 0: the profile has
    node 1's lines alone, on the worker's steps, the run's clock moved to the trace's by ``clock_start``, its
    phases (the run has a timeline) above its link's use."""
    clock_start = 1000.0
    run = tmp_path / "run.h5"
    iterations = np.zeros(10, dtype=[("rank", "i4"), ("step", "i4"), ("t_start", "f8"), ("t_end", "f8"),
                                     ("wait_s", "f8"), ("pull_s", "f8")])
    iterations["rank"], iterations["step"] = 1, np.arange(10)
    iterations["t_start"] = np.arange(10) * 0.1
    iterations["t_end"] = iterations["t_start"] + 0.1
    ranks = np.array([(0, b"server", b"vm/n0"), (1, b"worker", b"vm/n1")],
                     dtype=[("rank", "i4"), ("role", "S8"), ("host", "S16")])
    from hpcps.metrics.timeline import CODES

    timeline = np.array([(1, CODES["pull"], k, 0.1 * k, 0.1 * k + 0.04) for k in range(10)]
                        + [(1, CODES["grant"], k, 0.1 * k + 0.04, 0.1 * k + 0.1) for k in range(10)],
                        dtype=[("rank", "i4"), ("phase", "i4"), ("step", "i4"), ("t_begin", "f8"), ("t_end", "f8")])
    with h5py.File(run, "w") as f:
        f.attrs["clock_start"] = clock_start
        f.create_dataset("workers/iterations", data=iterations)
        f.create_dataset("ranks", data=ranks)
        f.create_dataset("timeline", data=timeline)
    t, into = _steps_full_for(0.04)  # full 40 ms a step
    t = t + clock_start
    quiet = np.zeros_like(into)
    trace = {"t": t, "received": np.stack([quiet, into], 1), "sent": np.stack([quiet, quiet], 1),
             "rate_bps": np.array([RATE, RATE])}
    lines = profile_lines(trace, str(run), 0.02)
    assert len(lines) == 6 and lines[2].startswith("node 1 (worker rank 1, mean step 100.0 ms"), lines
    assert lines[3].split() == ["phase", "p", "p", "g", "g", "g"], lines  # its pull is the link's 40 ms
    assert lines[4].split() == ["in", "100", "100", "0", "0", "0"], lines
    assert lines[5].split() == ["out"] + ["0"] * 5, lines


def test_the_phase_row_names_the_phase_a_worker_spends_each_column_in_most():
    """Steps of 100 ms: pulling for 25 ms, then 40 ms of emulated compute, then 35 ms waiting for the grant:
    in 20 ms columns, pull, emulated (15 of its 20 ms), emulated, grant (15 of 20), grant, whatever the
    steps' number; where no span is, "?"."""
    from hpcps.metrics.timeline import CODES

    rows = []
    for k in range(5):
        t0 = 0.1 * k
        rows += [(1, CODES["pull"], k, t0, t0 + 0.025), (1, CODES["emulated"], k, t0 + 0.025, t0 + 0.065),
                 (1, CODES["grant"], k, t0 + 0.065, t0 + 0.1)]
    spans = np.array(rows, dtype=[("rank", "i4"), ("phase", "i4"), ("step", "i4"), ("t_begin", "f8"),
                                  ("t_end", "f8")])
    assert phase_row(spans, 0.1 * np.arange(5), 0.1, 0.02) == ["p", "e", "e", "g", "g"]
    assert phase_row(spans, 0.1 * np.arange(2), 0.1, 0.02) == ["p", "e", "e", "g", "g"]
    assert phase_row(spans, np.array([5.0]), 0.1, 0.02) == ["?"] * 5
    assert phase_row(spans[:0], 0.1 * np.arange(5), 0.1, 0.02) == ["?"] * 5  # a worker with no span at all
