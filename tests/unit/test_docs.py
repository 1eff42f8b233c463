"""The README and the example configs stay true to the code."""

import re
from pathlib import Path

import pytest

from hpcps.cli import build_parser
from hpcps.config import make_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_line_verbatim():
    lines = re.findall(r"^(pip install .*python -m pytest)$", README, flags=re.M)
    assert len(lines) == 1
    assert lines[0] in (ROOT / ".ci" / "run").read_text()


def test_every_train_option_is_documented():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    flags = {s for a in train._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    missing = sorted(f for f in flags if f"`{f}" not in README)
    assert not missing, f"README lacks {missing}"


@pytest.mark.parametrize("path", sorted((ROOT / "jobs" / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_are_valid(path):
    make_config({}, config_file=str(path))


def test_the_readme_shows_the_example_script_verbatim():
    """The "Train your own model" script is examples/train_script.py, which the tests run."""
    script = (ROOT / "examples" / "train_script.py").read_text()
    assert f"```python\n{script}```" in README


def test_every_example_is_run_by_the_tests():
    tests = (ROOT / "tests" / "cli" / "test_examples.py").read_text()
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert path.name in tests, f"no test runs examples/{path.name}"
