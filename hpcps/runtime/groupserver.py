"""The group server of the grouped paradigm (Basu et al., HiPC 2018).

A :class:`GroupServer` is a shard server for its own group (its workers
push to it, pull from its window, and wait for its BSP grants), all on the
group's communicator. Its update step differs: instead of applying a
closed round itself, it pushes the round's averaged update to the central
shards, waits for their receipts, pulls the fresh central parameters and
publishes those to its group. The central shards apply group updates as
they arrive, so groups never wait for each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hpcps.runtime.server import ShardServer
from hpcps.transport import wire
from hpcps.transport.compress import all_finite
from hpcps.transport.notices import NoticeBox
from hpcps.transport.poll import wait_until
from hpcps.transport.push import Pusher
from hpcps.transport.window import ParamWindow

log = logging.getLogger("hpcps")


@dataclass(frozen=True)
class CentralLink:
    """A group server's link to the central shards, as a worker of theirs: it pushes each round through
    ``pusher`` from ``agg``, hears their receipts in ``notices`` and pulls their parameters from ``window``.

    ``agg`` is the buffer ``pusher`` sends from: the round's combined gradient (and mean buffer change),
    which the central shards' optimizers step with. It is pushed with the round's learning-rate factor times
    ``weight``: the group's size over the mean group size, so every gradient weighs the same at the central
    server however unevenly the groups are formed (a straggler alone in its group does not get the weight of
    a group of three). Equal groups (and G=1, G=N) have weight 1. ``rate``, ``schedule``: the central
    optimizer's own rate and its schedule by version, for the rate this group's workers are told their
    gradients were applied at; ``encode(keep)``: put ``agg`` into ``pusher``'s buffer as the wire carries it
    (``--compress``; by default ``agg`` is that buffer; ``keep``: the round is to be applied, so top-k keeps
    its residual).
    """

    pusher: Pusher
    notices: NoticeBox
    window: ParamWindow
    agg: np.ndarray
    weight: float = 1.0
    rate: float | None = None
    schedule: Callable[[float], float] | None = None
    encode: Callable[[bool], None] | None = None


class GroupServer(ShardServer):
    """A shard server for its own group that steps by pushing each round to the central shards
    (``central``, a :class:`CentralLink`) and publishing what they return."""

    def __init__(self, central: CentralLink, **kwargs) -> None:
        super().__init__(**kwargs)
        self.encode = central.encode
        self.weight = central.weight
        self.central_rate, self.central_schedule = central.rate, central.schedule
        self.central_pusher, self.central_notices, self.central_window = central.pusher, central.notices, \
            central.window
        self.agg_t = torch.from_numpy(central.agg)
        self.central_versions = np.zeros(len(central.window.shard_ranks), np.int64)
        self.rounds = 0
        self.stopped = False

    def run(self) -> None:
        self._pull_central()  # start from the central parameters
        super().run()
        self.central_pusher.start_done(self.rounds)

        def said_bye() -> bool:
            self.central_notices.poll()  # grants of the last rounds, then every shard's BYE
            return self.central_notices.open == 0 and self.central_pusher.test_done()

        wait_until(said_bye, self.backoff)

    def _rate(self, version: float, factor: float) -> float:
        """A group update goes to the central shards at ``--lr`` x the factor x this group's weight, where
        the central optimizer's rate and schedule (at the central version it was applied at) apply."""
        if self.central_schedule is None:
            return super()._rate(version, factor * self.weight)
        return self.central_rate * self.central_schedule(version) * factor * self.weight

    def _pull_central(self) -> None:
        versions, stop = self.central_window.pull(self.master, self.backoff)
        self.central_versions, self.version = versions, int(versions.min())
        if stop and not self.stopped:  # the target was reached: tell this group's workers
            self.stopped = True
            self.window.set_stop()

    def _update(self, grads: list[torch.Tensor], coeffs: list[float], factor: float,
                means: list[float] | None = None, staleness: float = 0.0) -> int:
        """Push the group's combined gradient (``agg``) to the central shards; wait for their receipts and
        pull; return the lowest central version it was applied to."""
        p = self.n_params
        means = means or [1.0 / len(grads)] * len(grads)
        self.agg_t.zero_()
        for g, c, m in zip(grads, coeffs, means):
            self.agg_t[:p].add_(g[:p], alpha=c)
            self.agg_t[p:].add_(g[p:], alpha=m)
        self.rounds += 1
        # the group server holds the whole round: it decides once whether the sum is finite as the wire
        # carries it, so every central shard applies it or none does (as a worker does for its gradient)
        finite = all_finite(self.agg_t, self.codec.overflow)
        if self.encode is not None:
            self.encode(finite)
        self.central_pusher.start(self.rounds, self.central_versions, self.unit_lr * self.weight * factor,
                                  flags=wire.CHECKED if finite else wire.NONFINITE)
        applied_at: list[int] = []
        dropped: list[int] = []

        def receipts_in() -> bool:
            sent = self.central_pusher.test()  # (every poll: under a fan-out the next shard's turn comes so)
            for note in self.central_notices.poll():
                if note.flags & wire.RECEIPT and note.clock == self.rounds:
                    (dropped if note.flags & wire.DROPPED else applied_at).append(note.version)
            return len(applied_at) + len(dropped) == len(self.central_versions) and sent

        wait_until(receipts_in, self.backoff)
        if dropped:  # every central shard alike (the verdict above): the group's round is in no parameter
            log.warning("group server rank %d: the central shards dropped its round %d (the round's sum was not "
                        "finite as the wire carries it); its workers' rows count it as applied to the group",
                        self.rank, self.rounds)
        self._pull_central()
        return min(applied_at or dropped)
