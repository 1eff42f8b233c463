"""Grouped servers: synchronous groups, asynchronous central server (Basu et al., HiPC 2018).

``--groups G`` places G group servers between the central shards and the N
workers; group g serves a contiguous block of workers. Inside a group,
training is BSP at the group server. Each closed round's averaged update
goes to the central server, which applies it on arrival (this policy: ASP
over the G group servers); the group server then pulls the fresh central
parameters for its group. G=1 is BSP, G=N is ASP; G moves the job between
the two. The group server's mechanism is :class:`hpcps.runtime.groupserver.GroupServer`.
"""

from __future__ import annotations

from hpcps.policies.registry import register
from hpcps.policies.sync import ASP


@register
class Grouped(ASP):
    name = "grouped"
    runs_through = False  # a group server would have to run through its workers too: not built
    takes_spares = False
    summary = "BSP groups under --groups G group servers, asynchronous central server (G=1: bsp, G=N: asp)"
    uses_groups = True
    #: workers wait for their group's round to close
    worker_blocks = True
    #: the rule each group server applies to its own workers
    group_policy = "bsp"
