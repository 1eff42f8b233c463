"""The package's imports form no cycle, those inside functions included (a function's import defers the
cost, not the dependency): a module can be read after the ones it names. Left aside: imports under
TYPE_CHECKING, and ``import hpcps`` for its ``__version__`` (the package's own names come lazily)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "hpcps"


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for top in tree.body if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.dump(top.test)
                       for n in ast.walk(top)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in modules and d not in (name, "hpcps")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a path that comes back to its start), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_import_cycle_in_the_package():
    graph = _graph()
    assert len(graph) > 50 and "hpcps.runtime.run" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_check_finds_a_cycle_when_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
