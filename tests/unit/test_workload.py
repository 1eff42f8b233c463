"""Data sources, default loss and evaluation, buffers in the flat vector (no MPI)."""

import math

import numpy as np
import pytest
import torch

from hpcps.options.targets import Target
from torch import nn

from hpcps.data.batches import ArrayData, held_out_batches
from hpcps.data.sharding import batch_indices
from hpcps.data.loaders import load_dataset
from hpcps.errors import UserError
from hpcps.runtime.evaluator import EvalPlan, Evaluator
from hpcps.runtime.parts import Records
from hpcps.training.flat import FlatParameters
from hpcps.training.workload import cross_entropy, data_shape, data_source, default_evaluate, mse, split


def _tensor_dataset(n=40, d=3):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, d, generator=g), torch.arange(n) % 4)


def test_a_dataset_is_sharded_disjointly_on_the_batch_schedule():
    ds = _tensor_dataset()
    source = data_source(ds, ds)
    seen = []
    for w in range(2):
        batches = source.for_worker(w, 2, batch_size=5, seed=3, device=torch.device("cpu"))
        for step in range(4):  # two epochs of 2 batches each
            x, y = batches.batch(step)
            idx = batch_indices(40, batch_size=5, n_workers=2, worker=w, step=step, seed=3)
            assert torch.equal(x, ds.tensors[0][idx]) and torch.equal(y, ds.tensors[1][idx])
            if step < 2:
                seen.extend(idx.tolist())
    assert len(seen) == len(set(seen)) == 20  # epoch 0: the workers' samples never overlap


def test_without_held_out_data_a_dataset_is_split_the_fixed_way():
    ds = _tensor_dataset(50)
    train, test = split(ds, 0.2)
    again_train, again_test = split(ds, 0.2)
    assert len(test) == 10 and len(train) == 40 and test.indices == again_test.indices
    assert not set(train.indices) & set(test.indices)
    source = data_source(ds)
    assert source.n_train == 40 and source.n_test == 10
    assert data_shape(source) == ((3,), None)
    with pytest.raises(UserError, match="too few to hold"):
        split(_tensor_dataset(2), 0.2)


def test_a_batch_factory_runs_epoch_after_epoch():
    calls = []

    def factory(index, n_workers, seed, epoch):
        calls.append((index, n_workers, seed, epoch))
        return [torch.full((2,), 10.0 * epoch + k) for k in range(3)]

    source = data_source(factory)
    assert source.n_train is None and source.test_batches(8) is None
    batches = source.for_worker(1, 4, batch_size=2, seed=7, device=torch.device("cpu"))
    got = [float(batches.batch(step)[0]) for step in range(7)]
    assert got == [0, 1, 2, 10, 11, 12, 20] and calls == [(1, 4, 7, 0), (1, 4, 7, 1), (1, 4, 7, 2)]
    with pytest.raises(UserError, match="expected a torch Dataset"):
        data_source(42)


def test_default_evaluation_is_the_mean_loss_and_the_accuracy():
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    x = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    y = torch.tensor([0, 0, 0])
    batches = held_out_batches(torch.utils.data.TensorDataset(x, y), 2)  # batches of 2 and 1
    assert len(batches) == 2
    with torch.no_grad():  # as the evaluator calls it
        out = default_evaluate(cross_entropy)(model, batches)
        want = float(nn.functional.cross_entropy(model(x), y))
    assert out["loss"] == pytest.approx(want) and out["accuracy"] == pytest.approx(2 / 3)
    regression = default_evaluate(mse)(model, [(x, x)])
    assert regression["loss"] == 0.0 and math.isnan(regression["accuracy"])


class _Rows:
    def __init__(self):
        self.rows = []

    def add(self, table, row):
        self.rows.append((table, row))


def test_a_dropout_models_evaluation_is_deterministic_and_leaves_no_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.BatchNorm1d(64), nn.Linear(64, 10))
    flat = FlatParameters(model)
    data = load_dataset("digits")
    data = type(data)(data.name, data.x_train.reshape(-1, 64), data.y_train, data.x_test.reshape(-1, 64),
                      data.y_test, data.n_classes)
    params = flat.params.copy()
    rows = _Rows()

    def pull(out):
        np.copyto(out, params)
        return np.array([3]), False

    ev = Evaluator(model=model, flat=flat, batches=ArrayData(data).test_batches(100),
                   evaluate=default_evaluate(cross_entropy), pull=pull,
                   records=Records(rows, lambda: 1.0), plan=EvalPlan(0.1))
    model.train()
    first, second = ev.evaluate(), ev.evaluate()
    assert first == second and rows.rows[0][1] == rows.rows[1][1]
    assert not model.training  # evaluation runs in eval mode
    assert np.array_equal(flat.params, params)  # BatchNorm statistics untouched by evaluation
    with torch.no_grad():
        model.eval()
        direct = float((model(torch.from_numpy(data.x_test)).argmax(1) == torch.from_numpy(data.y_test))
                       .double().mean())
    assert first == direct


def test_buffers_follow_the_parameters_and_a_pass_records_their_change():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    flat = FlatParameters(model)
    assert flat.n_params == 3 * 4 + 4 + 4 + 4 + 4 * 2 + 2 and flat.size == flat.n_params + 8
    bn = model[1]
    assert bn.running_mean.data_ptr() == flat.params_t[flat.n_params:].data_ptr()  # a view, no copy
    before = flat.params[flat.n_params:].copy()
    flat.begin_pass()
    x = torch.randn(16, 3)
    model(x).pow(2).sum().backward()
    flat.end_pass()
    after = flat.params[flat.n_params:]
    assert np.allclose(flat.grads[flat.n_params:], after - before) and np.abs(after - before).max() > 0
    with torch.no_grad():
        h = model[0](x)
    assert np.allclose(after[:4], 0.9 * before[:4] + 0.1 * h.mean(0).numpy(), atol=1e-6)  # momentum 0.1


def test_clip_norm_scales_the_gradient_as_clip_grad_norm_does():
    torch.manual_seed(1)
    a, b = nn.Linear(5, 3), nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    flat = FlatParameters(a)
    x = torch.randn(8, 5) * 10
    flat.begin_pass()
    a(x).pow(2).sum().backward()
    flat.end_pass(clip_norm=0.5)
    b(x).pow(2).sum().backward()
    nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    assert torch.allclose(a.weight.grad, b.weight.grad) and torch.allclose(a.bias.grad, b.bias.grad)
    assert float(flat.grads_t.norm()) == pytest.approx(0.5, rel=1e-4)


def test_a_background_evaluation_leaves_the_loop_free_and_reports_back_on_the_loops_thread():
    """While the helper thread's pull is held up, tick() returns at once (the loop serves on); once it
    finishes, the next tick records the row and calls on_target, on the loop's thread."""
    import threading

    model = nn.Sequential(nn.Linear(64, 10))
    flat = FlatParameters(model)
    data = load_dataset("digits")
    data = type(data)(data.name, data.x_train.reshape(-1, 64), data.y_train, data.x_test.reshape(-1, 64),
                      data.y_test, data.n_classes)
    release, pulling, targets, now = threading.Event(), threading.Event(), [], [1.0]

    def pull(out):
        pulling.set()
        assert release.wait(10)
        return np.array([7]), False

    rows = _Rows()
    ev = Evaluator(model=model, flat=flat, batches=ArrayData(data).test_batches(100),
                   evaluate=lambda m, b: {"accuracy": 0.5, "loss": 1.0}, pull=pull, background=True,
                   records=Records(rows, lambda: now[0]),
                   plan=EvalPlan(0.1, target=Target("accuracy", ">=", 0.4),
                                 on_target=lambda: targets.append(threading.current_thread().name)))
    assert ev.tick()  # started
    assert pulling.wait(10)
    for _ in range(100):  # the loop keeps going while the evaluation is held up
        now[0] += 0.2
        assert not ev.tick()
    assert rows.rows == [] and targets == []
    release.set()
    ev._thread.join(10)
    assert ev.tick()  # recorded now, and a new evaluation started (interval long passed)
    ev.close()
    assert rows.rows[0] == ("eval", (1.0, 7, 1.0, 0.5))
    assert targets == [threading.current_thread().name]  # on_target ran on the loop's thread, once


@pytest.mark.parametrize("pull_s, interval, said", [(0.5, 1.0, True), (0.05, 1.0, False), (0.08, 0.1, False)])
def test_rank_0_says_once_what_share_of_the_run_the_evaluations_pulls_took(caplog, pull_s, interval, said):
    """Each evaluation's pull takes ``pull_s`` on the run's clock, one ``interval`` after the last: 0.5 s a
    second is a quarter of the run (above PULL_SHARE): one warning, after PULLS_BEFORE_SAYING evaluations,
    naming the share, the seconds a pull and the model's size; 0.05 s a second (under 5%) says nothing, nor
    do pulls of 0.08 s every 0.1 s (44%, but each under PULL_SLOW_S: a busy node's wait, not a link's)."""
    import logging
    from hpcps.runtime import evaluator

    model = nn.Sequential(nn.Linear(64, 10))
    flat = FlatParameters(model)
    now = [0.0]

    def pull(out):
        now[0] += pull_s
        return np.array([1]), False

    ev = Evaluator(model=model, flat=flat, batches=[(torch.zeros(2, 64), torch.zeros(2, dtype=torch.long))],
                   evaluate=lambda m, b: {"accuracy": 0.5, "loss": 1.0}, pull=pull, records=Records(_Rows(),
                   lambda: now[0]), plan=EvalPlan(interval))
    with caplog.at_level(logging.WARNING, logger="hpcps"):
        for k in range(8):
            now[0] += interval + pull_s  # (the interval counts from the last evaluation's end)
            assert ev.tick()
            lines = [r.getMessage() for r in caplog.records if "evaluations' pulls" in r.getMessage()]
            assert len(lines) == (1 if said and k + 1 >= evaluator.PULLS_BEFORE_SAYING else 0), lines
    if said:  # after the third: 1.5 s of pulls in 6 s
        assert "took 25% of the run's 6 s so far (0.50 s each, an evaluation 1 s after the last one ended " \
               "(--eval-interval))" in lines[0] and f"({flat.params.nbytes / 1e6:.1f} MB)" in lines[0], lines


def test_a_failed_background_evaluation_is_raised_in_the_loop():
    model = nn.Sequential(nn.Linear(4, 2))
    flat = FlatParameters(model)

    def pull(out):
        raise OSError("window gone")

    ev = Evaluator(model=model, flat=flat, batches=[(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long))],
                   evaluate=lambda m, b: {}, pull=pull, background=True,
                   records=Records(_Rows(), lambda: 1.0), plan=EvalPlan(0.1))
    assert ev.tick()
    ev._thread.join(10)
    with pytest.raises(RuntimeError, match="evaluation failed: OSError: window gone"):
        ev.tick()


def test_a_compiled_models_saved_state_loads_into_the_plain_model():
    """torch.compile puts ``_orig_mod.`` in every key; the saved state drops it."""
    from hpcps.runtime.run import plain_state_dict

    model = torch.nn.Linear(2, 3)
    compiled = torch.compile(model)
    assert list(compiled.state_dict()) == ["_orig_mod.weight", "_orig_mod.bias"]
    state = plain_state_dict(compiled)
    fresh = torch.nn.Linear(2, 3)
    fresh.load_state_dict(state)  # strict: every key matches
    assert torch.equal(fresh.weight, model.weight)


def test_a_batch_size_with_a_batch_factory_is_refused_in_python_spelling():
    from mpi4py import MPI

    import hpcps
    from hpcps.errors import UserError

    def factory(index, n_workers, seed, epoch):
        return [(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))]

    with pytest.raises(UserError, match="batch_size: a batch factory makes its own batches"):
        hpcps.train(model=lambda: torch.nn.Linear(3, 2), data=factory, batch_size=8, comm=MPI.COMM_SELF,
                    exit_on_error=False)
    with pytest.raises(UserError, match="unknown keyword argument 'batchsize' \\(did you mean 'batch_size'\\?\\)"):
        hpcps.train(model=lambda: torch.nn.Linear(3, 2), data=factory, batchsize=8, comm=MPI.COMM_SELF,
                    exit_on_error=False)


def test_a_label_beyond_the_models_outputs_is_one_line_saying_so():
    """Labels up to 11 for a model of 10 outputs (a data set that says 10 classes): RunAborted naming the
    label and the width, on the training loss and on the evaluation alike (it was torch's bare IndexError)."""
    import torch

    from hpcps.errors import RunAborted
    from hpcps.training.workload import cross_entropy, default_evaluate

    model = torch.nn.Linear(4, 10)
    batch = (torch.zeros(3, 4), torch.tensor([1, 11, 2]))
    with pytest.raises(RunAborted, match=r"a label of the batch is 11, beyond the model's 10 outputs \(labels must "
                                         r"be 0 to 9\)"):
        cross_entropy(model, batch)
    with pytest.raises(RunAborted, match="beyond the model's 10 outputs"):
        default_evaluate(cross_entropy)(model, [batch])
    assert float(cross_entropy(model, (torch.zeros(3, 4), torch.tensor([1, 9, 2])))) > 0


def test_every_n_versions_counts_from_the_version_a_background_evaluation_read():
    """The server is at version 5 when an evaluation starts and at 14 when its helper pulls: the next one is
    due at 20, the grid's first at least 5 after the version evaluated, not at 15 (which read 15, one version
    after 14)."""
    model = nn.Sequential(nn.Linear(64, 10))
    flat = FlatParameters(model)
    data = load_dataset("digits")
    data = type(data)(data.name, data.x_train.reshape(-1, 64), data.y_train, data.x_test.reshape(-1, 64),
                      data.y_test, data.n_classes)
    server = [10]

    def pull(out, at=None):
        server[0] = 14  # the rounds went on between the start and the pull
        return np.array([server[0]]), False

    ev = Evaluator(model=model, flat=flat, batches=ArrayData(data).test_batches(100),
                   evaluate=lambda m, b: {"loss": 1.0}, pull=pull, version=lambda: server[0], background=True,
                   records=Records(_Rows(), lambda: 1.0), plan=EvalPlan(1e9, every=5))
    server[0] = 5
    assert ev.tick()  # due: 5 versions since 0
    ev._thread.join(10)
    assert ev.tick() and ev._thread is None  # recorded (it read 14), none started
    for version, due in ((15, False), (19, False), (20, True)):
        server[0] = version
        assert ev.tick() == due, version
    ev.close()


def test_evaluations_every_n_versions_wait_for_every_shard_and_read_the_multiples_of_n():
    """--eval-every 10: nothing is due while shard 0 is short of version 10, nor while another shard is (the
    shards' lowest, asked at most every SETTLE_POLL_S); once every shard has published 10 the evaluation asks
    its pull for version 10; the next at 20, 30, and after a read of 31 (past the grid) at 50 (at least 10
    after the version read); a run that starts at version 57 evaluates what is there at once, then 70."""
    from hpcps.runtime.evaluator import SETTLE_POLL_S

    model = nn.Sequential(nn.Linear(64, 10))
    flat = FlatParameters(model)
    data = load_dataset("digits")
    data = type(data)(data.name, data.x_train.reshape(-1, 64), data.y_train, data.x_test.reshape(-1, 64),
                      data.y_test, data.n_classes)
    shard0, lowest, now, asked, forced = [0], [0], [0.0], [], [None]

    def pull(out, at=None):
        asked.append(at)
        read = forced[0] if forced[0] is not None else at if at is not None else lowest[0]
        return np.array([read] * 2), False

    def settled():
        asked.append("settled")
        return lowest[0]

    def evaluator():
        rows = _Rows()
        return rows, Evaluator(model=model, flat=flat, batches=ArrayData(data).test_batches(500),
                               evaluate=lambda m, b: {"accuracy": 0.5}, pull=pull, records=Records(rows, lambda: now[0]),
                               plan=EvalPlan(0.1, every=10), version=lambda: shard0[0], settled=settled)

    rows, ev = evaluator()
    shard0[0], lowest[0] = 9, 9
    assert not ev.tick() and asked == []  # shard 0 short of 10: the shards are not even asked
    shard0[0] = 10
    assert not ev.tick() and asked == ["settled"]  # shard 1 still at 9
    assert not ev.tick() and asked == ["settled"]  # (not asked again within SETTLE_POLL_S)
    now[0] += 2 * SETTLE_POLL_S
    lowest[0] = 10
    assert ev.tick() and asked == ["settled", "settled", 10] and rows.rows[-1][1][1] == 10
    shard0[0], lowest[0] = 20, 20
    now[0] += 2 * SETTLE_POLL_S
    assert ev.tick() and asked[-1] == 20 and rows.rows[-1][1][1] == 20
    forced[0] = 31  # a read that lagged: shard 0 at 30, the shards read at 31 (no slot held 30)
    shard0[0], lowest[0] = 30, 30
    now[0] += 2 * SETTLE_POLL_S
    assert ev.tick() and asked[-1] == 30 and rows.rows[-1][1][1] == 31
    forced[0] = None
    for version, due in ((40, False), (49, False), (50, True)):  # (40 is less than 10 after 31)
        shard0[0] = lowest[0] = version
        now[0] += 2 * SETTLE_POLL_S
        assert ev.tick() == due, version
    assert asked[-1] == 50
    ev.evaluate()  # the final evaluation reads whatever every shard holds
    assert asked[-1] is None

    rows, ev = evaluator()
    asked.clear()
    shard0[0], lowest[0] = 57, 57
    now[0] += 2 * SETTLE_POLL_S
    assert ev.tick() and asked == ["settled", None] and rows.rows[-1][1][1] == 57  # (what is there)
    for version, due in ((60, False), (66, False), (70, True)):
        shard0[0] = lowest[0] = version
        now[0] += 2 * SETTLE_POLL_S
        assert ev.tick() == due, version
    assert asked[-1] == 70 and rows.rows[-1][1][1] == 70
