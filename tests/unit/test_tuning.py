"""hpcps tune's candidates and ranking (hpcps.options.tuning): every layout tried is one the run accepts, the
options the user set are kept, and the ranking is by batches a second."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings, strategies as st

from hpcps.errors import UserError
from hpcps.options.config import make_config
from hpcps.options.planning import plan
from hpcps.options.tuning import TUNED, Trial, candidates, command, ranked, table

PARADIGMS = ["bsp", "asp", "ssp", "dssp", "eager", "hsp", "localsgd", "diloco"]
SET = {"servers": st.sampled_from([1, 2]), "pull": st.sampled_from(["get", "send"]),
       "partition_mb": st.sampled_from([0.0, 0.25]), "shards_at_once": st.sampled_from([0, 1])}


@settings(max_examples=150, deadline=None)
@given(paradigm=st.sampled_from(PARADIGMS), per_node=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       model_mb=st.sampled_from([0.02, 0.6, 4.8]), user=st.fixed_dictionaries({}, optional=SET))
def test_every_candidate_is_accepted_by_the_run_keeps_what_the_user_set_and_comes_once(paradigm, per_node,
                                                                                       model_mb, user):
    nodes = [node for node, n in enumerate(per_node) for _ in range(n)]
    try:
        cfg = make_config({"paradigm": paradigm, **user})
        plan(cfg, len(nodes), nodes)
    except UserError:  # the user's own options refused (too few ranks, --pull send under asp, ...)
        return
    found = candidates(cfg, list(user), nodes, model_mb)
    assert found, (paradigm, nodes, user)  # the options as given are always a layout
    assert len({tuple(sorted(c.items())) for c in found}) == len(found)
    for c in found:
        assert set(c) == set(TUNED)
        assert all(c[name] == value for name, value in user.items())
        assert "partition_mb" in user or c["partition_mb"] == 0 or 2 * c["partition_mb"] <= model_mb
        plan(cfg.model_copy(update=c), len(nodes), nodes)  # accepted: raises otherwise


def test_two_nodes_of_two_ranks_try_one_shard_and_one_per_node_with_each_pull_and_partition():
    cfg = make_config({"paradigm": "bsp"})
    found = candidates(cfg, [], [0, 0, 1, 1], model_mb=4.8)
    layouts = {(c["servers"], c["pull"], c["partition_mb"], c["shards_at_once"]) for c in found}
    # --pull send is refused with --shards-at-once; one shard never rotates
    assert layouts == {(s, p, mb, 0) for s in (1, 2) for p in ("get", "send") for mb in (0.0, 0.25, 1.0)} | {
        (2, "get", mb, 1) for mb in (0.0, 0.25, 1.0)}
    small = candidates(make_config({"paradigm": "bsp", "pull": "get"}), ["pull"], [0, 0, 1, 1], model_mb=0.3)
    assert {c["partition_mb"] for c in small} == {0.0} and {c["pull"] for c in small} == {"get"}


def test_asp_tries_no_sent_pull():
    found = candidates(make_config({"paradigm": "asp"}), [], [0, 0, 0, 0, 0], model_mb=0.02)
    assert {c["pull"] for c in found} == {"get"} and {c["servers"] for c in found} == {1, 2}


def test_trials_rank_by_batches_a_second_and_the_best_command_keeps_the_users_words():
    fewer_workers = Trial({"servers": 2, "pull": "get", "partition_mb": 0.0, "shards_at_once": 0}, 3, 0.010)
    given = Trial({"servers": 1, "pull": "get", "partition_mb": 0.0, "shards_at_once": 0}, 4, 0.012, as_given=True)
    assert ranked([fewer_workers, given]) == [given, fewer_workers]  # 333 against 300 batches a second
    lines = table([fewer_workers, given])
    assert lines[2].startswith("| 1 | --servers 1 --pull get --partition-mb 0 --shards-at-once 0 (as given) | 4 | 12.0")
    assert lines[3].endswith("| 300.0 | 0.90 |")
    line = command(["mpiexec", "-n", "5"], ["--paradigm", "bsp", "--model", "my net.py:Net"], given.values)
    assert shlex.split(line) == ["mpiexec", "-n", "5", "hpcps", "train", "--paradigm", "bsp", "--model",
                                 "my net.py:Net", "--servers", "1", "--pull", "get", "--partition-mb", "0",
                                 "--shards-at-once", "0"]


@pytest.mark.parametrize("value, word", [(0.25, "0.25"), (1.0, "1"), (0.0, "0")])
def test_partition_sizes_print_as_the_flag_takes_them(value, word):
    assert command([], [], {"partition_mb": value}).endswith(f"--partition-mb {word}")


def test_a_printed_command_leaves_out_the_options_named_with_their_values_and_keeps_the_rest_in_order():
    from hpcps.options.words import without_options

    words = ["--top", "3", "--steps", "9", "--trial-steps=5", "--paradigms", "bsp", "asp", "--lr", "0.1",
             "--paradigms=ssp", "--out", "x.h5", "--top"]
    assert without_options(words, one=("--top", "--trial-steps"), many=("--paradigms",)) == \
        ["--steps", "9", "--lr", "0.1", "--out", "x.h5"]
    assert without_options(words) == words
    assert without_options(["--paradigms", "bsp", "asp"], many=("--paradigms",)) == []
