"""Rank 0's progress report (no MPI): a bar on a terminal, status lines elsewhere."""

import io
import logging
import math

from hpcps.runtime.progress import Progress


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
        clock.t = 60.0
        p.update(100)  # the first step compiled for a minute: rates count from here
        clock.t = 65.0
        p.update(100)  # not yet an interval
        clock.t = 70.0
        p.update(100)
        accuracy[0] = 0.9
        clock.t = 75.0
        p.update(300)  # 5 s after the last line: none
        clock.t = 80.0
        p.update(100)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["progress: 300/1000 gradients (30%), 20/s, 35.0 s left",
                     "progress: 700/1000 gradients (70%), 40/s, 7.5 s left, accuracy 0.9000"]


def test_disabled_progress_says_nothing(caplog):
    clock = _Clock()
    p = Progress(10, "asp", enabled=False, every=1.0, stream=io.StringIO(), clock=clock)
    with caplog.at_level(logging.INFO, logger="hpcps"):
        clock.t = 5.0
        p.update(5)
        p.close()
    assert p.bar is None and not caplog.records
