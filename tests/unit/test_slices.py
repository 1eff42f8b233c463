"""Which values each shard holds (no MPI): contiguous blocks, or the trainable values striped."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hpcps.cluster.layout import shard_bounds
from hpcps.cluster.slices import ALIGN, MAX_CHUNKS, Slices, aligned, stripe_elements


def test_without_a_stripe_the_slices_are_the_contiguous_blocks_and_one_shard_holds_its_pieces_in_order():
    assert Slices.plan(103, 90, 4).pieces == tuple((b,) for b in shard_bounds(103, 4))
    one = Slices.plan(103, 90, 1, stripe=8)
    assert one.striped and one.pieces[0][0][0] == 0 and one.pieces[0][-1] == (90, 103)
    assert all(a[1] == b[0] for a, b in zip(one.pieces[0], one.pieces[0][1:]))  # the whole vector, in order
    assert [lo for _, lo, _ in one.local_ranges(0)] == [at for at, _, _ in one.local_ranges(0)]
    assert not Slices.plan(103, 90, 4).striped and Slices.plan(103, 90, 4).wire_bounds == shard_bounds(103, 4)
    assert stripe_elements(0) is None and stripe_elements(1.0) == 2**18


@pytest.mark.parametrize("size, n_params, shards, stripe", [(1000, 1000, 4, 64), (1000, 930, 3, 50),
                                                           (97, 90, 5, 7), (20, 12, 3, 100), (5000, 4990, 2, 4096)])
def test_striped_slices_deal_the_trainable_values_round_robin_in_chunks_of_at_most_a_stripe(size, n_params, shards,
                                                                                        stripe):
    slices = Slices.plan(size, n_params, shards, stripe)
    every = sorted(r for p in slices.pieces for r in p)
    assert every[0][0] == 0 and every[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(every, every[1:]))  # each value held once
    chunks = [r for r in every if r[1] <= n_params]
    # cuts on the grid of ALIGN values where the chunks are long enough: each moved by less than ALIGN
    on_grid = all(hi % ALIGN == 0 for _, hi in chunks[:-1])
    slack = 2 * (ALIGN - 1) if on_grid else 0
    assert all(hi - lo <= stripe + slack for lo, hi in chunks)
    owner = {r: s for s, p in enumerate(slices.pieces) for r in p}
    assert [owner[r] for r in chunks] == [k % shards for k in range(len(chunks))]  # dealt in turn
    assert len(chunks) % shards == 0  # as many chunks on every shard: near-equal slices
    sizes = [sum(hi - lo for lo, hi in p if hi <= n_params) for p in slices.pieces]
    assert max(sizes) - min(sizes) <= len(chunks) // shards * (1 + slack)
    for s in range(shards):  # trainable values first, then the shard's block of the buffers
        assert slices.trainable(s, n_params) == sizes[s]
        assert all(lo >= n_params for lo, _ in slices.pieces[s][len(chunks) // shards:])
    tails = [p[-1] for p in slices.pieces if p[-1][0] >= n_params]
    assert tails == [(n_params + a, n_params + b) for a, b in shard_bounds(size - n_params, shards) if b > a]


def test_a_range_splits_into_its_shards_pieces_and_copies_between_orders_agree():
    slices = Slices.plan(97, 90, 3, stripe=7)
    assert slices.striped
    flat = np.arange(97, dtype=np.float32)
    wire = np.zeros(97, np.float32)
    slices.gather(flat, wire)
    for s, (a, b) in enumerate(slices.wire_bounds):
        assert np.array_equal(wire[a:b], slices.take(s, flat))
    back = np.zeros(97, np.float32)
    for s, (a, b) in enumerate(slices.wire_bounds):
        slices.put(s, wire[a:b], back)
    assert np.array_equal(back, flat)
    rng = np.random.default_rng(0)
    for _ in range(200):
        lo, hi = sorted(rng.integers(0, 98, 2))
        pieces = slices.split(lo, hi)
        assert sum(y - x for _, _, x, y in pieces) == hi - lo
        assert all(a[3] == b[2] for a, b in zip(pieces, pieces[1:]))
        for s, at, x, y in pieces:  # each piece is where split says it is in its shard's local vector
            assert np.array_equal(slices.take(s, flat)[at:at + y - x], flat[x:y])
    tensor = torch.arange(97, dtype=torch.float32)
    out = torch.zeros(97)
    slices.gather(tensor, out)
    assert np.array_equal(out.numpy(), wire) and torch.equal(slices.take(1, tensor),
                                                             torch.from_numpy(slices.take(1, flat)))


def test_a_push_sends_a_shards_trainable_pieces_last_first_then_its_buffers():
    slices = Slices.plan(97, 90, 3, stripe=7)
    for s in range(3):
        order = slices.send_order(s, 90)
        assert sorted(order) == slices.local_ranges(s)
        trainable = [r for r in order if r[2] <= 90]
        assert [lo for _, lo, _ in trainable] == sorted((lo for _, lo, _ in trainable), reverse=True)
        assert order[len(trainable):] == [r for r in slices.local_ranges(s) if r[1] >= 90]
    assert Slices.plan(97, 90, 3).send_order(2, 90) == Slices.plan(97, 90, 3).local_ranges(2)  # one piece


def test_a_tiny_stripe_on_a_large_vector_makes_at_most_max_chunks_per_shard():
    slices = Slices.plan(100_000, 99_000, 3, stripe=10)  # 3300 chunks per shard asked for
    assert all(len([r for r in p if r[1] <= 99_000]) == MAX_CHUNKS for p in slices.pieces)


@settings(max_examples=200, deadline=None)
@given(n_params=st.integers(40, 5000), extra=st.integers(0, 50), parts=st.integers(2, 9),
       breaks=st.lists(st.integers(1, 4999), max_size=6))
def test_cuts_fall_on_the_grid_from_the_start_of_their_group_run_and_move_by_less_than_it(n_params, extra, parts,
                                                                                        breaks):
    breaks = sorted({b for b in breaks if b < n_params})
    before = shard_bounds(n_params + extra, parts)
    after = aligned(before, n_params, breaks)
    assert after[0][0] == 0 and after[-1][1] == n_params + extra
    assert all(a[1] == b[0] for a, b in zip(after, after[1:]))  # consecutive: each value held once
    if min(hi - lo for lo, hi in before) < 2 * ALIGN:
        assert after == before  # too short to move: as they were
        return
    starts = [0, *breaks]
    for (_, was), (_, cut) in zip(before[:-1], after[:-1]):
        assert abs(cut - was) < ALIGN and all(hi > lo for lo, hi in after)
        if cut < n_params:  # on the grid of its run of one group, or that run's end
            start = max(s for s in starts if s <= cut)
            assert (cut - start) % ALIGN == 0 or cut in breaks
        else:
            assert cut == was or cut == n_params  # in the buffers: where it fell
