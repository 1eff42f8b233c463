"""Configuration: defaults, TOML + flags precedence, messages that name the option."""

import re

import pytest

from hpcps.options.config import DEFAULT_STEPS, TrainConfig, make_config, steps_for
from hpcps.errors import UserError


def test_defaults_make_a_useful_run():
    cfg = make_config({})
    assert (cfg.paradigm, cfg.servers, cfg.groups, cfg.model, cfg.dataset) == ("dssp", "auto", 0, "mlp", "digits")
    assert (cfg.pull, cfg.partition_mb) == ("auto", "auto")  # made concrete at the start: hpcps.options.defaults
    assert (cfg.staleness, cfg.s_lo, cfg.s_hi) == (None, 2, 6)  # None: no bound for eager
    assert steps_for(cfg, per_epoch=11) == DEFAULT_STEPS


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('paradigm = "ssp"\nbatch-size = 64\nstaleness = 3\nslowdown = {4 = 3.0}\n')
    cfg = make_config({"staleness": 5}, config_file=str(f))
    assert (cfg.paradigm, cfg.batch_size, cfg.staleness, cfg.slowdown) == ("ssp", 64, 5, {4: 3.0})


def test_slowdown_flags_parse_rank_equals_factor():
    assert make_config({"slowdown": ["4=3", "2=1.5"]}).slowdown == {4: 3.0, 2: 1.5}


@pytest.mark.parametrize("flags,message", [
    ({"lr": -1.0}, r"--lr: .*greater than 0"),
    ({"batch_size": 0}, r"--batch-size: .*greater than or equal to 1"),
    ({"slowdown": ["4x3"]}, r"--slowdown: .*expected RANK=FACTOR"),
    ({"slowdown": ["4=0.5"]}, r"--slowdown: .*FACTOR must be a number >= 1"),
    ({"steps": 10, "epochs": 2}, r"give --steps or --epochs, not both"),
    ({"target_accuracy": 1.5}, r"--target-accuracy: "),
    ({"device": "tpu"}, r"--device: "),
    ({"staleness": 3, "staleness_max": 2}, r"--staleness-max 2 must be >= --staleness 3"),
    ({"jitter": "lognormal"}, r"--jitter needs --compute-time"),
    ({"compute_time": 0.01, "jitter": "uniform", "jitter_cv": 0.9}, r"--jitter-cv must be <= 0.577"),
    ({"compute_time": -1.0}, r"--compute-time: "),
    ({"compute_backward": 0.5}, r"--compute-backward needs --compute-time"),
    ({"compute_time": 0.1, "compute_forward": 0.5, "compute_backward": 0.6},
     r"--compute-forward 0.5 and --compute-backward 0.6 add up to more than the whole compute time"),
    ({"fault": ["nan2:5"]}, r"--fault: .*expected KIND@RANK:STEP"),
    ({"fault": ["boom@2:5"]}, r"--fault: .*KIND must be one of nan, raise, exit, kill, killhead, killverdict, hang"),
    ({"nonfinite": "ignore"}, r"--nonfinite: "),
    ({"local_steps": 0}, r"--local-steps: .*greater than or equal to 1"),
    ({"local_steps": 2, "inner_optimizer": "adam", "inner_momentum": 0.9}, r"--inner-momentum is for --inner-optimizer sgd"),
])
def test_bad_values_name_the_option(flags, message):
    with pytest.raises(UserError, match=message):
        make_config(flags)


def test_unknown_key_in_file_is_named(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("learning_rate = 0.1\n")
    with pytest.raises(UserError, match=r"unknown option '--learning-rate'.*run.toml"):
        make_config({}, config_file=str(f))


def test_missing_and_broken_files_are_named(tmp_path):
    with pytest.raises(UserError, match=r"--config .*nope.toml: no such file"):
        make_config({}, config_file=str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("paradigm = \n")
    with pytest.raises(UserError, match=r"--config .*bad.toml: not valid TOML"):
        make_config({}, config_file=str(bad))


def test_epochs_become_steps():
    assert steps_for(TrainConfig(epochs=3), per_epoch=11) == 33
    assert steps_for(TrainConfig(steps=7), per_epoch=11) == 7


def test_start_up_errors_name_each_distinct_message_once_with_its_ranks():
    from hpcps.runtime.agree import combine

    assert combine(["A", "A", "A"]) == "A"  # every rank: no rank list
    assert combine([None, "A", "A", "A", "A"]) == "ranks 1-4: A"
    assert combine([None, "A", "B", "A"]) == "ranks 1, 3: A; rank 2: B"
    assert combine(["A", None]) == "rank 0: A"
    assert combine([f"E{i}" for i in range(6)] + [None]).count(";") == 3  # four messages at most


def test_optimizer_options_are_validated_naming_the_option():
    cfg = make_config({"optimizer": "adamw", "betas": "0.8,0.99", "weight_decay": 0.05})
    assert cfg.betas == (0.8, 0.99) and cfg.lr_schedule == "constant"
    for flags, message in [
        ({"nesterov": True}, "--nesterov needs --optimizer sgd and a --momentum above 0"),
        ({"optimizer": "adam", "momentum": 0.9}, "--momentum is for --optimizer sgd"),
        ({"betas": "0.9"}, "--betas: '0.9': expected BETA1,BETA2"),
        ({"betas": "0.9,1.5"}, "each beta must be in [0, 1)"),
        ({"optimizer": "lion"}, "--optimizer"),
        ({"lr_schedule": "linear"}, "--lr-schedule"),
        ({"warmup_steps": -1}, "--warmup-steps"),
    ]:
        with pytest.raises(UserError, match=re.escape(message)):
            make_config(flags)


def test_stall_abort_is_on_by_default_and_zero_turns_it_off():
    assert make_config({}).stall_limit == 600.0
    assert make_config({"stall_abort": 0}).stall_limit is None
    assert make_config({"stall_abort": 5}).stall_limit == 5.0


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 1e-3), ("adamw", 1e-3)])
def test_the_default_learning_rate_is_the_optimizers_usual_one(optimizer, lr):
    assert make_config({"optimizer": optimizer}).lr == lr
    assert make_config({"optimizer": optimizer, "lr": 0.02}).lr == 0.02


def test_python_keywords_are_named_in_python_spelling_with_a_suggestion():
    with pytest.raises(UserError) as python:
        make_config({"eval_interval_iters": 5}, python=True)
    assert str(python.value) == "unknown keyword argument 'eval_interval_iters' (did you mean 'eval_interval'?)"
    with pytest.raises(UserError, match=r"^batch_size: "):
        make_config({"batch_size": 0}, python=True)
    with pytest.raises(UserError) as cli:
        make_config({"eval_interval_iters": 5})
    assert str(cli.value) == "unknown option '--eval-interval-iters' (did you mean '--eval-interval'?)"


def test_min_lr_is_the_cosine_schedules_floor_below_lr():
    assert make_config({"lr_schedule": "cosine", "min_lr": 0.01}).min_lr == 0.01
    with pytest.raises(UserError, match="--min-lr is the cosine schedule's floor"):
        make_config({"min_lr": 0.01})
    with pytest.raises(UserError, match="--min-lr 0.5 is above --lr 0.1"):
        make_config({"lr_schedule": "cosine", "min_lr": 0.5})


@pytest.mark.parametrize("flags, expected", [
    # the presets' outer optimizer where the user sets none, their H; without local steps, untouched
    ({"paradigm": "diloco"}, (0.7, 0.9, True, 8, 0.1)),
    ({"paradigm": "localsgd"}, (1.0, 0.0, False, 8, 0.1)),
    ({"paradigm": "diloco", "momentum": 0.0}, (0.7, 0.0, False, 8, 0.1)),
    ({"paradigm": "diloco", "lr": 0.5, "nesterov": False, "local_steps": 32}, (0.5, 0.9, False, 32, 0.1)),
    ({"paradigm": "diloco", "optimizer": "adam", "inner_optimizer": "adamw"}, (1e-3, 0.0, False, 8, 1e-3)),
    # local steps under another paradigm: its outer sgd takes the round's change as it is (rate 1)
    ({"paradigm": "asp", "local_steps": 4, "inner_optimizer": "adamw"}, (1.0, 0.0, False, 4, 1e-3)),
    ({"paradigm": "ssp", "local_steps": 4, "optimizer": "adamw"}, (1e-3, 0.0, False, 4, 0.1)),
    ({"paradigm": "asp", "local_steps": 4, "lr": 0.3}, (0.3, 0.0, False, 4, 0.1)),
    ({"paradigm": "bsp"}, (0.1, 0.0, False, None, 0.1)),
])
def test_the_local_sgd_presets_defaults(flags, expected):
    cfg = make_config(flags)
    assert (cfg.lr, cfg.momentum, cfg.nesterov, cfg.inner_steps, cfg.inner_lr) == expected


@pytest.mark.parametrize("flags, message", [
    ({"servers": "foo"}, "--servers: should be a valid integer or 'auto' (got 'foo')"),
    ({"partition_mb": "abc"}, "--partition-mb: should be a valid number or 'auto' (got 'abc')"),
])
def test_an_option_of_a_number_or_auto_says_both_in_one_line(flags, message):
    with pytest.raises(UserError) as caught:
        make_config(flags)
    assert str(caught.value) == message
