"""Eager: decoupled push and pull (the seed paper's PyTorch parameter server).

On the server, eager is asynchronous: every gradient is applied on arrival
and its worker released at once, as in ASP. What differs is the worker
(:class:`hpcps.runtime.worker.EagerWorker`): its pull of the newest parameters is
issued when it starts computing and completes behind the computation, its
push leaves from a copy while it computes the next gradient, and it scales
its learning rate by the staleness it knows of (``lr/(1+staleness)`` by
default; ``--lr-staleness`` chooses another).
"""

from __future__ import annotations

from hpcps.policies.registry import register
from hpcps.policies.sync import ASP


@register
class Eager(ASP):
    name = "eager"
    summary = "decoupled push and one-sided pull overlapped with compute, staleness-scaled learning rate"
    eager_pull = True
    worker_blocks = False  # (its pulls are decoupled from its pushes: it never waits for its own either)
    default_lr_staleness = "inverse"
