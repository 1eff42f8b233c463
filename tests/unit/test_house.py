"""The house's bounds, read from the code: no constructor in ``hpcps/`` takes more than
:data:`MAX_PARAMETERS` parameters (a role takes a few value objects and ports, :mod:`hpcps.runtime.parts`,
not two dozen keywords), and no class is longer than :data:`MAX_CLASS_LINES` lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "hpcps"
MAX_PARAMETERS = 10
MAX_CLASS_LINES = 300


def classes(source: str) -> list[tuple[str, int, int]]:
    """``(name, lines, constructor parameters)`` of every class in ``source`` (``self`` and ``*args``/``**kwargs``
    not counted; 0 without a constructor of its own)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            n = 0
            if init is not None:
                a = init.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1
            found.append((node.name, node.end_lineno - node.lineno + 1, n))
    return found


def _everything() -> list[tuple[str, int, int]]:
    return [(f"{path.relative_to(ROOT.parent)}:{name}", lines, n)
            for path in sorted(ROOT.rglob("*.py")) for name, lines, n in classes(path.read_text())]


def test_no_constructor_takes_more_than_ten_parameters():
    wide = [(name, n) for name, _, n in _everything() if n > MAX_PARAMETERS]
    assert wide == []


def test_no_class_is_longer_than_three_hundred_lines():
    long = [(name, lines) for name, lines, _ in _everything() if lines > MAX_CLASS_LINES]
    assert long == []


def test_the_bounds_are_measured_as_said():
    source = '''
class Wide:
    def __init__(self, a, b, *c, d=1, e, **f):
        pass


class Empty:
    pass
'''
    assert classes(source) == [("Wide", 3, 4), ("Empty", 2, 0)]
    assert len(_everything()) > 100  # (the whole package is read)
