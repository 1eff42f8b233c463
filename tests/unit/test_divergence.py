"""The divergence rule, on hand-made rows of /workers/iterations."""

import math

import numpy as np

from hpcps.metrics.schema import ITERATION
from hpcps.training.divergence import FACTOR, NONFINITE_ROWS, WINDOW, DivergenceWatch


def _rows(losses, rank=1, first_step=0):
    rows = np.zeros(len(losses), ITERATION)
    rows["rank"], rows["step"], rows["loss"] = rank, np.arange(first_step, first_step + len(losses)), losses
    return rows


def test_a_loss_that_rises_past_three_times_its_start_is_divergence_and_said_once():
    watch = DivergenceWatch()
    assert watch.observe(_rows([2.0] * WINDOW)) is None  # one worker: its first loss is the start
    assert watch.observe(_rows([2.0 * FACTOR] * WINDOW, first_step=WINDOW)) is None  # exactly 3x: not more
    reason = watch.observe(_rows([2.0 * FACTOR + 0.5] * WINDOW, first_step=2 * WINDOW))
    assert reason is not None and "from 2 at the start" in reason and "6.5" in reason
    assert watch.observe(_rows([100.0] * WINDOW)) is None and watch.reason == reason


def test_the_start_is_each_workers_first_loss_so_a_blow_up_in_the_first_updates_is_caught():
    watch = DivergenceWatch()
    first = np.concatenate([_rows([2.0, 150.0, 4e5], rank=r) for r in (1, 2, 3, 4)])
    assert watch.observe(first) is None
    reason = watch.observe(_rows([100.0] * (2 * WINDOW), rank=1, first_step=3))
    assert reason is not None and "from 2 at the start" in reason


def test_nothing_is_judged_before_two_windows_of_losses():
    watch = DivergenceWatch()
    assert watch.observe(_rows([1.0] * WINDOW + [50.0] * (WINDOW - 1))) is None
    assert watch.observe(_rows([50.0])) is not None


def test_a_run_at_chance_or_learning_is_never_divergence():
    watch = DivergenceWatch()
    assert watch.observe(_rows([2.3] * 500)) is None
    assert watch.observe(_rows(list(np.linspace(2.3, 0.1, 500)))) is None


def test_non_finite_losses_in_a_row_from_a_worker_that_reported_finite_ones():
    watch = DivergenceWatch()
    assert watch.observe(_rows([2.0, 2.0, math.nan, 2.0] + [math.nan] * (NONFINITE_ROWS - 1), rank=3)) is None
    reason = watch.observe(_rows([math.inf], rank=3, first_step=9))
    assert reason is not None and "worker rank 3" in reason and "step 9" in reason


def test_bad_steps_of_different_workers_do_not_add_up_and_an_unreported_loss_is_ignored():
    watch = DivergenceWatch()
    watch.observe(_rows([2.0], rank=1))
    watch.observe(_rows([2.0], rank=2))
    for _ in range(NONFINITE_ROWS - 1):
        assert watch.observe(_rows([math.nan], rank=1)) is None
        assert watch.observe(_rows([math.nan], rank=2)) is None
    # a loop that never reports its loss (ps.step() without loss=) records NaN from the first step on
    assert watch.observe(_rows([math.nan] * 100, rank=4)) is None


def test_a_run_whose_first_gradients_are_all_non_finite_cannot_start():
    from hpcps.metrics.schema import UPDATE
    from hpcps.training.divergence import NonFiniteStart

    def rows(n, applied=0, reason=1, shard=0):
        r = np.zeros(n, UPDATE)
        r["applied"], r["reason"], r["shard"] = applied, reason, shard
        return r

    watch = NonFiniteStart(limit=20)
    assert watch.observe(rows(19)) is None and watch.observe(rows(30, shard=1)) is None  # shard 0's rows count
    assert "the first 20 gradients were all non-finite" in watch.observe(rows(1))
    assert watch.observe(rows(5)) is None  # said once
    healthy = NonFiniteStart(limit=20)
    assert healthy.observe(rows(1, applied=1, reason=0)) is None and healthy.observe(rows(40)) is None
    skipped = NonFiniteStart(limit=20)  # a GradScaler's skipped step (reason 2) is the loop's, not NaN data
    assert skipped.observe(rows(1, reason=2)) is None and skipped.observe(rows(40)) is None
