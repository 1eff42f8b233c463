"""Import-path plug-ins: ``--model pkg.mod:name`` and ``--model path/to/file.py:name``.

The convention users know from uvicorn and entry points: the part before
the last ``:`` is a module (dotted import path) or a Python file, the part
after it an attribute of it (dots reach inside: ``mod:Factory.build``).
Every failure is a :class:`UserError` naming the option and what is missing,
so a bad path ends every rank with one line.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

from hpcps.errors import UserError


def is_plugin(spec: str) -> bool:
    """Whether ``spec`` names a plug-in (``module:name`` or ``file.py:name``) rather than a built-in."""
    module, sep, name = spec.rpartition(":")
    # the attribute is a dotted Python name: so a path such as C:\\data.h5 is not a plug-in
    return bool(sep and module) and all(part.isidentifier() for part in name.split("."))


def load_plugin(spec: str, option: str) -> Any:
    """The object ``spec`` names; ``option`` (e.g. ``--model``) is named in every error."""
    if not is_plugin(spec):
        raise UserError(f"{option} {spec}: expected MODULE:NAME or FILE.py:NAME")
    target, _, attr = spec.rpartition(":")
    module = _load_file(target, option) if target.endswith(".py") else _import(target, option)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UserError(f"{option} {spec}: {target} has no attribute {attr!r}") from None
    return obj


def _import(name: str, option: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise UserError(f"{option} {name}: no module named {exc.name!r} (is it installed, or on PYTHONPATH?)") \
                from None
        raise UserError(f"{option} {name}: importing it failed: {exc}") from None
    except Exception as exc:
        raise UserError(f"{option} {name}: importing it failed: {type(exc).__name__}: {exc}") from None


def _load_file(path: str, option: str):
    if not os.path.isfile(path):
        raise UserError(f"{option} {path}: no such file")
    full = os.path.abspath(path)
    name = f"hpcps_plugin_{abs(hash(full)):x}"
    if name in sys.modules:  # the same file named by two options: one module
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, os.path.dirname(full))  # the file may import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise UserError(f"{option} {path}: running it failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(os.path.dirname(full))
    return module


def call_with_accepted(factory: Callable[..., Any], **offered: Any) -> Any:
    """Call ``factory`` with those of the ``offered`` keyword arguments its signature accepts."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature: offer nothing
        return factory()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return factory(**offered)
    return factory(**{k: v for k, v in offered.items() if k in params})
