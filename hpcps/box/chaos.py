"""Faults on a schedule for the cluster in a box (``hpcps emulate --chaos``): parsing and the plan, no side
effects; :mod:`hpcps.box.launch` carries them out.

A fault is ``KIND:NODE@SECONDS``, counted from the job's launch:

* ``kill:2@20``: every process of node 2 (its ranks, and Open MPI's daemon there) gets SIGKILL, as when
  the node dies;
* ``down:2@20/5``: node 2's link goes down at 20 s and comes back 5 s later (for good without ``/S``),
  as when its cable or switch port fails.

``NODE`` may be ``random``: one of the nodes other than node 0 (which holds rank 0, the first shard),
drawn from ``--chaos-seed``, so that a schedule is reproducible.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

KINDS = ("kill", "down")
_SPEC = re.compile(r"^(kill|down):(\d+|random)@(\d+(?:\.\d+)?)(?:/(\d+(?:\.\d+)?))?$")


@dataclass(frozen=True)
class Fault:
    kind: str  # kill or down
    node: int
    at: float  # seconds after the launch
    lasting: float | None = None  # down: seconds until the link comes back (None: never)

    def describe(self) -> str:
        if self.kind == "kill":
            return f"node {self.node}'s processes killed (SIGKILL)"
        back = f" for {self.lasting:g} s" if self.lasting is not None else " for good"
        return f"node {self.node}'s link down{back}"


def parse(specs: list[str], nodes: int, seed: int = 0) -> list[Fault]:
    """The faults of ``specs`` on a box of ``nodes`` nodes, in the order they happen; ValueError on a bad one."""
    rng = random.Random(seed)
    faults = []
    for spec in specs:
        m = _SPEC.match(spec)
        if not m:
            raise ValueError(f"--chaos {spec!r}: expected KIND:NODE@SECONDS, KIND kill or down, e.g. kill:2@20, "
                             f"down:random@30/5")
        kind, node, at, lasting = m.group(1), m.group(2), float(m.group(3)), m.group(4)
        if node == "random":
            if nodes < 2:
                raise ValueError(f"--chaos {spec!r}: random picks a node other than node 0, and the box has one")
            node_index = rng.randrange(1, nodes)
        else:
            node_index = int(node)
            if node_index >= nodes:
                raise ValueError(f"--chaos {spec!r}: the box has nodes 0-{nodes - 1}")
        if lasting is not None and kind != "down":
            raise ValueError(f"--chaos {spec!r}: /SECONDS is for down (how long the link stays down)")
        faults.append(Fault(kind, node_index, at, float(lasting) if lasting is not None else None))
    return sorted(faults, key=lambda f: f.at)
