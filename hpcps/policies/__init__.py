"""Synchronization paradigms as pure policy objects (no MPI imported here).

Importing this package registers every built-in paradigm.
"""

from hpcps.policies import dssp, eager, grouped, hsp, local, sync  # noqa: F401  (registers every paradigm)
from hpcps.policies.base import Decision, Policy
from hpcps.policies.registry import make_policy, paradigms, policy_class, register, register_class

__all__ = ["Decision", "Policy", "make_policy", "paradigms", "policy_class", "register", "register_class"]
