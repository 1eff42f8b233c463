"""Rank layout and shard arithmetic (pure)."""

import pytest

from hpcps.errors import UserError
from hpcps.cluster.layout import Layout, Role, shard_bounds


@pytest.mark.parametrize("n,parts", [(10, 1), (10, 3), (9610, 2), (5, 5), (3, 4)])
def test_shards_cover_the_vector_contiguously(n, parts):
    bounds = shard_bounds(n, parts)
    assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_roles_are_consecutive_blocks():
    lay = Layout(8, n_servers=2, n_groups=1)
    assert [lay.role(r) for r in range(8)] == [Role.SERVER] * 2 + [Role.GROUP] + [Role.WORKER] * 5
    assert lay.n_workers == 5 and list(lay.worker_ranks()) == [3, 4, 5, 6, 7]
    assert lay.worker_index(3) == 0 and lay.worker_rank(4) == 7


def test_too_few_ranks_says_how_many_are_needed():
    with pytest.raises(UserError, match=r"world of 3 rank\(s\) is too small for --servers 2 and --groups 1: "
                                        r"at least 4 ranks"):
        Layout(3, n_servers=2, n_groups=1)


def test_spares_are_the_last_ranks_and_not_workers():
    lay = Layout(7, n_servers=2, n_spares=2)
    assert [lay.role(r) for r in range(7)] == [Role.SERVER] * 2 + [Role.WORKER] * 3 + [Role.SPARE] * 2
    assert lay.n_workers == 3 and list(lay.worker_ranks()) == [2, 3, 4]
    assert list(lay.spare_ranks()) == [5, 6] and list(lay.training_ranks()) == [2, 3, 4, 5, 6]
    assert lay.describe().endswith("3 worker(s) (rank 2-4), 2 spare worker(s) (rank 5-6)")
    with pytest.raises(ValueError):
        lay.worker_index(5)
    assert Layout(5).spare_ranks() == range(5, 5) and Layout(5).n_workers == 4


def test_too_few_ranks_for_the_spares_says_how_many_are_needed():
    with pytest.raises(UserError, match=r"world of 3 rank\(s\) is too small for --servers 1, --groups 0 and "
                                        r"--spare-workers 2: at least 4 ranks"):
        Layout(3, n_spares=2)


def test_each_client_of_the_central_shards_starts_its_rotation_at_its_own_shard():
    """--shards-at-once: a worker's rotation starts at its index, a group server's at its group (were every group
    server to start at shard 0, their reads would all fan into one shard's link first), a central shard's at 0;
    a spare placed at a worker's index starts at that index."""
    lay = Layout(9, n_servers=2, n_groups=3, n_spares=1)  # servers 0-1, group servers 2-4, workers 5-7, spare 8
    assert [lay.rotation_start(r) for r in range(8)] == [0, 0, 0, 1, 2, 0, 1, 2]
    assert lay.rotation_start(8, index=1) == 1
