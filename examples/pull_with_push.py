"""asp whose worker begins its pull as it pushes: the former asp, as a paradigm of your own.

asp's worker waits for its own gradient's update before it pulls
(read-my-writes; docs/paradigms.md, "What asp reads"), so each gradient is
computed on parameters that hold the worker's last one. This plug-in
pulls as it pushes instead: where the server's link is the limit the step
is shorter (the pull and the push go opposite ways at once), and every
gradient is computed without the worker's last one, about three times as
stale (at momentum on MNIST-1D's small CNN, 0.45-0.80 against asp's
0.90-0.92). It reproduces asp's numbers measured before the change::

    mpiexec -n 5 hpcps train --paradigm examples/pull_with_push.py:PullWithPush
"""

from __future__ import annotations

from hpcps.policies.sync import ASP


class PullWithPush(ASP):
    """asp, its worker not waiting for its own gradient's update before its next pull."""

    worker_blocks = False
