"""Pushes during backward (no MPI): each piece of the gradient is sent once backward has produced every
parameter in it, a shard's pieces in their order, the last layers' first, each with its final values;
the emulated backward makes a gradient ready only once its layer's share of the time has passed."""

import numpy as np
import torch

from hpcps.cluster.emulation import BackwardCompute
from hpcps.cluster.slices import Slices
from hpcps.runtime.backward import BackwardPushes
from hpcps.training.flat import FlatParameters


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def _setup(shards=2, stripe=16, emulate=None):
    model = _model()
    flat = FlatParameters(model)
    slices = Slices.plan(flat.size, flat.n_params, shards, stripe)
    order = [slices.send_order(s, flat.n_params) for s in range(shards)]
    buffers = [np.full(flat.size, np.nan, np.float32) for _ in range(2)]
    sent = []
    clock = _FakeClock()
    compute = BackwardCompute(model, lambda: 1.0, clock.sleep, clock=clock) if emulate else None
    pushes = BackwardPushes(model, flat._spans, order, [w for w, _ in slices.wire_bounds], flat.n_params,
                            flat.grads, buffers, send=lambda slot, s, k: sent.append((slot, s, k, clock.now)))
    return model, flat, slices, order, buffers, sent, pushes, compute, clock


def _pass(model, flat):
    flat.begin_pass()
    x = torch.randn(5, 6)
    loss = model(x).square().mean()
    return loss


def test_pieces_leave_during_backward_in_each_shards_order_with_their_final_values():
    model, flat, slices, order, buffers, sent, pushes, _, _ = _setup()
    assert slices.striped and all(len(o) > 2 for o in order)
    loss = _pass(model, flat)
    pushes.arm(1)
    loss.backward()
    during = list(sent)
    flat.end_pass()  # the BatchNorm statistics' change: known only now
    pushes.finish()
    trainable = {(s, k) for s, o in enumerate(order) for k, (_, _, hi) in enumerate(o) if hi <= flat.n_params}
    assert {(s, k) for _, s, k, _ in during} == trainable  # every parameter's piece during backward
    assert {(s, k) for _, s, k, _ in sent} == {(s, k) for s, o in enumerate(order) for k in range(len(o))}
    for s in range(2):  # a shard's pieces in its order
        assert [k for _, t, k, _ in sent if t == s] == list(range(len(order[s])))
    first = order[during[0][1]][during[0][2]]
    assert first[2] == flat.n_params  # the first piece out holds the last layer's parameters
    wire = np.empty(flat.size, np.float32)
    slices.gather(flat.grads, wire)
    assert np.array_equal(buffers[1], wire) and all(slot == 1 for slot, *_ in sent)
    assert np.isnan(buffers[0]).all()


def test_unarmed_pushes_send_nothing_and_removed_hooks_stay_quiet():
    model, flat, _, _, _, sent, pushes, _, _ = _setup()
    _pass(model, flat).backward()
    assert sent == []
    pushes.arm(0)
    pushes.remove()
    _pass(model, flat).backward()
    assert sent == []


def test_with_the_emulated_backward_a_piece_leaves_only_once_its_parameters_time_has_passed():
    model, flat, slices, order, _, sent, pushes, compute, clock = _setup(emulate=True)
    done = []  # (parameter, when its gradient was ready), in the order backward produced them
    for p in model.parameters():  # after the emulation's hooks, before the pushes' (put on at arm)
        p.register_post_accumulate_grad_hook(lambda q: done.append((q, clock.now)))
    compute.begin()
    loss = _pass(model, flat)
    pushes.arm(0)
    loss.backward()
    total = sum(p.numel() for p in model.parameters())
    assert abs(clock.now - 1.0) < 1e-9  # the whole emulated backward, once
    assert done[0][0] is model[5].bias or done[0][0] is model[5].weight  # the last layer first
    share = 0.0
    for p, when in done:  # each gradient ready once its share, and those before it, have passed
        share += p.numel() / total
        assert abs(when - share) < 1e-9
    ready = {id(p): when for p, when in done}
    spans = {id(p): (off, off + n) for p, _, _, off, n in flat._spans if p is not None}
    for _, s, k, when in sent:
        _, lo, hi = order[s][k]
        inside = [ready[i] for i, (a, b) in spans.items() if a < hi and lo < b]
        assert inside and when >= max(inside) - 1e-12, (s, k)
    compute.begin()
    clock.now = 5.0
    _pass(model, flat).backward()  # (unarmed) a second pass spends its second again, from its own start
    assert abs(clock.now - 6.0) < 1e-9


def test_a_lead_is_spent_before_the_first_gradient_is_ready():
    """With pushes during backward, emulated compute that would come after the pass comes before the
    first gradient (the lead), so no piece leaves before it."""
    model, flat, _, _, _, sent, pushes, _, clock = _setup()
    leads = []
    compute = BackwardCompute(model, lambda: 1.0, clock.sleep, clock=clock,
                              lead=lambda backward_s: leads.append(backward_s) or 0.5)
    compute.begin()
    loss = _pass(model, flat)
    pushes.arm(0)
    loss.backward()
    assert leads == [1.0] and abs(clock.now - 1.5) < 1e-9  # asked once per pass, told the backward time
    assert sent and min(when for *_, when in sent) > 0.5


def test_the_pushs_verdict_is_whether_every_value_it_sent_was_finite():
    """Each piece is checked as it is copied to the wire, so the verdict is ready as the pass ends: finite
    for a clean pass; not, for a NaN in a parameter's gradient (sent during backward), in the buffers' change
    (sent by finish), or a value the wire would make infinite; and each push is judged afresh."""
    model, flat, _, _, buffers, sent, pushes, _, _ = _setup()

    def push(nan_in_input=False, nan_in_buffers=False, big=None):
        loss = _pass(model, flat)
        if nan_in_input:
            loss = loss * float("nan")  # every gradient NaN: the first piece out is not finite
        pushes.arm(0)
        loss.backward()
        flat.end_pass()
        if nan_in_buffers:
            flat.grads[flat.n_params] = float("nan")  # the BatchNorm statistics' change, sent after the pass
        if big is not None:
            flat.grads[flat.n_params + 1] = big
        return pushes.finish()

    assert push() is True
    assert push(nan_in_input=True) is False
    assert push() is True  # judged afresh
    assert push(nan_in_buffers=True) is False
    assert np.isnan(buffers[0]).sum() == 1  # (the NaN went on the wire, with every other value finite)
    pushes.overflow = 1e4
    assert push(big=1e5) is False and push(big=1e3) is True
