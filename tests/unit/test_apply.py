"""The server's chunked in-place update (torch only; the MPI progress poke is a stub)."""

import torch

from hpcps.runtime.server import apply_update


def test_apply_is_exact_and_pokes_progress_once_per_chunk():
    master = torch.arange(10, dtype=torch.float32)
    g1, g2 = torch.ones(10), torch.full((10,), 2.0)
    pokes = []
    chunks = apply_update(master, [g1, g2], [0.5, 0.25], progress=lambda: pokes.append(1), chunk=4)
    assert chunks == len(pokes) == 3  # 4 + 4 + 2 values
    assert torch.equal(master, torch.arange(10, dtype=torch.float32) - 1.0)  # 0.5*1 + 0.25*2


def test_apply_updates_in_place():
    master = torch.zeros(5)
    storage = master.data_ptr()
    apply_update(master, [torch.ones(5)], [1.0], progress=lambda: None)
    assert master.data_ptr() == storage and torch.equal(master, -torch.ones(5))


def test_a_worker_still_on_its_first_step_counts_as_silent_only_past_the_grace():
    """torch.compile on the first step: the server must not call that worker stuck at --stall-warn."""
    from hpcps.runtime.stalls import FIRST_STEP_GRACE, silences

    heard = [0.0, 0.0, 50.0]
    # worker 0 has pushed before, worker 1 has not yet (compiling), worker 2 was heard 10 s ago
    assert silences(60.0, heard, [0, 1, 2], {0, 2}, warn=20.0) == [(60.0, 0)]
    late = 20.0 * FIRST_STEP_GRACE + 1
    assert silences(late, heard, [0, 1, 2], {0, 2}, warn=20.0) == [
        (late - 20.0 * (FIRST_STEP_GRACE - 1), 1), (late - 50.0, 2), (late, 0)]


def test_the_finiteness_check_finds_every_nan_and_infinity_wherever_it_is():
    import torch

    from hpcps.transport.compress import all_finite

    g = torch.randn(10_001)
    assert all_finite(g) and all_finite(torch.empty(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in (0, 5_000, 10_000):
            h = g.clone()
            h[at] = bad
            assert not all_finite(h)
            assert all_finite(h) == bool(torch.isfinite(h).all())
    assert all_finite(torch.full((7,), 3.4e38))  # the largest floats are finite


def test_a_shard_waits_for_a_verdict_without_spinning_a_core():
    """A shard's slice can come whole long before its worker's backward pass ends, and the verdict follows
    that end. A blocking receive spun (MPICH) for all that wait, taking a core from the workers; the wait
    polls and sleeps. The verdict is sent 0.4 s late, from another thread, on COMM_SELF."""
    import threading
    import time
    from types import SimpleNamespace

    import numpy as np
    from mpi4py import MPI

    from hpcps.runtime.server import received_verdict
    from hpcps.transport import wire

    for sent, expected in ((1, True), (0, False)):
        verdict = np.array([sent], np.int64)
        late = threading.Timer(0.4, lambda: MPI.COMM_SELF.Send(verdict, dest=0, tag=wire.TAG_VERDICT))
        wall, cpu = time.perf_counter(), time.process_time()
        late.start()
        got = received_verdict(SimpleNamespace(comm=MPI.COMM_SELF, worker_ranks=[0], dead=None),
                               SimpleNamespace(worker=0, clock=3), shard=0)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        late.join()
        assert got is expected
        assert wall >= 0.39 and cpu < 0.5 * wall, (wall, cpu)
