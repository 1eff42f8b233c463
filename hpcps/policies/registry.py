"""Name -> policy class registry behind ``--paradigm`` (no if-chains on names).

``--paradigm`` takes a built-in name or a plug-in: ``path/to/file.py:Name``
or ``pkg.module:Name`` (:mod:`hpcps.plugins`), a subclass of
:class:`hpcps.policies.base.Policy`. ``hpcps.train(paradigm=Class)`` takes
the class itself: :func:`register_class` files it under ``module:qualname``,
which is what the run's config records. Every failure is one
:class:`UserError` naming ``--paradigm``.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from hpcps.errors import UserError
from hpcps.policies.base import Policy

_REGISTRY: dict[str, type[Policy]] = {}
_PLUGINS: dict[str, type[Policy]] = {}  # plug-ins by the spec that named them (loaded once per process)


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available as ``--paradigm cls.name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"paradigm {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def paradigms() -> dict[str, type[Policy]]:
    """All built-in (registered) paradigms, by name."""
    return dict(_REGISTRY)


def register_class(cls: Any) -> str:
    """A policy class given as an object (``hpcps.train(paradigm=Class)``): check it, file it under
    ``module:qualname`` and return that key, which ``--paradigm`` then resolves in this process."""
    key = f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', type(cls).__name__)}"
    _PLUGINS[key] = _checked(cls, key)
    return key


def policy_class(name: str) -> type[Policy]:
    """The class ``--paradigm name`` names: a built-in, or a plug-in (loaded on first use)."""
    from hpcps.plugins import is_plugin, load_plugin

    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _PLUGINS:
        return _PLUGINS[name]
    if is_plugin(name):
        _PLUGINS[name] = _checked(load_plugin(name, "--paradigm"), name)
        return _PLUGINS[name]
    known = ", ".join(sorted(_REGISTRY))
    raise UserError(f"--paradigm: unknown paradigm {name!r} (known: {known}; or your own as "
                    f"path/to/file.py:Class or package.module:Class)")


def _checked(cls: Any, spec: str) -> type[Policy]:
    """``cls`` if it is a usable paradigm; else one line saying what is wrong."""
    if not (inspect.isclass(cls) and issubclass(cls, Policy)):
        raise UserError(f"--paradigm {spec}: expected a subclass of hpcps.Policy, got {cls!r}")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise UserError(f"--paradigm {spec}: {cls.__name__} does not implement {missing}")
    if cls.uses_groups and not hasattr(cls, "group_policy"):
        raise UserError(f"--paradigm {spec}: {cls.__name__} uses groups but names no group_policy "
                        f"(the paradigm its group servers run, e.g. 'bsp')")
    return cls


def make_policy(name: str, n_workers: int, options: Mapping[str, Any] | None = None, **offered) -> Policy:
    """Build the policy ``name`` for ``n_workers`` workers.

    ``offered`` (``staleness``, ``staleness_max``) go to a constructor that takes them; ``options``
    (``--paradigm-option``) go to it as given, and one it does not take is an error naming it.
    """
    cls = policy_class(name)
    options = dict(options or {})
    if options and name in _REGISTRY:
        raise UserError(f"--paradigm-option {next(iter(options))}: options are for your own paradigms; "
                        f"{name} takes its own from its flags (--staleness, --staleness-max, ...)")
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not takes_any:
        unknown = sorted(set(options) - set(params))
        if unknown:
            own = sorted(k for k, p in params.items() if k != "n_workers" and p.kind is p.KEYWORD_ONLY)
            raise UserError(f"--paradigm-option {unknown[0]}: paradigm {name} takes no such option "
                            f"(it takes: {', '.join(own) or 'none'})")
        offered = {k: v for k, v in offered.items() if k in params}
    try:
        return cls(n_workers, **{**offered, **options})
    except (TypeError, ValueError) as exc:
        if name in _REGISTRY:
            raise
        raise UserError(f"--paradigm {name}: building it for {n_workers} workers failed: "
                        f"{type(exc).__name__}: {exc}") from None
