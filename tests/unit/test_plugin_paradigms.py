"""Paradigms of one's own: loading, options, errors, learning-rate shares, the example's rule, the simulator."""

from pathlib import Path

import pytest

import hpcps
from hpcps.cli import main
from hpcps.analysis.simulate import simulate
from hpcps.options.config import make_config
from hpcps.errors import UserError
from hpcps.policies import make_policy, paradigms, policy_class, register_class

ROOT = Path(__file__).resolve().parents[2]
BACKUP = f"{ROOT / 'examples' / 'backup_workers.py'}:BackupWorkers"


def test_a_plugin_loads_from_its_file_and_takes_its_options():
    policy = make_policy(BACKUP, 4, {"backups": 2}, staleness=2, staleness_max=6)
    assert type(policy).name == "backup-workers" and policy.backups == 2
    assert policy_class(BACKUP) is type(policy)  # loaded once


@pytest.mark.parametrize("spec,options,says", [
    (BACKUP, {"backup": 1}, "--paradigm-option backup: paradigm .* takes no such option \\(it takes: backups\\)"),
    (BACKUP, {"backups": 4}, "building it for 4 workers failed: ValueError: backups must be 0 to 3"),
    ("nowhere.py:Rule", {}, "--paradigm nowhere.py: no such file"),
    (f"{ROOT / 'examples' / 'backup_workers.py'}:Decision", {}, "expected a subclass of hpcps.Policy"),
    ("bsp", {"backups": 1}, "--paradigm-option backups: options are for your own paradigms"),
    ("bpp", {}, "unknown paradigm 'bpp'"),
])
def test_plugin_errors_are_one_line_naming_the_option(spec, options, says):
    with pytest.raises(UserError, match=says):
        make_policy(spec, 4, options)


def test_an_abstract_plugin_is_refused_naming_what_it_lacks():
    class Half(hpcps.Policy):
        name = "half"

    with pytest.raises(UserError, match="Half does not implement on_push"):
        register_class(Half)


def test_a_class_given_to_the_api_is_filed_under_module_and_qualname():
    class Mine(hpcps.Policy):
        worker_blocks = False

        def on_push(self, worker, clock, version, now):
            return hpcps.Decision(updates=((worker,),), grants=(worker,))

    key = register_class(Mine)
    assert key.endswith(":test_a_class_given_to_the_api_is_filed_under_module_and_qualname.<locals>.Mine")
    assert policy_class(key) is Mine and key not in paradigms()  # not a built-in


def test_paradigm_options_parse_as_numbers_booleans_or_strings():
    cfg = make_config({"paradigm_option": ["backups=1", "rate=0.5", "strict=true", "mode=fast", "max-stale=2"]})
    assert cfg.paradigm_option == {"backups": 1, "rate": 0.5, "strict": True, "mode": "fast", "max_stale": 2}
    with pytest.raises(UserError, match="--paradigm-option: 'backups': expected NAME=VALUE"):
        make_config({"paradigm_option": ["backups"]})


@pytest.mark.parametrize("name,n,share,extra", [
    ("bsp", 4, 1.0, 1.0), ("asp", 4, 0.25, 0.25), ("ssp", 8, 0.125, 0.125), ("dssp", 4, 0.25, 0.25),
    ("eager", 4, 0.25, 0.25), ("grouped", 2, 0.5, 0.5), ("hsp", 4, 1.0, 0.25), (BACKUP, 4, 1.0, 1.0),
])
def test_each_paradigm_declares_its_share_of_a_step(name, n, share, extra):
    """--lr-scaling auto: one update's rate over --lr is 1 / updates per step of every worker (grouped: over its
    n clients, the group servers); hsp's extra gradients take one worker's share of a round."""
    cls = policy_class(name)
    assert cls.lr_scale(n) == share and cls.lr_scale(n, extra=True) == extra


def test_backup_rule_closes_with_the_first_n_minus_b_and_drops_the_late():
    p = make_policy(BACKUP, 4, {"backups": 1})
    assert p.on_push(2, 1, 0, 0.0).updates == ()
    assert p.on_push(0, 1, 0, 0.0).updates == ()
    d = p.on_push(1, 1, 0, 0.0)
    assert d.updates == ((0, 1, 2),) and d.grants == (0, 1, 2) and d.drops == ()
    late = p.on_push(3, 1, 0, 0.1)  # computed on version 0, its round closed at 1
    assert late == hpcps.Decision(drops=(3,), grants=(3,))
    assert p.on_push(3, 2, 1, 0.2).updates == ()  # on the new parameters it joins the next round
    # as workers leave, a round needs N - b of those still active
    assert p.on_leave(0, 0.3).updates == ()  # 3 active: 2 needed, 1 in
    assert p.on_leave(1, 0.3).updates == ((3,),)  # 2 active: 1 needed


def test_backup_with_no_backups_makes_bsps_decisions():
    import random

    rng = random.Random(4)
    bsp, b0 = make_policy("bsp", 4), make_policy(BACKUP, 4, {"backups": 0})
    clocks, version = [0] * 4, 0
    for _ in range(40):
        order = list(range(4))
        rng.shuffle(order)
        for w in order:
            clocks[w] += 1
            assert bsp.on_push(w, clocks[w], version, 0.0) == b0.on_push(w, clocks[w], version, 0.0)
        version += 1


def test_the_simulator_drives_a_plugin_and_refuses_what_it_cannot_model(capsys):
    p = simulate(BACKUP, 4, steps=30, nbytes=40_000, compute_time=0.01, slowdown={3: 3.0},
                 options={"backups": 1})
    q = simulate("bsp", 4, steps=30, nbytes=40_000, compute_time=0.01, slowdown={3: 3.0})
    assert p.throughput > 1.5 * q.throughput  # the straggler no longer sets every round's pace
    with pytest.raises(ValueError, match="'hsp' is not modelled: the simulator has no extra gradients and no "
                                         "serial transfers"):
        simulate("hsp", 4, steps=3, nbytes=4, compute_time=0.01)
    assert main(["simulate", "--paradigm", BACKUP, "--paradigm-option", "backups=1", "--workers", "4",
                 "--steps", "5"]) == 0
    assert f"| {BACKUP} | 4 |" in capsys.readouterr().out


@pytest.mark.parametrize("interval", [None, 30.0])
def test_a_plugin_built_on_bsp_is_planned_as_bsp_is_for_periodic_checkpoints(interval):
    """A plug-in subclassing BSP checkpoints where bsp does (at a round's close): --checkpoint-interval is
    refused in one line naming the plug-in, as under bsp, and --checkpoint-every is taken (a run of it
    crashed with a TypeError when planning checked the name 'bsp' and the runtime the class)."""
    from hpcps.options.planning import plan
    from hpcps.policies.sync import BSP

    class Steady(BSP):
        pass

    key = register_class(Steady)
    assert Steady.checkpoints_at_publish() and not policy_class("ssp").checkpoints_at_publish()
    cfg = make_config({"paradigm": key, "checkpoint_interval": interval, "checkpoint_every": None if interval else 5})
    if interval is None:
        assert plan(cfg, 5).n_workers == 4
    else:
        with pytest.raises(UserError, match=r"--checkpoint-interval: --paradigm .*Steady checkpoints at a round's "
                                            r"close, where every worker waits: give --checkpoint-every ROUNDS"):
            plan(cfg, 5)
