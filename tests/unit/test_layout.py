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
