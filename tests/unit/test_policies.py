"""Closed-form facts about the pure policies (no MPI)."""

import random

import pytest

from hpcps.errors import UserError
from hpcps.policies import Decision, make_policy, paradigms, policy_class


def test_registry_knows_the_classic_paradigms():
    assert {"bsp", "asp", "ssp"} <= set(paradigms())
    assert policy_class("ssp").name == "ssp"


def test_unknown_paradigm_names_the_option_and_the_choices():
    with pytest.raises(UserError, match=r"--paradigm: unknown paradigm 'nope' \(known: .*asp.*bsp.*ssp"):
        policy_class("nope")


def test_bsp_holds_a_round_until_every_worker_pushed():
    p = make_policy("bsp", 3)
    assert p.on_push(0, 1, 0, 0.0) == Decision()
    assert p.on_push(2, 1, 0, 0.0) == Decision()
    d = p.on_push(1, 1, 0, 0.0)
    assert d.updates == ((0, 2, 1),)
    assert sorted(d.grants) == [0, 1, 2]
    assert p.threshold == 0


def test_bsp_round_closes_when_the_missing_worker_leaves():
    p = make_policy("bsp", 3)
    p.on_push(0, 4, 3, 0.0)
    p.on_push(1, 4, 3, 0.0)
    d = p.on_leave(2, 0.0)
    assert d.updates == ((0, 1),) and sorted(d.grants) == [0, 1]
    # and the next round needs only the two left
    p.on_push(0, 5, 4, 0.0)
    assert p.on_push(1, 5, 4, 0.0).updates == ((0, 1),)


def test_asp_applies_and_releases_at_once():
    p = make_policy("asp", 4)
    assert p.on_push(3, 7, 2, 0.0) == Decision(updates=((3,),), grants=(3,))
    assert not type(p).worker_blocks and p.threshold == -1


def test_ssp_releases_only_within_s_of_the_slowest():
    p = make_policy("ssp", 3, staleness=1)
    assert p.on_push(0, 1, 0, 0.0) == Decision(updates=((0,),), grants=(0,))  # clocks 1,0,0: gap 1
    d = p.on_push(0, 2, 1, 0.0)  # clocks 2,0,0: gap 2 > 1
    assert d.updates == ((0,),) and d.grants == ()
    assert p.on_push(1, 1, 2, 0.0).grants == (1,)  # 2,1,0: worker 0 still 2 ahead of worker 2
    d = p.on_push(2, 1, 3, 0.0)  # 2,1,1: everyone within 1
    assert d.grants == (0, 2)


def test_ssp_leaving_worker_no_longer_holds_others_back():
    p = make_policy("ssp", 2, staleness=0)
    assert p.on_push(0, 1, 0, 0.0).grants == ()  # clocks 1,0: one ahead of worker 1
    assert p.on_leave(1, 0.0).grants == (0,)  # worker 1 is gone: nobody to wait for
    assert p.on_push(0, 2, 1, 0.0).grants == (0,)


def _simulate(name, n, steps, staleness, seed):
    """Drive a policy with a random interleaving of workers; check universal invariants.

    A blocked worker pushes again only after its grant. Returns the largest
    clock gap seen when a worker was released.
    """
    rng = random.Random(seed)
    p = make_policy(name, n, staleness=staleness)
    blocks = type(p).worker_blocks
    clocks, version, held, applied = [0] * n, 0, set(), []
    can_push = set(range(n))
    worst_gap = 0
    while any(c < steps for c in clocks) or held:
        ready = [w for w in can_push if clocks[w] < steps]
        if not ready:
            raise AssertionError(f"{name}: deadlock with clocks {clocks}")
        w = rng.choice(ready)
        clocks[w] += 1
        held.add(w)
        can_push.discard(w)
        decisions = [p.on_push(w, clocks[w], version, 0.0)]
        if clocks[w] == steps:
            decisions.append(p.on_leave(w, 0.0))
        for d in decisions:
            for group in d.updates:
                assert set(group) <= held, "applied a gradient that was not pending"
                held.difference_update(group)
                applied.extend(group)
                version += 1
            for g in d.grants:
                live = [clocks[q] for q in range(n) if clocks[q] < steps or q == g]
                worst_gap = max(worst_gap, clocks[g] - min(live))
                can_push.add(g)
        if not blocks:
            can_push.add(w)
    assert sorted(applied) == sorted(q for q in range(n) for _ in range(steps)), "a gradient was lost"
    return worst_gap


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("name,staleness,bound", [("bsp", 0, 0), ("ssp", 0, 0), ("ssp", 2, 2), ("ssp", 5, 5)])
def test_random_interleavings_keep_the_bound_and_lose_nothing(name, staleness, bound, seed):
    assert _simulate(name, n=4, steps=12, staleness=staleness, seed=seed) <= bound


def test_asp_random_interleavings_lose_nothing():
    for seed in range(20):
        _simulate("asp", n=4, steps=12, staleness=0, seed=seed)
