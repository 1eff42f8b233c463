"""Groups of similar speed: the straggler goes with slow peers only."""

import pytest

from hpcps.cluster.grouping import speed_groups


def test_a_4x_straggler_gets_a_group_of_its_own_with_two_groups():
    times = {3: 0.010, 4: 0.011, 5: 0.0105, 6: 0.040}
    assert speed_groups(times, 2) == [[3, 4, 5], [6]]


def test_groups_follow_the_speed_clusters_not_the_ranks():
    times = {1: 0.04, 2: 0.01, 3: 0.041, 4: 0.0101, 5: 0.09, 6: 0.0102}
    assert speed_groups(times, 3) == [[2, 4, 6], [1, 3], [5]]


def test_one_group_holds_everyone_and_n_groups_are_singletons_fastest_first():
    times = {7: 3.0, 8: 1.0, 9: 2.0}
    assert speed_groups(times, 1) == [[7, 8, 9]]
    assert speed_groups(times, 3) == [[8], [9], [7]]


def test_equal_times_are_split_by_rank_into_contiguous_blocks():
    times = {r: 0.01 for r in range(2, 8)}
    groups = speed_groups(times, 2)
    assert sorted(sum(groups, [])) == list(range(2, 8)) and all(groups)


@pytest.mark.parametrize("times,g", [({1: 0.1}, 2), ({1: 0.1, 2: 0.2}, 0), ({1: 0.0, 2: 0.1}, 1)])
def test_bad_input_is_refused(times, g):
    with pytest.raises(ValueError):
        speed_groups(times, g)
