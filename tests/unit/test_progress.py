"""Rank 0's progress report (no MPI): a bar on a terminal, status lines elsewhere."""

import io
import logging
import math

from hpcps.progress import Progress


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_without_a_terminal_a_status_line_comes_every_interval(caplog):
    clock, accuracy = _Clock(), [math.nan]
    p = Progress(1000, "bsp", every=10.0, accuracy=lambda: accuracy[0], stream=io.StringIO(), clock=clock)
    assert p.bar is None and p.lines
    with caplog.at_level(logging.INFO, logger="hpcps"):
        clock.t = 5.0
        p.update(100)  # not yet an interval
        clock.t = 10.0
        p.update(100)
        accuracy[0] = 0.9
        clock.t = 15.0
        p.update(300)  # 5 s after the last line: none
        clock.t = 20.0
        p.update(100)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["progress: 200/1000 gradients (20%), 20/s, 40.0 s left",
                     "progress: 600/1000 gradients (60%), 40/s, 10.0 s left, accuracy 0.9000"]


def test_disabled_progress_says_nothing(caplog):
    clock = _Clock()
    p = Progress(10, "asp", enabled=False, every=1.0, stream=io.StringIO(), clock=clock)
    with caplog.at_level(logging.INFO, logger="hpcps"):
        clock.t = 5.0
        p.update(5)
        p.close()
    assert p.bar is None and not caplog.records
