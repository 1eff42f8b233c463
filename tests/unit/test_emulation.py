"""The compute-time model of heterogeneity emulation."""

import numpy as np
import pytest

from hpcps.cluster.emulation import ComputeTime


def test_real_compute_with_slowdown_sleeps_factor_minus_one_times_as_long():
    rng = np.random.default_rng(0)
    assert ComputeTime(factor=3.0).sleep_after(0.01, rng) == pytest.approx(0.02)
    assert ComputeTime().sleep_after(0.01, rng) == 0.0


def test_model_tops_up_the_real_pass_to_mean_times_factor():
    rng = np.random.default_rng(0)
    assert ComputeTime(mean=0.05, factor=2.0).sleep_after(0.01, rng) == pytest.approx(0.09)
    assert ComputeTime(mean=0.001).sleep_after(0.01, rng) == 0.0  # real pass already longer


def test_a_target_drawn_already_is_topped_up_to_without_a_second_draw():
    rng, twin = np.random.default_rng(3), np.random.default_rng(3)
    model = ComputeTime(mean=0.05, jitter="uniform", cv=0.3)
    target = model.target(rng)
    assert model.sleep_after(0.01, rng, target=target) == pytest.approx(target - 0.01)
    model.target(twin)
    assert rng.random() == twin.random()  # one draw in all: the sleep took the target it was given
    assert model.sleep_after(0.2, rng, target=target) == 0.0  # the pass outran it
    assert ComputeTime(factor=3.0).sleep_after(0.01, rng, target=None) == pytest.approx(0.02)  # real compute


@pytest.mark.parametrize("jitter,cv", [("uniform", 0.3), ("lognormal", 0.2), ("exponential", 1.0)])
def test_jitter_has_mean_one_and_the_requested_spread(jitter, cv):
    model = ComputeTime(mean=1.0, jitter=jitter, cv=cv)
    rng = np.random.default_rng(1)
    x = np.array([model.jitter_sample(rng) for _ in range(40000)])
    assert x.min() > 0
    assert x.mean() == pytest.approx(1.0, abs=0.02)
    assert x.std() / x.mean() == pytest.approx(cv, rel=0.05)



def test_stall_watch_warns_every_interval_and_raises_past_the_limit():
    from hpcps.transport.poll import StallWatch

    class Log:
        def __init__(self):
            self.lines = []

        def warning(self, fmt, *args):
            self.lines.append(fmt % args)

    log = Log()
    watch = StallWatch(warn=2.0, abort=5.0, describe=lambda: "rank 3 waiting for its grant", log=log, error=RuntimeError)
    for t in (0.5, 1.9, 2.0, 3.0, 4.1):
        watch(t)
    assert log.lines == ["stall: rank 3 waiting for its grant for 2 s", "stall: rank 3 waiting for its grant for 4 s"]
    with pytest.raises(RuntimeError, match=r"stall: rank 3 waiting for its grant for 5 s \(--stall-abort 5\)"):
        watch(5.0)
    StallWatch(warn=1.0, abort=None, describe=str, log=log, error=RuntimeError)(1e9)  # never aborts


def test_straggler_episodes_rotate_one_slow_worker_round_robin_on_the_run_clock():
    """--straggler-episodes 3:2 with 4 workers: worker k is 3x slower in [2k, 2k+2) mod 8 seconds, on top
    of its own --slowdown; outside the run (now=None: the speed warm-up) episodes do not apply."""
    import numpy as np

    from hpcps.cluster.emulation import ComputeTime

    rng = np.random.default_rng(0)
    times = [ComputeTime(0.01, 2.0 if k == 1 else 1.0, episodes=(3.0, 2.0), worker=k, n_workers=4) for k in range(4)]
    for now, slow in ((0.0, 0), (1.9, 0), (2.0, 1), (5.5, 2), (7.99, 3), (8.0, 0), (19.0, 1)):
        factors = [t.factor_at(now) for t in times]
        expected = [(3.0 if k == slow else 1.0) * (2.0 if k == 1 else 1.0) for k in range(4)]
        assert factors == expected, (now, factors)
    assert times[0].sleep_after(0.0, rng, now=0.5) == pytest.approx(0.03)
    assert times[0].sleep_after(0.0, rng, now=None) == pytest.approx(0.01)


def test_straggler_episodes_are_validated_and_need_compute_time():
    from hpcps.options.config import make_config
    from hpcps.errors import UserError

    assert make_config({"straggler_episodes": "3:2", "compute_time": 0.01}).straggler_episodes == (3.0, 2.0)
    with pytest.raises(UserError, match="FACTOR:SECONDS"):
        make_config({"straggler_episodes": "3", "compute_time": 0.01})
    with pytest.raises(UserError, match="needs --compute-time"):
        make_config({"straggler_episodes": "3:2"})


def test_an_emulated_computation_pokes_every_millisecond_and_lasts_as_long():
    """emulated_sleep(0.05, poke): at most one poke per POKE_EVERY (sleep overshoots, never undershoots),
    at least one, and no shorter than asked; without poke, one plain sleep."""
    import time

    from hpcps.cluster.emulation import POKE_EVERY, emulated_sleep

    pokes = []
    t = time.perf_counter()
    emulated_sleep(0.05, lambda: pokes.append(time.perf_counter()))
    assert time.perf_counter() - t >= 0.05
    assert 1 <= len(pokes) <= round(0.05 / POKE_EVERY)
    emulated_sleep(0.0, lambda: pokes.append(None))  # nothing to emulate: no poke
    assert None not in pokes


def test_a_straggler_whose_real_pass_outruns_its_target_is_named_and_an_even_one_is_not():
    from hpcps.cluster.emulation import Overruns, end_pass
    from hpcps.training.flat import FlatParameters
    import time
    import torch

    flat = FlatParameters(torch.nn.Linear(4, 2))
    rng = np.random.default_rng(0)
    over = Overruns()
    for _ in range(12):  # the real pass (0 s of compute here, but begun 5 ms ago) outruns a 1 ms target
        end_pass(flat, time.perf_counter() - 0.005, ComputeTime(0.001), rng, overruns=over)
    assert (over.steps, over.over) == (12, 12) and 0.004 * 12 <= over.excess_s
    assert "worker rank 3: the real pass outran --compute-time in 12 of 12 steps" in over.warning(3)
    held = Overruns()
    for _ in range(12):  # a 20 ms target tops up the same pass: it holds
        end_pass(flat, time.perf_counter() - 0.005, ComputeTime(0.02), rng, overruns=held)
    assert (held.steps, held.over) == (12, 0) and held.warning(3) is None
    few = Overruns()
    for real in (0.2, 0.2, 0.2):
        few.add(real, 0.1)
    assert few.warning(1) is None  # fewer than 10 steps: no verdict
    half = Overruns(steps=10, over=5, excess_s=1.0)
    assert half.warning(1) is None  # half is not most
