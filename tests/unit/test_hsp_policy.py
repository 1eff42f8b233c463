"""HSP's rule, by hand: BSP rounds, and extras applied alone with weight 1/(1+s)."""

import pytest

from hpcps.policies import Decision, make_policy


def test_rounds_close_like_bsp_and_extras_are_scaled_by_their_staleness():
    hsp = make_policy("hsp", 2)
    assert hsp.serial_transfers and hsp.extra_gradients and hsp.worker_blocks
    assert hsp.on_push(1, 1, 0, 0.0) == Decision()  # the round waits for worker 0
    assert hsp.on_push(0, 1, 0, 0.1) == Decision(updates=((0, 1),), grants=(0, 1))  # version 0 -> 1
    # both computed an extra on version 0 while the round was open; read after it closed
    assert hsp.on_push(0, 2, 0, 0.2, extra=True) == Decision(updates=((0,),), grants=(0,), weights=(0.5,))
    d = hsp.on_push(1, 2, 0, 0.3, extra=True)  # versions 1 and 2 have been applied since: s = 2
    assert d.updates == ((1,),) and d.weights == (pytest.approx(1 / 3),)
    assert hsp.version == 3
    assert hsp.on_push(0, 3, 3, 0.4) == Decision()  # the next round, on version 3
    assert hsp.on_leave(1, 0.5) == Decision(updates=((0,),), grants=(0,))  # closes without the leaver
    assert hsp.version == 4 and hsp.threshold(0) == -1


def test_a_resumed_hsp_counts_staleness_from_the_checkpoints_version():
    """Resumed at version 500, an extra computed on version 498 is 2 updates stale: weight 1/3 (counting
    from 0 it would be -498 stale, and its weight negative)."""
    policy = make_policy("hsp", 2)
    policy.resume_at(500)
    policy.on_push(0, 1, 500, 0.0)
    closed = policy.on_push(1, 1, 500, 0.0)
    assert closed.updates == ((0, 1),) and policy.version == 501
    extra = policy.on_push(0, 2, 499, 0.1, extra=True)
    assert extra.weights == (pytest.approx(1 / 3),) and policy.version == 502
