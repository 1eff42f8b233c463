"""The server's chunked in-place update (torch only; the MPI progress poke is a stub)."""

import torch

from hpcps.server import apply_update


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
