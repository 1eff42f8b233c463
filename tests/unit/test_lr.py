"""Staleness-aware learning rates: the formulas, exactly."""

import math

import pytest

from hpcps.training.lr import SCHEDULES, scaled_lr


@pytest.mark.parametrize("schedule,expected", [
    ("none", [0.1, 0.1, 0.1]), ("inverse", [0.1, 0.05, 0.025]),
    ("sqrt", [0.1, 0.1 / math.sqrt(2), 0.05]), ("exp", [0.1, 0.1 / math.e, 0.1 * math.exp(-3)]),
])
def test_schedules(schedule, expected):
    stalenesses = [0, 1, 3]
    assert [scaled_lr(schedule, 0.1, s) for s in stalenesses] == pytest.approx(expected, rel=1e-15)


def test_negative_staleness_counts_as_fresh():
    assert all(scaled_lr(name, 0.2, -3) == 0.2 for name in SCHEDULES)
