"""The phase timeline: spans that tile a rank's time, and the report's readings of them."""

import json

import numpy as np

from hpcps.analysis.timeline import chrome_trace, explained, phase_totals, window
from hpcps.metrics.schema import TIMELINE
from hpcps.metrics.timeline import CODES, NullTimeline, Timeline


def _record(marks, end):
    """Drive a timeline through ``marks`` ((time, phase) or (time, "at", step)) and close it at ``end``."""
    rows, now = [], [0.0]
    tl = Timeline(7, lambda table, row: rows.append((table, row)), lambda: now[0])
    for mark in marks:
        now[0] = mark[0]
        if mark[1] == "at":
            tl.at(mark[2])
        else:
            tl.enter(mark[1])
    now[0] = end
    tl.close()
    return rows


def test_spans_tile_the_time_and_repeated_phases_make_one_span():
    rows = _record([(1.0, "wait"), (2.0, "wait"), (2.5, "receive"), (3.0, "at", 4), (3.0, "step"),
                    (3.5, "step"), (4.0, "wait")], end=6.0)
    assert [table for table, _ in rows] == ["timeline"] * 4
    spans = [row for _, row in rows]
    assert spans == [(7, CODES["wait"], 0, 1.0, 2.5), (7, CODES["receive"], 0, 2.5, 3.0),
                     (7, CODES["step"], 4, 3.0, 4.0), (7, CODES["wait"], 4, 4.0, 6.0)]


def test_an_explicit_time_closes_the_span_there_and_empty_spans_are_not_kept():
    rows, now = [], [5.0]
    tl = Timeline(0, lambda table, row: rows.append(row), lambda: now[0])
    tl.enter("wait", 1.0)
    tl.enter("receive", 3.0)  # the poll began at 3 and completed something
    tl.enter("other", 3.0)  # nothing between: no span
    tl.close()
    assert rows == [(0, CODES["wait"], 0, 1.0, 3.0), (0, CODES["other"], 0, 3.0, 5.0)]


def test_a_phase_within_another_returns_to_it_after_the_block():
    rows, now = [], [0.0]
    tl = Timeline(0, lambda table, row: rows.append(row), lambda: now[0])
    tl.enter("compute")
    now[0] = 1.0
    with tl.within("pull"):  # a layer waits for its parameters inside the pass
        now[0] = 1.5
    now[0] = 2.0
    tl.close()
    assert rows == [(0, CODES["compute"], 0, 0.0, 1.0), (0, CODES["pull"], 0, 1.0, 1.5),
                    (0, CODES["compute"], 0, 1.5, 2.0)]
    with NullTimeline().within("pull"):  # and without the timeline, nothing
        pass


def test_a_run_without_the_timeline_records_nothing():
    tl = NullTimeline()
    tl.at(3)
    tl.enter("compute")
    tl.close()
    assert not tl.enabled


def _spans(rows):
    return np.array([(r, CODES[p], s, a, b) for r, p, s, a, b in rows], dtype=TIMELINE)


def test_phase_totals_and_what_the_named_phases_explain():
    spans = _spans([(0, "wait", 0, 0.0, 3.0), (0, "step", 0, 3.0, 4.0), (0, "other", 1, 4.0, 4.5),
                    (2, "compute", 0, 0.5, 2.5), (2, "grant", 0, 2.5, 4.5)])
    totals = phase_totals(spans)
    assert totals[0] == {"wait": 3.0, "step": 1.0, "other": 0.5, "span_s": 4.5}
    assert totals[2] == {"compute": 2.0, "grant": 2.0, "span_s": 4.0}
    assert explained(totals[0]) == 1 - 0.5 / 4.5
    assert explained(totals[2]) == 1.0


def test_the_chrome_trace_has_a_complete_event_per_span_in_microseconds():
    spans = _spans([(0, "wait", 0, 0.0, 0.25), (3, "push", 5, 0.125, 0.5)])
    trace = json.loads(json.dumps(chrome_trace(spans, {0: "server", 3: "worker"}, "run")))
    names = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    spans_out = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["name"] for e in names] == ["rank 0 (server)", "rank 3 (worker)"]
    assert spans_out == [
        {"name": "wait", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 250000.0, "args": {"step": 0}},
        {"name": "push", "ph": "X", "pid": 3, "tid": 0, "ts": 125000.0, "dur": 375000.0, "args": {"step": 5}}]


def test_the_drawn_window_is_steps_worth_of_time_in_the_middle():
    spans = _spans([(1, "compute", k, float(k), k + 1.0) for k in range(10)])
    assert window(spans, steps=2) == (4.0, 6.0)
