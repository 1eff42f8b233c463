"""The worker's side of local steps (no MPI): rounds, the pseudo-gradient of parameters and buffers, the
steps of each worker by speed, the inner state's files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcps.options.config import outer_rounds
from hpcps.training.flat import FlatParameters
from hpcps.training.local import InnerFiles, LocalSteps, seconds_per_step, steps_by_speed
from hpcps.training.optim import builtin_optimizer


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def test_a_round_of_inner_sgd_pushes_the_change_of_the_parameters_and_of_the_buffers():
    """Three inner sgd steps at rate 0.1: the pseudo-gradient is the start minus the end of the parameters
    (0.1 x the gradients summed), and the buffers' change from the start (BatchNorm's running statistics)."""
    m = model()
    flat = FlatParameters(m)
    local = LocalSteps(m, flat, builtin_optimizer("sgd", lr=0.1), every=3, steps=10)
    local.begin_round()
    start = flat.params_t.clone()
    summed = torch.zeros(flat.n_params)
    for k in range(3):
        flat.begin_pass()
        m(torch.randn(8, 3, generator=torch.Generator().manual_seed(k))).square().sum().backward()
        flat.end_pass()
        summed += flat.grads_t[:flat.n_params]
        local.inner_step()
        assert local.round_over(0) == (k == 2)
    local.pseudo_gradient()
    n = flat.n_params
    assert torch.allclose(flat.grads_t[:n], 0.1 * summed, atol=1e-6)
    assert torch.allclose(flat.grads_t[:n], start[:n] - flat.params_t[:n])
    assert torch.equal(flat.grads_t[n:], flat.params_t[n:] - start[n:]) and flat.grads_t[n:].abs().max() > 0


def test_the_last_round_ends_at_the_runs_last_step_and_a_skipped_step_moves_nothing():
    m = model()
    flat = FlatParameters(m)
    local = LocalSteps(m, flat, builtin_optimizer("sgd", lr=0.1), every=4, steps=10)
    assert outer_rounds(10, 4) == 3 and outer_rounds(8, 4) == 2
    local.begin_round()
    before = flat.params_t.clone()
    flat.grads_t.fill_(1.0)
    local.inner_step(skip=True)
    assert torch.equal(flat.params_t, before) and local.taken == 1
    local.inner_step()
    assert local.round_over(2)  # round 2 starts at step 8: steps 8 and 9 are the run's last
    assert not local.round_over(1)


def test_a_workers_speed_is_its_first_rounds_median_step_after_the_warm_up():
    assert seconds_per_step([0.9, 0.1, 0.12, 0.1]) == 0.1  # the first step's warm-up weighs nothing
    assert seconds_per_step([0.9, 0.1, 0.2]) == pytest.approx(0.15)
    assert seconds_per_step([0.9, 0.2]) == 0.2
    assert seconds_per_step([0.3]) == 0.3  # H=1: the only step there is
    # two equal workers, one of whose first steps warmed up 0.5 s longer: by the mean steps they split H=8
    # as [8, 5]; by the median after the first, each takes all 8
    a, b = [0.1] + [0.1] * 7, [0.6] + [0.1] * 7
    assert steps_by_speed(8, [sum(a) / 8, sum(b) / 8]) == [8, 5]
    assert steps_by_speed(8, [seconds_per_step(a), seconds_per_step(b)]) == [8, 8]


def test_steps_by_speed_give_each_worker_its_share_of_h():
    assert steps_by_speed(8, [0.1, 0.1, 0.2]) == [8, 8, 4]
    assert steps_by_speed(8, [0.1, 0.35, 10.0]) == [8, 2, 1]  # at least one
    assert steps_by_speed(4, [0.2, 0.19]) == [4, 4]  # never more than H


def test_inner_files_are_per_worker_and_round_and_older_rounds_go(tmp_path):
    a, b = InnerFiles(str(tmp_path), 0), InnerFiles(str(tmp_path), 1)
    for r in (3, 4, 5):
        a.write(r, {"round": r})
        b.write(r, {"round": r})
    a.prune(5)
    assert a.read(3) is None and a.read(4) is None and a.read(5) == {"round": 5}
    assert b.read(3) == {"round": 3}  # another worker's files stay
    assert not list((tmp_path / "inner").glob("*.tmp"))


@pytest.mark.parametrize("transfer", ["shared", "staged"])
def test_a_rebase_puts_the_steps_since_the_push_on_top_of_the_global_parameters(transfer):
    """--overlap-steps: pushed at p, two more inner steps to q, the global g comes: the model (parameters and
    BatchNorm's buffers) holds g + (q - p), the next pseudo-gradient is against g; at the run's end (no step
    since the push) the model holds g exactly. ``staged``: the GPU's copies, on the CPU."""
    m = model()
    flat = FlatParameters(m, transfer=transfer)
    local = LocalSteps(m, flat, builtin_optimizer("sgd", lr=0.1), every=4, steps=8)
    local.begin_round()

    def inner_step(k: int) -> None:
        flat.begin_pass()
        m(torch.randn(8, 3, generator=torch.Generator().manual_seed(k))).square().sum().backward()
        flat.end_pass()
        local.inner_step()

    for k in range(4):
        inner_step(k)
    local.pseudo_gradient()
    local.mark_pushed()
    p = flat.values().clone()
    local.begin_round(pulled=False)
    for k in range(4, 6):
        inner_step(k)
    q = flat.values().clone()
    g = p.numpy() + np.linspace(-1, 1, flat.size, dtype=np.float32)  # the outer step's result, as pulled
    local.rebase(g.copy())
    want = torch.from_numpy(g) + (q - p)
    assert torch.allclose(flat.values(), want, atol=1e-6)
    n = flat.n_params
    got = [t.detach().reshape(-1) for t in list(m.parameters()) + [m[1].running_mean, m[1].running_var]]
    assert torch.allclose(torch.cat(got), want, atol=1e-6)  # the model's own tensors, not only the packed copy
    for k in range(6, 8):
        inner_step(k)
    local.pseudo_gradient()
    assert torch.allclose(flat.grads_t[:n], torch.from_numpy(g[:n]) - flat.values()[:n], atol=1e-6)
    local.mark_pushed()
    end = g + 1.0
    local.rebase(end.copy(), moved=False)
    assert torch.equal(flat.values(), torch.from_numpy(end))
