"""Closed-form facts about the pure policies (no MPI)."""

import random

import pytest

from hpcps.errors import UserError
from hpcps.policies import Decision, make_policy, paradigms, policy_class
from hpcps.policies.dssp import extra_iterations


def test_registry_knows_the_classic_paradigms():
    assert {"bsp", "asp", "ssp", "dssp"} <= set(paradigms())
    assert policy_class("ssp").name == "ssp"


def test_unknown_paradigm_names_the_option_and_the_choices():
    with pytest.raises(UserError, match=r"--paradigm: unknown paradigm 'nope' \(known: .*asp.*bsp.*ssp"):
        policy_class("nope")


def test_bsp_holds_a_round_until_every_worker_pushed():
    p = make_policy("bsp", 3)
    assert p.on_push(0, 1, 0, 0.0) == Decision()
    assert p.on_push(2, 1, 0, 0.0) == Decision()
    d = p.on_push(1, 1, 0, 0.0)
    assert d.updates == ((0, 1, 2),)  # in worker order, whatever the arrival order
    assert sorted(d.grants) == [0, 1, 2]
    assert p.threshold(1) == 0


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
    assert p.threshold(3) == -1
    # the worker waits for its own gradient's update (granted with it), for no other: read-my-writes
    assert type(p).worker_blocks and not make_policy("eager", 4).worker_blocks


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


def _simulate(name, n, steps, staleness, seed, staleness_max=None):
    """Drive a policy with a random interleaving of workers; check universal invariants.

    A blocked worker pushes again only after its grant; event times grow by
    random steps, longer for the last worker (a straggler). Returns the
    largest clock gap seen when a worker was released.
    """
    rng = random.Random(seed)
    p = make_policy(name, n, staleness=staleness, staleness_max=staleness_max)
    now = 0.0
    blocks = type(p).worker_blocks
    clocks, version, held, applied = [0] * n, 0, set(), []
    can_push = set(range(n))
    worst_gap = 0
    while any(c < steps for c in clocks) or held:
        ready = [w for w in can_push if clocks[w] < steps]
        if not ready:
            raise AssertionError(f"{name}: deadlock with clocks {clocks}")
        w = rng.choice(ready)
        now += rng.random() * (3.0 if w == n - 1 else 1.0)
        clocks[w] += 1
        held.add(w)
        can_push.discard(w)
        decisions = [p.on_push(w, clocks[w], version, now)]
        if clocks[w] == steps:
            decisions.append(p.on_leave(w, now))
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
@pytest.mark.parametrize("name,staleness,staleness_max,bound", [
    ("bsp", 0, None, 0), ("ssp", 0, None, 0), ("ssp", 2, None, 2), ("ssp", 5, None, 5),
    ("dssp", 1, 1, 1), ("dssp", 1, 4, 4), ("dssp", 0, 6, 6),
])
def test_random_interleavings_keep_the_bound_and_lose_nothing(name, staleness, staleness_max, bound, seed):
    assert _simulate(name, n=4, steps=12, staleness=staleness, seed=seed, staleness_max=staleness_max) <= bound


def test_asp_random_interleavings_lose_nothing():
    for seed in range(20):
        _simulate("asp", n=4, steps=12, staleness=0, seed=seed)


# -- DSSP --------------------------------------------------------------------------------------

def test_controller_aligns_the_fast_push_with_a_slow_one():
    # fast pushes at 4, 5, 6, 7, 8 for i = 0..4; slow pushes at 6, 9, 12: i = 2 meets 6 exactly
    assert extra_iterations(4.0, 1.0, 3.0, 3.0, r_max=4) == 2
    # the slow worker's next push (4.1) is imminent: waiting now is best
    assert extra_iterations(4.0, 1.0, 1.1, 3.0, r_max=4) == 0
    # fast at 0, 2, 4; slow at 1, 3, 5: every i is 1 away, the smallest i wins the tie
    assert extra_iterations(0.0, 2.0, -1.0, 2.0, r_max=2) == 0
    assert extra_iterations(4.0, 1.0, 3.0, 3.0, r_max=1) == 1  # the range caps r*


def test_dssp_hand_timed_scenario():
    """s_lo=1, s_hi=5; worker 0 pushes every 1 s, worker 1 every 3 s (timeline worked out by hand)."""
    p = make_policy("dssp", 2, staleness=1, staleness_max=5)
    assert p.on_push(1, 1, 0, 0.0).grants == (1,)
    assert p.on_push(0, 1, 1, 1.0).grants == (0,)
    assert p.on_push(0, 2, 2, 2.0).grants == (0,)  # gap 1 = s_lo
    assert p.on_push(1, 2, 3, 3.0).grants == (1,)
    assert p.on_push(0, 3, 4, 3.0).grants == (0,)  # clocks 3,2
    # clocks 4,2: gap 2 passes the bound; T_f=4, Δ_f=1, T_s=3, Δ_s=3: r* = 2, bound 2 - 1 + 2 = 3
    assert p.on_push(0, 4, 5, 4.0).grants == (0,)
    assert p.threshold(0) == 3 and p.last_decision[0] == (4.0, 0, 2, 2, 3)
    assert p.on_push(0, 5, 6, 5.0).grants == (0,)  # gap 3 <= 3
    # gap 4: the slow worker pushes right now (6 = 3 + 3): r* = 0, wait with bound 3 ...
    assert p.on_push(0, 6, 7, 6.0).grants == ()
    assert p.last_decision[0] == (6.0, 0, 4, 0, 3)
    # ... and its aligned push releases the fast worker at once
    assert p.on_push(1, 3, 8, 6.0).grants == (0, 1)
    # clocks 7,3: gap 4 again; T_f=7, T_s=6: pushes at 7, 8, 9 for i = 0..2 and the slow one's
    # next at 9, so r* = 2 and the bound rises to 4 - 1 + 2 = 5 = s_hi
    assert p.on_push(0, 7, 9, 7.0).grants == (0,)
    assert p.last_decision[0] == (7.0, 0, 4, 2, 5)
    assert p.on_push(0, 8, 10, 8.0).grants == (0,)  # gap 5 <= 5
    assert p.on_push(1, 4, 11, 9.0).grants == (1,)  # clocks 8,4
    assert p.on_push(0, 9, 12, 9.0).grants == (0,)  # gap 5
    assert p.on_push(0, 10, 13, 10.0).grants == ()  # gap 6: r* range is empty, the bound stays at s_hi
    assert p.threshold(0) == 5
    assert p.on_push(1, 5, 14, 12.0).grants == (0, 1)  # clocks 10,5


@pytest.mark.parametrize("seed", range(10))
def test_dssp_with_equal_bounds_is_exactly_ssp(seed):
    rng = random.Random(seed)
    dssp, ssp = make_policy("dssp", 3, staleness=2, staleness_max=2), make_policy("ssp", 3, staleness=2)
    clocks, can_push, now = [0, 0, 0], {0, 1, 2}, 0.0
    for _ in range(60):
        w = rng.choice(sorted(can_push))
        now += rng.random()
        clocks[w] += 1
        can_push.discard(w)
        a, b = dssp.on_push(w, clocks[w], 0, now), ssp.on_push(w, clocks[w], 0, now)
        assert a == b
        can_push.update(a.grants)
    assert all(dssp.threshold(w) == 2 for w in range(3))
    made = [d for d in dssp.last_decision if d is not None]
    assert made and all(r == 0 for _, _, _, r, _ in made)  # the range forced r* = 0


def test_ssp_restored_from_its_state_makes_the_same_decisions_as_the_original():
    """A checkpoint keeps ssp's clocks: the restored policy releases exactly as the one that went on
    (built afresh from zero clocks, it held a worker the bound lets go)."""
    original = make_policy("ssp", 4, staleness=1)
    for w, clock in [(0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (1, 2)]:
        original.on_push(w, clock, 0, 0.0)
    original.waiting.clear()  # a checkpoint is taken once every worker has left: nobody waits
    restored, fresh = make_policy("ssp", 4, staleness=1), make_policy("ssp", 4, staleness=1)
    restored.load_state_dict(original.state_dict())
    assert restored.clocks == [2, 2, 1, 1]
    # worker 2's second gradient: within 1 of the slowest (clock 1), so it goes on
    assert restored.on_push(2, 2, 0, 0.0) == original.on_push(2, 2, 0, 0.0) == Decision(updates=((2,),), grants=(2,))
    assert fresh.on_push(2, 2, 0, 0.0).grants == ()  # from zeros: the floor is 0


def test_dssp_keeps_its_bounds_and_intervals_through_a_checkpoint():
    p = make_policy("dssp", 3, staleness=1, staleness_max=4)
    for w, c, t in [(0, 1, 0.1), (1, 1, 0.2), (0, 2, 0.3), (0, 3, 0.4), (0, 4, 0.5)]:
        p.on_push(w, c, 0, t)
    q = make_policy("dssp", 3, staleness=1, staleness_max=4)
    q.load_state_dict(p.state_dict())
    assert (q.clocks, q.bound, q.interval) == (p.clocks, p.bound, p.interval) and q.bound[0] > 1
    assert q.last_push == [None] * 3  # push times were on the old run's clock


def test_dssp_holds_memory_of_the_worker_count_however_long_the_run():
    """A fast worker pushing past its bound 20000 times (a controller decision each time) against a slow one:
    no container the policy keeps grows past the worker count (it kept every decision, 27.6 MB per shard
    after 100k pushes)."""
    p = make_policy("dssp", 2, staleness=1, staleness_max=3)
    slow, fast, t, decided = 0, 0, 0.0, set()
    for _ in range(20000):  # the slow worker pushes once per 3 of the fast one's, sooner if the fast one waits
        t += 1.0
        fast += 1
        held = not p.on_push(0, fast, 0, t).grants
        decided.add(p.last_decision[0])
        if held or fast % 3 == 0:
            slow += 1
            p.on_push(1, slow, 0, t + 0.5)
    sizes = {k: len(v) for k, v in vars(p).items() if isinstance(v, (list, dict, set, tuple))}
    assert len(decided) > 1000, len(decided)  # the controller decided again and again
    assert max(sizes.values()) <= 4, sizes  # (SSP's lazily cleaned heaps hold a few stale entries)


def test_a_spare_in_a_dead_workers_place_is_held_to_the_ssp_bound_at_the_dead_workers_clock():
    """ssp, s=1: worker 2 pushed 2 gradients and died (on_leave); the others run on to clock 5, unbounded by
    it. A spare joins in its place (on_join): its clock is 2 again, so a worker at clock 5 is not granted
    until the newcomer's pushes bring the slowest clock to 4."""
    p = make_policy("ssp", 3, staleness=1)
    for clock in (1, 2):
        for w in (0, 1, 2):
            p.on_push(w, clock, 0, 0.0)
    p.on_leave(2, 0.0)
    for clock in (3, 4, 5):  # the dead worker, at 2, holds nobody back
        assert p.on_push(0, clock, 0, 0.0).grants == (0,)
        assert p.on_push(1, clock, 0, 0.0).grants == (1,)
    assert p.slowest_clock() == 5
    assert p.on_join(2, 1.0) == Decision()
    assert p.slowest() == 2 and p.slowest_clock() == 2
    assert p.on_push(0, 6, 0, 1.0).grants == () and p.on_push(1, 6, 0, 1.0).grants == ()
    assert p.on_push(2, 3, 0, 1.0).grants == (2,)
    assert p.on_push(2, 4, 0, 1.0).grants == (2,)
    assert p.on_push(2, 5, 0, 1.0).grants == (0, 1, 2)  # the slowest is at 5 now: clock 6 - 1 <= 5


def test_a_spare_under_dssp_starts_from_the_lower_bound_with_no_push_times_of_the_dead():
    p = make_policy("dssp", 2, staleness=1, staleness_max=4)
    for t, clock in ((0.0, 1), (1.0, 2)):
        p.on_push(1, clock, 0, t)
    p.bound[1] = 3
    p.on_leave(1, 2.0)
    p.on_join(1, 5.0)
    assert p.bound[1] == 1 and p.last_push[1] is None and p.interval[1] is None
    assert 1 in p.active and p.slowest() == 0


def test_the_asynchronous_paradigms_take_spares_and_the_rounds_do_not():
    takes = {name for name, cls in paradigms().items() if cls.takes_spares and cls.runs_through}
    assert {"asp", "ssp", "dssp", "eager"} <= takes
    assert not takes & {"bsp", "hsp", "grouped", "localsgd", "diloco"}
