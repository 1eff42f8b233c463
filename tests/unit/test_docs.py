"""The README, the docs and the example configs stay true to the code.

Every command in a code block of the README or ``docs/`` is checked against the parser that
would read it (``hpcps train``, ``jobs render``, ``report``, ``simulate``, ``emulate`` and the job after
its ``--``, and each
``tools/`` benchmark's ``--help``), so a renamed option fails here; the Python recipes of the
metrics page run against a small metrics file; the example script is shown verbatim and run by
``tests/cli/test_examples.py``.
"""

import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from hpcps.cli import build_parser
from hpcps.options.config import make_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
PAGES = {"README.md": README, **DOCS}


def test_ci_runs_the_readme_test_line_verbatim():
    lines = re.findall(r"^(pip install .*python -m pytest)$", README, flags=re.M)
    assert len(lines) == 1
    assert lines[0] in (ROOT / ".ci" / "run").read_text()


def test_ci_builds_the_docs_strictly():
    assert "mkdocs build --strict" in (ROOT / ".ci" / "run").read_text()
    assert "strict: true" in (ROOT / "mkdocs.yml").read_text()


def test_the_readme_is_a_front_door_and_no_page_names_an_issue():
    assert len(README.splitlines()) <= 300
    for name, text in PAGES.items():
        assert not re.search(r"\bissues? #?\d+|\(#\d+\)", text, flags=re.I), name


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    assert sorted(DOCS) == sorted(re.findall(r"^\s+- [^:]+: (\S+\.md)$", nav, flags=re.M))


def _subparsers(parser):
    return parser._subparsers._group_actions[0].choices


@lru_cache
def _flags(command: str) -> frozenset[str]:
    """The long options of an hpcps sub-command (``train``, ``jobs render``, ...) or a tools/ script."""
    if command.startswith("tools/"):
        out = subprocess.run([sys.executable, str(ROOT / command), "--help"], capture_output=True, text=True,
                             timeout=120, cwd=ROOT).stdout
        return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", out))
    parser = build_parser()
    for word in command.split():
        parser = _subparsers(parser)[word]
    return frozenset(s for a in parser._actions for s in a.option_strings if s.startswith("--"))


def _choices() -> dict[str, tuple[str, ...]]:
    """``--option`` -> the values it takes, for every ``hpcps train`` option with a fixed set."""
    import typing

    from hpcps.options.config import TrainConfig

    out = {}
    for name, field in TrainConfig.model_fields.items():
        args = [a for a in typing.get_args(field.annotation) if typing.get_origin(a) is typing.Literal] or (
            [field.annotation] if typing.get_origin(field.annotation) is typing.Literal else [])
        if args:
            out["--" + name.replace("_", "-")] = typing.get_args(args[0])
    return out


def test_every_option_value_the_docs_name_is_one_the_parser_takes():
    """``--nonfinite drop`` in a table is caught here: a value in backquotes after an option with a
    fixed set of values must be one of them."""
    choices = _choices()
    wrong = [(page, option, value) for page, text in PAGES.items()
             for option, value in re.findall(r"(--[a-z][a-z-]*)[ =]([a-z][a-z0-9_]*)\b", text)
             if option in choices and value not in choices[option] and value.upper() != value]
    assert choices["--nonfinite"] == ("skip", "abort")
    assert not wrong, wrong


def test_every_train_option_is_documented():
    missing = sorted(f for f in _flags("train") if f != "--help" and f"`{f}" not in DOCS["running.md"])
    assert not missing, f"docs/running.md lacks {missing}"


def _blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of ``text``: (info string, body)."""
    blocks, info, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if info is None:
                info, body = line[3:].strip(), []
            else:
                blocks.append((info, "\n".join(body) + "\n"))
                info = None
        elif info is not None:
            body.append(line)
    return blocks


def _commands(text: str):
    """Every shell command in the fenced code blocks of ``text`` (continuation lines joined)."""
    for info, block in _blocks(text):
        if info not in ("", "bash", "sh", "console"):
            continue
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip().removeprefix("$ ")
            if re.search(r"\bhpcps (train|tune|jobs render|report|simulate|emulate)\b|\bpython tools/\w+\.py", line):
                yield line


def _check(line: str) -> list[str]:
    """The options of ``line`` that its command does not have."""
    words = shlex.split(line.split(" | ")[0].split(" > ")[0].split(" && ")[-1])
    if "emulate" in words and words[words.index("emulate") - 1] == "hpcps":  # hpcps emulate ... -- JOB
        at = words.index("emulate")
        cut = words.index("--") if "--" in words else len(words)
        own = [f for f in words[at + 1:cut] if f.startswith("--") and f.split("=")[0] not in _flags("emulate")]
        return own + (_check(shlex.join(words[cut + 1:])) if cut < len(words) else [])
    boxed = []  # a benchmark's --emulate "OPTIONS" holds hpcps emulate's own options
    while "--emulate" in words[:-1]:
        at = words.index("--emulate")
        boxed += [f for f in shlex.split(words[at + 1]) if f.startswith("--") and f not in _flags("emulate")]
        words = words[:at] + words[at + 2:]
        line = shlex.join(words)
    if boxed:
        return boxed + _check(line)
    tool = next((i for i, w in enumerate(words) if i and words[i - 1].endswith("python") and w.startswith("tools/")),
                None)  # (python tools/x.py; a train option may name a file in tools/ too: --model tools/x.py:net)
    if tool is not None:
        command, rest = words[tool], words[tool + 1:]
    else:
        at = words.index("hpcps")
        command = "jobs render" if words[at + 1] == "jobs" else words[at + 1]
        rest = words[at + (3 if command == "jobs render" else 2):]
    own, train = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    if command == "train":
        own, train = own + train, []
    bad = [f for f in own if f.startswith("--") and f.split("=")[0] not in _flags(command)]
    return bad + [f for f in train if f.startswith("--") and f.split("=")[0] not in _flags("train")]


COMMANDS = [(name, line) for name, text in PAGES.items() for line in _commands(text)]


def test_the_docs_show_commands_at_all():
    assert len(COMMANDS) > 30 and {"README.md", "results.md", "clusters.md", "running.md"} <= {n for n, _ in COMMANDS}


@pytest.mark.parametrize("page,line", COMMANDS, ids=[f"{n}:{k}" for k, (n, _) in enumerate(COMMANDS)])
def test_every_documented_command_uses_options_that_exist(page, line):
    assert not _check(line), f"{page}: {line}"


def test_a_renamed_option_would_be_caught():
    assert _check("mpiexec -n 5 hpcps train --paradigm bsp --stepz 10") == ["--stepz"]
    assert _check("hpcps jobs render slurm --nodez 2 -- --paradigm dssp --stepz 3") == ["--nodez", "--stepz"]
    assert _check("python tools/bench_policies.py --workerz 4") == ["--workerz"]
    assert _check("hpcps emulate --nodes 2 -- hpcps tune --model tools/bench_partitions.py:deep_mlp --stepz 3") == [
        "--stepz"]
    assert _check("hpcps emulate --nodez 2 --link 1gbit -- hpcps train --stepz 3") == ["--nodez", "--stepz"]
    assert _check("hpcps emulate --nodes 2 -- python tools/bench_transport.py --sizez 16") == ["--sizez"]
    assert _check('python tools/bench_eager.py --emulate "--nodez {np}" -- --stepz 3') == ["--nodez", "--stepz"]
    assert _check('python tools/bench_eager.py --emulate "--nodes {np} --link 1gbit" -- --steps 3') == []


def test_the_metrics_recipes_run(tmp_path, monkeypatch, capsys):
    from hpcps.metrics.runfile import RunFile
    from hpcps.metrics.schema import EVAL, ITERATION, UPDATE

    it = np.zeros(6, ITERATION)
    it["rank"], it["t_end"], it["compute_s"] = [1, 2, 1, 2, 1, 2], [0.1, 0.1, 0.2, 0.2, 0.3, 0.3], 0.01
    up = np.zeros(6, UPDATE)
    up["applied"], up["staleness"] = 1, [0, 1, 0, 2, 1, 0]
    ev = np.array([(0.1, 1, 1.0, 0.5), (0.3, 5, 0.5, 0.8)], EVAL)
    (tmp_path / "runs").mkdir()
    with RunFile(tmp_path / "runs" / "ssp.h5", {"paradigm": "ssp"}) as f:
        f.append("workers/iterations", it)
        f.append("servers/updates", up)
        f.append("eval", ev)
        f.write_summary({"wall_s": 1.0})
    monkeypatch.chdir(tmp_path)
    recipes = [body for info, body in _blocks(DOCS["metrics.md"]) if info == "python"]
    assert len(recipes) == 2
    for code in recipes:
        exec(compile(code, "metrics.md", "exec"), {})
    out = capsys.readouterr().out
    assert "[3 2 1]" in out  # the staleness histogram of the six applied gradients
    assert "0.8" in out  # the best evaluation


@pytest.mark.parametrize("path", sorted((ROOT / "jobs" / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_are_valid(path):
    make_config({}, config_file=str(path))


@pytest.mark.parametrize("page", ["README.md", "own-model.md"])
def test_the_example_script_is_shown_verbatim(page):
    """The "your own model" script is examples/train_script.py, which the tests run."""
    script = (ROOT / "examples" / "train_script.py").read_text()
    assert f"```python\n{script}```" in PAGES[page]


def test_the_step_api_loop_is_shown_as_the_example_has_it():
    """The own-model page's loop is a piece of examples/nanogpt_style.py (dedented), which the tests run."""
    import textwrap

    script = (ROOT / "examples" / "nanogpt_style.py").read_text()
    blocks = [body for info, body in _blocks(DOCS["own-model.md"]) if info == "python"]
    loop = next(b for b in blocks if "hpcps.init(" in b)
    assert "ps.step(loss)" in loop
    assert textwrap.indent(loop, "    ") in script


def test_every_example_is_run_by_the_tests():
    tests = (ROOT / "tests" / "cli" / "test_examples.py").read_text()
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert path.name in tests, f"no test runs examples/{path.name}"
