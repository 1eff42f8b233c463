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


#: the low rooms, and all that each may import besides itself: nothing above it. A paradigm's rules import
#: nothing but the plug-in loader; the options know the paradigms, the rank layout's arithmetic and the
#: codec's choices, never what runs them
MAY_IMPORT = {
    "hpcps.plugins": {"hpcps.errors"},
    "hpcps.policies": {"hpcps.errors", "hpcps.plugins"},
    "hpcps.options": {"hpcps.errors", "hpcps.plugins", "hpcps.policies", "hpcps.cluster.layout",
                      "hpcps.transport.compress"},
}
#: the rooms that run a job, which nothing below them imports (the package's own names come from them, lazily)
RUNNING = ("hpcps.runtime", "hpcps.check", "hpcps.jobs", "hpcps.api", "hpcps.cli", "hpcps.__main__")
#: the offline tools (report, analysis), which never import MPI: no transport, nothing that runs
OFFLINE = ("hpcps.analysis",)


def _room(module: str, rooms) -> str | None:
    return next((r for r in rooms if module == r or module.startswith(r + ".")), None)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of ``graph`` that reaches up: out of a low room's allowance, into a running room from below
    it, or into MPI from an offline tool."""
    found = []
    for module, deps in sorted(graph.items()):
        low = _room(module, MAY_IMPORT)
        for dep in sorted(deps):
            if low is not None and _room(dep, [low]) is None and _room(dep, MAY_IMPORT[low]) is None:
                found.append(f"{module} -> {dep}")
            elif module != "hpcps" and _room(module, RUNNING) is None and _room(dep, RUNNING) is not None:
                found.append(f"{module} -> {dep}")
            elif _room(module, OFFLINE) and _room(dep, ("hpcps.transport",) + RUNNING):
                found.append(f"{module} -> {dep}")
    return found


def test_no_room_imports_one_above_it():
    """The options, the plug-in loader and the paradigms' rules sit at the bottom; what runs a job
    (runtime, jobs, api, cli) at the top; the offline tools never import MPI."""
    assert upward_imports(_graph()) == []


def test_the_check_finds_an_upward_import():
    graph = {"hpcps.options.config": {"hpcps.runtime.faults"}, "hpcps.training.flat": {"hpcps.runtime.run"},
             "hpcps.analysis.report": {"hpcps.transport.window"}, "hpcps.policies.base": {"hpcps.plugins"},
             "hpcps.runtime.run": {"hpcps.options.config"}}
    assert upward_imports(graph) == ["hpcps.analysis.report -> hpcps.transport.window",
                                     "hpcps.options.config -> hpcps.runtime.faults",
                                     "hpcps.training.flat -> hpcps.runtime.run"]
