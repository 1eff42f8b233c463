"""Name -> policy class registry behind ``--paradigm`` (no if-chains on names)."""

from __future__ import annotations

from hpcps.errors import UserError
from hpcps.policies.base import Policy

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available as ``--paradigm cls.name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"paradigm {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def paradigms() -> dict[str, type[Policy]]:
    """All registered paradigms, by name."""
    return dict(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UserError(f"--paradigm: unknown paradigm {name!r} (known: {known})") from None


def make_policy(name: str, n_workers: int, **options) -> Policy:
    """Build the policy ``name`` for ``n_workers`` workers."""
    return policy_class(name)(n_workers, **options)
