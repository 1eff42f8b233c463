"""hpcps train's help takes its defaults and choices from the config, where they are written once."""

from __future__ import annotations

import argparse
from typing import get_args

import pytest

from hpcps.cli import add_train_options
from hpcps.options.config import TrainConfig


@pytest.fixture(scope="module")
def actions() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    add_train_options(parser)
    return {a.dest: a for a in parser._actions if a.dest in TrainConfig.model_fields}


def test_every_default_the_help_names_is_the_configs(actions):
    said = {name: a.help for name, a in actions.items() if a.help and "(default " in a.help}
    assert len(said) >= 25
    assert not [name for name, text in said.items() if "{default}" in text]
    assert "(default auto)" in said["servers"] and "(default 600;" in said["stall_abort"]
    assert "(default 0.9,0.999)" in said["betas"] and "(default off)" in said["nesterov"]


@pytest.mark.parametrize("name", ["optimizer", "lr_schedule", "lr_staleness", "placement", "device", "divergence",
                                  "nonfinite", "jitter"])
def test_a_choice_among_names_shows_the_configs_names(actions, name):
    annotation = TrainConfig.model_fields[name].annotation
    literal = next((a for a in get_args(annotation) if get_args(a)), annotation)
    assert actions[name].metavar == "{" + ",".join(get_args(literal)) + "}"


@pytest.mark.parametrize("args,message", [
    (["--paradigm", "nope"], "unknown paradigm 'nope'"),
    (["--servers", "3"], "world of 1 rank(s) is too small for --servers 3"),
    (["--paradigm", "grouped"], "--paradigm grouped needs --groups G"),
])
def test_options_the_world_cannot_take_are_refused_before_torch_is_imported(args, message):
    """Every rank imports torch (about 2 s, minutes for a large job reading it from a shared file system) only
    once the options and their fit to the world size are known good: a mistyped option is answered at once."""
    import subprocess
    import sys

    code = ("import sys; from hpcps.cli import main; status = main(['train', *sys.argv[1:]]); "
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported'); sys.exit(status)")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stdout.strip() == "torch not imported", proc.stdout
