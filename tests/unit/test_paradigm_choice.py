"""``--paradigm auto``'s rule and options (pure): which trial is chosen, what the run is, what is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hpcps.cli import build_parser
from hpcps.errors import UserError
from hpcps.options import paradigm_choice as pc
from hpcps.options.config import CHOOSABLE, make_config
from hpcps.options.effects import no_effect
from hpcps.options.planning import plan, resolve, resolve_each
from hpcps.policies import policy_class


def trial(paradigm, rate, staleness, stopped=""):
    return pc.ParadigmTrial(paradigm, 4, rate, 4 / rate, staleness, stopped)


def test_the_most_batches_a_second_is_chosen_where_it_is_more_than_the_margin_ahead():
    trials = [trial("bsp", 100.0, 0.0), trial("ssp", 104.0, 1.5), trial("asp", 120.0, 2.0)]
    assert pc.choose(trials).paradigm == "asp"


def test_within_the_margin_of_the_fastest_the_least_stale_is_chosen():
    trials = [trial("bsp", 96.0, 0.0), trial("ssp", 100.0, 1.5), trial("asp", 94.0, 0.5)]
    assert pc.choose(trials).paradigm == "bsp"  # 96 >= 0.95 x 100; asp's 94 is not
    trials = [trial("bsp", 94.0, 0.0), trial("dssp", 100.0, 1.9), trial("ssp", 99.0, 1.5)]
    assert pc.choose(trials).paradigm == "ssp"


def test_a_trial_that_stopped_on_its_own_is_never_chosen_and_if_all_did_the_message_names_each():
    trials = [trial("asp", 500.0, 3.0, "diverged"), trial("bsp", 100.0, 0.0)]
    assert pc.choose(trials).paradigm == "bsp"
    with pytest.raises(UserError, match="asp: diverged; bsp: diverged.*lower --lr"):
        pc.choose([trial("asp", 5.0, 3.0, "diverged"), trial("bsp", 1.0, 0.0, "diverged")])


@given(st.lists(st.tuples(st.sampled_from(CHOOSABLE), st.floats(1, 1000), st.floats(0, 10), st.booleans()),
                min_size=1, max_size=4, unique_by=lambda t: t[0]))
def test_the_choice_is_never_slower_than_the_margin_allows_nor_staler_than_one_within_it(drawn):
    trials = [trial(p, rate, s, "diverged" if stopped else "") for p, rate, s, stopped in drawn]
    live = [t for t in trials if not t.stopped_by]
    if not live:
        with pytest.raises(UserError):
            pc.choose(trials)
        return
    chosen = pc.choose(trials)
    fastest = max(t.batches_per_s for t in live)
    assert not chosen.stopped_by and chosen.batches_per_s >= (1 - pc.MARGIN) * fastest
    assert all(chosen.staleness <= t.staleness for t in live if t.batches_per_s >= (1 - pc.MARGIN) * fastest)


def measured(paradigm, rate, staleness, compute_s):
    return pc.ParadigmTrial(paradigm, 4, rate, 4 / rate, staleness, "", compute_s)


def test_asp_is_tried_first_and_the_others_keep_their_order():
    assert pc.trial_order(["bsp", "ssp", "dssp", "asp"]) == ["asp", "bsp", "ssp", "dssp"]
    assert pc.trial_order(["dssp", "bsp"]) == ["dssp", "bsp"]


def test_a_straggler_whose_pace_bounds_every_bounded_paradigm_below_asp_leaves_them_untried():
    # a worker at 60 ms of compute a step: bsp, ssp, dssp train at most 4 / 0.06 = 66.7 batches a second
    asp = measured("asp", 95.0, 2.5, 0.060)
    assert pc.ceiling(asp) == pytest.approx(4 / 0.06)
    for paradigm in pc.BOUNDED:
        assert pc.skip(paradigm, [asp]) == ("at most 66.7 batches/s, its workers at the slowest one's pace (60.0 ms "
                                            "of compute a step in asp's trial), more than 5% short of asp's 95.0")
    # at 70.0 batches a second, 66.7 is within 5% (0.95 x 70 = 66.5): bsp might be chosen, so it is tried
    assert pc.skip("bsp", [measured("asp", 70.0, 2.5, 0.060)]) is None
    # the highest ceiling any trial measured stands (compute a step is the model's, not the paradigm's)
    assert pc.skip("ssp", [asp, measured("bsp", 60.0, 0.0, 0.040)]) is None
    # nothing is left out on a trial that stopped on its own, or one whose compute was not measured
    assert pc.skip("bsp", [pc.ParadigmTrial("asp", 4, 95.0, 0.04, 2.5, "diverged", 0.06)]) is None
    assert pc.skip("bsp", [measured("asp", 95.0, 2.5, 0.0)]) is None
    assert pc.skip("asp", [measured("bsp", 10.0, 0.0, 0.5)]) is None  # (asp is never left out)


def test_where_bsp_is_within_the_margin_of_asp_ssp_and_dssp_are_left_untried():
    asp, bsp = measured("asp", 110.0, 2.6, 0.022), measured("bsp", 122.0, 0.0, 0.021)
    for paradigm in pc.WAITING_ASP:
        assert pc.skip(paradigm, [asp, bsp]) == (f"bsp's 122.0 batches/s are the most, and {paradigm}, asp with "
                                                 f"waits, would be no faster than asp's 110.0: bsp, the least "
                                                 f"stale, is chosen")
        assert pc.skip(paradigm, [asp, measured("bsp", 105.0, 0.0, 0.021)]).startswith(
            "bsp's 105.0 batches/s are within 5% of asp's 110.0, and ")  # 105 >= 0.95 x 110
        assert pc.skip(paradigm, [asp, measured("bsp", 104.4, 0.0, 0.021)]) is None  # 104.4 < 0.95 x 110
        assert pc.skip(paradigm, [bsp]) is None  # (without asp's trial, nothing bounds theirs)
        assert pc.skip(paradigm, [asp]) is None


def test_where_asps_trial_diverged_within_their_bound_ssp_and_dssp_would_replay_it_and_are_not_tried():
    """ssp's waits compare a worker's lead over the slowest with its bound (dssp's with its lower one first):
    where asp's trial diverged and no worker led by more, theirs would have been asp's updates."""
    def asp(lead, stopped="diverged"):
        return pc.ParadigmTrial("asp", 4, 2.4, 1.7, 2.7, stopped, 1.36, lead)

    for paradigm in pc.WAITING_ASP:
        assert pc.skip(paradigm, [asp(2)], bound=2) == (
            f"asp's trial diverged with no worker more than 2 gradient(s) ahead of the slowest, within "
            f"{paradigm}'s bound of 2: its waits would not have come into play, and its updates would have "
            f"been asp's")
        assert pc.skip(paradigm, [asp(0)], bound=0) is not None
        assert pc.skip(paradigm, [asp(3)], bound=2) is None  # (a worker led by more: its waits would bind)
        assert pc.skip(paradigm, [asp(-1)], bound=2) is None  # (lead not measured)
        assert pc.skip(paradigm, [asp(1, stopped="")], bound=2) is None  # (asp trained: the rules above)
        assert pc.skip(paradigm, [asp(1, stopped="not learning")], bound=2) is None
        assert pc.skip(paradigm, [asp(1)]) is None  # (no bound given)
    assert pc.skip("bsp", [asp(1)], bound=2) is None  # (bsp's rounds are no asp with waits)


def test_a_trials_lead_counts_its_steps_from_its_first_as_a_leg_going_on_from_another_starts_them():
    """Worker 1 computes three steps while worker 2 computes one (each applied as it ends): at its third step's
    start worker 1 is 2 ahead of worker 2, whose first gradient is not yet applied. The same trial as a leg
    going on from step 10 (its rows' steps 10-12) has the same lead, not 12."""
    from hpcps.metrics.schema import ITERATION, UPDATE
    from hpcps.runtime.tune import trial_lead

    def trial(first):
        it = np.zeros(4, ITERATION)
        it["rank"], it["step"] = [1, 1, 1, 2], [first, first + 1, first + 2, first]
        it["t_start"] = [0.0, 1.0, 2.0, 0.0]
        up = np.zeros(4, UPDATE)
        up["worker"], up["worker_clock"], up["t"] = [1, 1, 1, 2], [first + 1, first + 2, first + 3, first + 1], \
            [0.9, 1.9, 2.9, 3.0]
        return it, up

    assert trial_lead(*trial(0)) == 2 and trial_lead(*trial(10)) == 2
    assert trial_lead(np.zeros(0, ITERATION), np.zeros(0, UPDATE)) == -1


#: a share drawn near the margin's edge as often as anywhere
SHARE = st.one_of(st.floats(0.05, 1.0), st.floats(0.93, 1.0))


@settings(max_examples=500)
@given(st.floats(10, 1000), st.one_of(st.floats(0.2, 3.0), st.floats(0.9, 1.1)),
       st.lists(SHARE, min_size=3, max_size=3), st.lists(st.floats(0.0, 1.0), min_size=2, max_size=2),
       st.floats(0.01, 5), st.permutations(CHOOSABLE), st.integers(1, 4))
def test_leaving_out_the_trials_skip_names_never_changes_the_choice(asp_rate, reach, shares, stale, asp_stale,
                                                                     given_order, n):
    """Any of the four paradigms in any order, as the rule's model has them: asp at ``asp_rate``, the slowest
    worker's compute a step the same in every trial, what a bounded paradigm may reach (the workers over
    that compute) ``reach`` times asp's rate, each bounded paradigm at a share of it (ssp and dssp no
    faster than asp either). Trying them in :func:`trial_order`, less those :func:`skip` names, chooses
    what trying all would."""
    ceiling = reach * asp_rate
    rates = {"asp": asp_rate, "bsp": shares[0] * ceiling, "ssp": shares[1] * min(ceiling, asp_rate),
             "dssp": shares[2] * min(ceiling, asp_rate)}
    stales = {"asp": asp_stale, "bsp": 0.0, "ssp": stale[0] * asp_stale, "dssp": stale[1] * asp_stale}
    truth = {p: measured(p, rates[p], stales[p], 4 / ceiling) for p in CHOOSABLE}
    paradigms = list(given_order)[:n]
    tried = []
    for p in pc.trial_order(paradigms):
        if pc.skip(p, tried) is None:
            tried.append(truth[p])
    assert pc.choose(tried).paradigm == pc.choose([truth[p] for p in paradigms]).paradigm


def test_the_run_is_the_same_command_with_the_paradigm_typed():
    given = {"momentum": 0.9, "lr": 0.05, "steps": 400, "slowdown": ["4=2"], "compute_time": 0.01}
    auto = make_config({**given, "paradigm": "auto", "paradigms": ["asp", "bsp"], "trial_steps": 12})
    for paradigm in ("asp", "bsp"):
        chosen = pc.as_chosen(auto, paradigm)
        assert chosen == make_config({**given, "paradigm": paradigm})
        assert not chosen.model_fields_set & pc.AUTO_OPTIONS
    assert [c.paradigm for c in pc.candidates(auto)] == ["asp", "bsp"]
    # ssp's bound: the default of the paradigm typed, not of auto
    assert pc.as_chosen(auto, "ssp").s_lo == make_config({"paradigm": "ssp"}).s_lo == 2


def test_paradigms_auto_cannot_rank_are_refused_naming_the_choices():
    for wrong in (["eager"], ["bsp", "diloco"], ["my.py:Mine"], []):
        with pytest.raises(UserError, match="--paradigms: .*chooses among bsp, ssp, dssp, asp"):
            make_config({"paradigms": wrong})
    assert make_config({"paradigms": "asp, bsp,asp"}).paradigms == ("asp", "bsp")  # TOML's one string
    assert make_config({}).paradigms == CHOOSABLE


@pytest.mark.parametrize("options, says", [
    ({"lr_scaling": "none"}, "drop --lr-scaling none"),
    ({"resume": "ckpt.h5"}, "resume under the paradigm the first run chose"),
    ({"paradigm_option": ["k=1"]}, "a paradigm of your own"),
])
def test_options_under_which_the_rule_does_not_hold_are_refused_before_a_trial(options, says):
    cfg = make_config({"paradigm": "auto", **options})
    with pytest.raises(UserError, match=says):
        resolve_each(cfg, 5)


@pytest.mark.parametrize("options, chosen_from", [
    ({}, CHOOSABLE),  # sgd: the rule measured to hold
    ({"optimizer": "adamw"}, ("bsp",)),  # the ones of single gradients left out, unasked
    ({"optimizer": "adam"}, ("bsp",)),
    ({"optimizer": "adamw", "paradigms": ["asp", "bsp"]}, ("asp", "bsp")),  # asked: tried
    ({"optimizer": "adamw", "paradigms": ["asp"]}, ("asp",)),
])
def test_auto_with_adam_chooses_from_bsp_alone_unless_told_and_says_so(options, chosen_from):
    cfg = make_config({"paradigm": "auto", **options})
    assert pc.choices(cfg) == chosen_from
    assert [c.paradigm for c in pc.candidates(cfg)] == list(chosen_from)
    said = pc.narrowing(cfg)
    if chosen_from == cfg.paradigms:
        assert said is None
    else:
        assert said.startswith(f"--paradigm auto with --optimizer {cfg.optimizer}: bsp alone;")
        assert "under ssp, dssp, asp" in said and "--paradigms bsp ssp dssp asp to try them too" in said
    left = pc.left_out(cfg)
    assert list(left) == [p for p in cfg.paradigms if p not in chosen_from]
    assert all(why.startswith(f"--optimizer {cfg.optimizer}: trains less per sample") for why in left.values())


@pytest.mark.parametrize("options, warned", [
    ({}, False),  # sgd: the rule measured to hold
    ({"optimizer": "adamw"}, False),  # bsp alone (above)
    ({"optimizer": "adamw", "paradigms": ["bsp", "asp"]}, True),
    ({"optimizer": "adam", "paradigms": ["bsp", "ssp"]}, True),
    ({"optimizer": "adamw", "paradigms": ["bsp"]}, False),  # nothing else to choose
    ({"optimizer": "adamw", "paradigms": ["asp", "ssp"]}, False),  # all of single gradients: alike
])
def test_auto_with_adam_between_bsp_and_single_gradients_is_cautioned_naming_them(options, warned):
    said = pc.caution(make_config({"paradigm": "auto", **options}))
    assert (said is not None) == warned
    if warned:
        single = [p for p in make_config(options).paradigms if p != "bsp"]
        assert f"under {', '.join(single)} than under bsp" in said and "--paradigms bsp" in said


def test_auto_is_planned_as_each_paradigm_and_refused_where_one_plan_is_wanted():
    cfg = make_config({"paradigm": "auto", "paradigms": ["bsp", "dssp"]})
    each = resolve_each(cfg, 5)
    assert [(c.paradigm, p) for c, p, _ in each] == [("bsp", policy_class("bsp")), ("dssp", policy_class("dssp"))]
    assert all(layout == plan(c, 5) for c, _, layout in each)
    with pytest.raises(UserError, match="in your own loop name a paradigm"):  # hpcps.init's path
        resolve(cfg, 5)
    with pytest.raises(UserError, match="paradigm 'bsp' does not use group servers .in --paradigm auto's trial "
                                        "of bsp: leave bsp out of --paradigms, or name a paradigm"):
        resolve_each(make_config({"paradigm": "auto", "groups": 2}), 7)


def test_paradigms_and_trial_steps_set_without_auto_are_said_to_have_no_effect():
    cfg = make_config({"paradigm": "bsp", "paradigms": ["bsp", "asp"], "trial_steps": 9})
    lines = no_effect(cfg, policy_class("bsp"))
    assert lines == [f"{o} has no effect in this run: it is read by --paradigm auto, and hpcps tune"
                     for o in ("--paradigms", "--trial-steps")]
    for chosen, paradigm, _ in resolve_each(make_config({"paradigm": "auto", "trial_steps": 9}), 5):
        assert no_effect(chosen, paradigm) == []


@pytest.mark.parametrize("steps,n_trials,expected", [
    (None, 4, 30),  # --epochs: the run's steps not known, the default's 30
    (1000, 4, 30),  # 120 of 1000 steps: within a quarter
    (480, 4, 30),  # 120 of 480: a quarter exactly
    (200, 4, 12),  # a quarter of 200 over 4 trials
    (80, 4, 10),  # ResNet-18's 80 steps: 4 trials of 30 would outlast the run; 10 each, the shortest
    (80, 1, 20),  # bsp alone (Adam): a quarter of 80
    (20, 4, 10),  # shorter still: 10, and the trials then do not train (choose_paradigm says so)
])
def test_unless_given_the_trials_take_at_most_a_quarter_of_the_steps_and_10_steps_each_at_least(
        steps, n_trials, expected):
    cfg = make_config({"paradigm": "auto"} if steps is None else {"paradigm": "auto", "steps": steps})
    got, why = pc.trial_steps(cfg, n_trials)
    assert got == expected
    assert (why is None) == (expected == 30)
    if why:
        assert why.startswith(f"--paradigm auto: trials of {expected} steps, not 30: {n_trials} trial(s)")


def test_trial_steps_given_are_kept_however_long_the_run():
    for steps in (20, 80, 1000):
        assert pc.trial_steps(make_config({"paradigm": "auto", "steps": steps, "trial_steps": 40}), 4) == (40, None)


def test_the_command_line_takes_paradigms_and_trial_steps():
    args = build_parser().parse_args(["train", "--paradigm", "auto", "--paradigms", "bsp", "asp",
                                      "--trial-steps", "20"])
    assert (args.paradigm, args.paradigms, args.trial_steps) == ("auto", ["bsp", "asp"], 20)
    with pytest.raises(UserError, match="--trial-steps"):
        make_config({"trial_steps": 1})


def test_a_printed_command_loses_the_auto_words_and_keeps_the_users():
    words = ["--paradigm", "auto", "--steps", "9", "--paradigms", "bsp", "asp", "--lr", "0.1", "--trial-steps=4",
             "--paradigms=bsp", "--trial-steps", "3", "--out", "x.h5"]
    assert pc.without_auto(words) == ["--steps", "9", "--lr", "0.1", "--out", "x.h5"]


def test_the_record_keeps_the_trials_the_prediction_and_the_runs_measure_and_reads_in_one_line():
    trials = [trial("bsp", 100.0, 0.0), trial("asp", 250.0, 1.8)]
    chosen = pc.choose(trials)
    record = json.loads(pc.with_measure(pc.record(trials, chosen, 30, 12.25), 240.5, 0.0125))
    assert record["chosen"] == "asp" and record["trial_steps"] == 30 and record["trials_s"] == 12.25
    assert record["predicted"] == {"batches_per_s": 250.0, "mean_step_s": 4 / 250.0}
    assert record["measured"] == {"batches_per_s": 240.5, "mean_step_s": 0.0125}
    assert [pc.ParadigmTrial(**t) for t in record["trials"]] == trials
    assert pc.describe(record) == ("auto: asp (trials of 30 steps in 12.2 s, batches/s: bsp 100.0, asp 250.0); "
                                   "predicted 250.0 batches/s, measured 240.5")
    skipped = json.loads(pc.record(trials, chosen, 30, 12.25, 60, {"ssp": "why"}))
    assert skipped["skipped"] == {"ssp": "why"} and record["skipped"] == {}
    assert pc.describe(skipped).startswith("auto: asp (trials of 30 steps in 12.2 s, batches/s: bsp 100.0, asp 250.0, "
                                           "not tried: ssp, the run going on from their 60 steps); ")
    assert record["left_out"] == {}
    adam = json.loads(pc.record(trials[:1], trials[0], 30, 5.0, left=pc.left_out(make_config({"optimizer": "adam"}))))
    assert sorted(adam["left_out"]) == ["asp", "dssp", "ssp"]  # (the JSON's keys sorted)
    assert pc.describe(adam).startswith("auto: bsp (trials of 30 steps in 5.0 s, batches/s: bsp 100.0, "
                                        "left out: asp, dssp, ssp); ")
    table = pc.table(trials, chosen)
    assert table[2].startswith("| asp | 4 | 250.0 | 16.0 | 1.80 | chosen |") and table[3].startswith("| bsp |")
    assert np.isclose(chosen.mean_step_s, 0.016)


def test_a_trial_in_which_a_rank_died_ends_the_job_on_every_living_rank_with_one_error(monkeypatch):
    """Run-through: a trial's end shrinks its communicator past a dead rank on every living rank, and the next
    trial would start on every rank: its measure, read before any collective, is an error naming the trial (every
    living rank raises it alike; the job's end prints it once)."""
    from hpcps.runtime import tune
    from hpcps.transport import failures

    monkeypatch.setattr(failures, "_seen", set())
    monkeypatch.setattr(failures, "_deaths", 0)
    mark = failures.deaths_mark()
    failures.DeadRanks([]).add({3})  # as the trial's end found rank 3 dead
    option = pc.as_chosen(make_config({"paradigm": "auto", "steps": 100}), "asp")
    with pytest.raises(UserError, match="a rank died in the trial of asp.*name a paradigm"):
        tune._measure(None, option, comm=None, mark=mark)
    with pytest.raises(UserError, match="hpcps tune: a rank died in trial 2.*Launch again"):
        tune._no_death(mark, 2)  # hpcps tune's layout trials alike


def test_a_death_in_an_earlier_run_of_the_process_does_not_end_a_later_runs_trials(monkeypatch):
    """``deaths_seen()`` stays true for good once a rank died in this process (its end must skip
    MPI_Finalize); a later ``hpcps.train(paradigm="auto")`` in the same process, on a communicator of the
    living, counts only the deaths of its own trials. A rank number found dead again in a later run (a new
    communicator's) counts again."""
    from types import SimpleNamespace

    from hpcps.runtime import tune
    from hpcps.transport import failures

    monkeypatch.setattr(failures, "_seen", set())
    monkeypatch.setattr(failures, "_deaths", 0)
    failures.DeadRanks([]).add({3})  # the earlier run
    assert failures.deaths_seen()
    mark = failures.deaths_mark()
    monkeypatch.setattr(tune, "paradigm_trial", lambda *a: SimpleNamespace(stopped_by=""))
    comm = SimpleNamespace(rank=0, bcast=lambda value, root: value)
    option = pc.as_chosen(make_config({"paradigm": "auto", "steps": 100}), "asp")
    assert tune._measure(SimpleNamespace(path="trial.h5"), option, comm, mark).stopped_by == ""
    tune._no_death(mark, 1)  # (no error)
    failures.DeadRanks([]).add({3})  # this run's own rank 3
    assert failures.deaths_since(mark)
    with pytest.raises(UserError, match="a rank died in the trial of asp"):
        tune._measure(SimpleNamespace(path="trial.h5"), option, comm, mark)
