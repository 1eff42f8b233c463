"""Server optimizers and schedules (no MPI): closed forms and torch.optim replays."""

import copy
import math

import pytest
import torch

from hpcps.training.optim import ShardOptimizer, builtin_optimizer, make_schedule, update_terms


def test_constant_schedule_with_warmup_ramps_linearly_then_stays():
    s = make_schedule("constant", horizon=100, warmup=4)
    assert [s(v) for v in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_schedule_closed_form():
    s = make_schedule("cosine", horizon=110, warmup=10)
    assert s(9) == 1.0 and s(10) == 1.0
    assert s(60) == pytest.approx(0.5)  # half way through the 100 versions after warm-up
    assert s(35) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))
    assert s(110) == pytest.approx(0.0) and s(500) == pytest.approx(0.0)  # past the horizon: stays at 0


def test_step_schedule_decays_by_gamma_every_interval():
    s = make_schedule("step", horizon=90, step_every=30, gamma=0.1)
    assert [s(v) for v in (0, 29, 30, 59, 60)] == pytest.approx([1, 1, 0.1, 0.1, 0.01])
    assert make_schedule("step", horizon=90)(30) == pytest.approx(0.1)  # default: every third of the run


def test_update_terms_put_the_mean_factor_on_the_lr():
    coeffs, factor = update_terms([1.0, 1.0, 1.0, 1.0])
    assert coeffs == [0.25] * 4 and factor == 1.0
    coeffs, factor = update_terms([1.0, 0.5])  # lr x F x sum(c g) = lr x (1 g1 + 0.5 g2) / 2
    assert factor == 0.75 and [c * factor for c in coeffs] == [0.5, 0.25]


@pytest.mark.parametrize("name,options", [
    ("sgd", dict(momentum=0.9, weight_decay=5e-4)),
    ("sgd", dict(momentum=0.9, nesterov=True)),
    ("adam", dict(weight_decay=1e-3)),
    ("adamw", dict(weight_decay=0.05, betas=(0.8, 0.99))),
])
def test_chunked_shard_optimizer_equals_torch_optim_on_the_whole_vector(name, options):
    """Stepping chunks of a slice with 1 to 3 gradients per update: the torch optimizer on one tensor."""
    torch.manual_seed(0)
    n, lr = 1000, 0.05
    start = torch.randn(n)
    grads = [[torch.randn(n) for _ in range(k % 3 + 1)] for k in range(6)]
    schedule = make_schedule("cosine", horizon=6, warmup=2)
    mine = start.clone()
    opt = ShardOptimizer(mine, builtin_optimizer(name, lr=lr, **options), schedule, chunk=64)
    ref = start.clone().requires_grad_(False)
    torch_opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name](
        [ref], lr=lr, **options)
    for v, gs in enumerate(grads):
        chunks = opt.step(gs, [1 / len(gs)] * len(gs), version=v, factor=1.0)
        assert chunks == 16
        torch_opt.param_groups[0]["lr"] = lr * schedule(v)
        ref.grad = torch.stack(gs).mean(0)
        torch_opt.step()
    assert torch.allclose(mine, ref, rtol=0, atol=1e-6)
    assert not torch.equal(mine, start)


def test_factor_multiplies_the_learning_rate_not_the_gradient():
    """Adam is blind to a gradient's scale: a staleness factor must act on its learning rate."""
    g = torch.randn(50)
    a, b = torch.zeros(50), torch.zeros(50)
    ShardOptimizer(a, builtin_optimizer("adam", lr=0.1), lambda v: 1.0).step([g], [1.0], version=0, factor=0.5)
    ShardOptimizer(b, builtin_optimizer("adam", lr=0.05), lambda v: 1.0).step([g], [1.0], version=0, factor=1.0)
    assert torch.equal(a, b) and a.abs().sum() > 0


def test_state_round_trips_and_progress_is_poked_per_chunk():
    x = torch.ones(10)
    opt = ShardOptimizer(x, builtin_optimizer("sgd", lr=0.1, momentum=0.9), lambda v: 1.0, chunk=4)
    pokes = []
    opt.step([torch.ones(10)], [1.0], version=0, factor=1.0, progress=lambda: pokes.append(1))
    assert len(pokes) == 3
    y = x.clone()
    other = ShardOptimizer(y, builtin_optimizer("sgd", lr=0.1, momentum=0.9), lambda v: 1.0, chunk=4)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))  # as read back from a checkpoint file
    for o in (opt, other):
        o.step([torch.ones(10)], [1.0], version=1, factor=1.0)
    assert torch.equal(x, y)
    assert float(x[0]) == pytest.approx(1 - 0.1 - 0.1 * 1.9)  # momentum buffer 1, then 1.9


def test_a_factory_that_returns_no_optimizer_is_refused():
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        ShardOptimizer(torch.zeros(3), lambda params: object(), lambda v: 1.0)


def test_optimizer_state_of_another_length_is_refused_not_loaded():
    """torch loads a momentum of another length without a word; a shard's optimizer names the mismatch."""
    make = builtin_optimizer("sgd", lr=0.1, momentum=0.9)
    written = ShardOptimizer(torch.zeros(40), make, lambda v: 1.0)
    written.step([torch.ones(40)], [1.0], version=0, factor=1.0)
    same = ShardOptimizer(torch.zeros(40), make, lambda v: 1.0)
    same.load_state_dict(written.state_dict())
    assert torch.equal(same.optimizer.state[same.chunks[0]]["momentum_buffer"], torch.ones(40))
    other = ShardOptimizer(torch.zeros(45), make, lambda v: 1.0)
    with pytest.raises(ValueError, match=r"'momentum_buffer' of chunk 0 has shape \(40,\), the chunk \(45,\)"):
        other.load_state_dict(written.state_dict())


@pytest.mark.parametrize("name,options", [("sgd", dict(momentum=0.9, weight_decay=5e-4)),
                                          ("adam", dict(weight_decay=1e-3))])
def test_an_update_stepped_a_piece_at_a_time_is_bit_for_bit_the_update_at_once(name, options):
    """``begin``, ``step_range`` over the pieces in any order, ``end`` (a round released a piece at a time,
    hpcps.runtime.release): the same parameters to the last bit as ``step`` on the whole slice, with the
    chunks cut at the pieces (on the 16-value grid) or not; a range that cuts a chunk is refused."""
    torch.manual_seed(1)
    n, lr, cuts = 1000, 0.05, [96, 400, 752]
    start, make = torch.randn(n), builtin_optimizer(name, lr=lr, fused=True, **options)
    schedule = make_schedule("cosine", horizon=6, warmup=2)
    whole, pieces = start.clone(), start.clone()
    at_once = ShardOptimizer(whole, make, schedule, chunk=256)
    piecewise = ShardOptimizer(pieces, make, schedule, chunk=256, cuts=cuts)
    assert len(piecewise.spans) > len(at_once.spans) and at_once.uncut_spans == piecewise.uncut_spans
    ranges = list(zip([0, *cuts], [*cuts, n]))
    for v in range(5):
        g = torch.randn(n)
        at_once.step([g], [0.5], version=v, factor=1.5)
        piecewise.begin(version=v, factor=1.5)
        for lo, hi in ranges[::-1] if v % 2 else ranges:
            piecewise.step_range(g, 0.5, lo, hi)
        piecewise.end()
    assert torch.equal(whole, pieces) and not torch.equal(whole, start)
    with pytest.raises(ValueError, match="cuts the optimizer's chunk"):
        piecewise.step_range(torch.zeros(n), 1.0, 0, 50)


def test_a_state_cut_at_other_chunks_is_cut_again_where_it_was_written():
    """A checkpoint's optimizer state written by a shard whose chunks were cut at its pieces loads into one
    that does not cut them, and the other way (the spans it was written at given): the next steps agree
    to the last bit with the writer's; given no spans, the shape check still refuses it."""
    make, n = builtin_optimizer("sgd", lr=0.1, momentum=0.9, fused=True), 512
    for writer_cuts, reader_cuts in (([128, 320], ()), ((), [128, 320])):
        torch.manual_seed(2)
        x = torch.randn(n)
        writer = ShardOptimizer(x, make, lambda v: 1.0, chunk=256, cuts=writer_cuts)
        writer.step([torch.randn(n)], [1.0], version=0, factor=1.0)
        y = x.clone()
        reader = ShardOptimizer(y, make, lambda v: 1.0, chunk=256, cuts=reader_cuts)
        with pytest.raises(ValueError, match="the state was cut for other slices"):
            reader.load_state_dict(copy.deepcopy(writer.state_dict()))
        reader.load_state_dict(copy.deepcopy(writer.state_dict()), spans=writer.spans)
        g = torch.randn(n)
        for o in (writer, reader):
            o.step([g], [1.0], version=1, factor=1.0)
        assert torch.equal(x, y)
