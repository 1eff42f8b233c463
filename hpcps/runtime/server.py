"""The central-server shard loop: receive pushes, ask the policy, apply, publish, notify.

The loop never leaves MPI for long: it polls its receives, applies updates
in chunks with a progress poke between chunks, and sleeps with a backoff
only when nothing is happening. Large pushes (rendezvous messages) move
only while the server is inside MPI, and so do pulls under the ``locked``
window protocol (see :mod:`hpcps.transport.window`); this keeps both moving
while the server is busy.

A gradient with NaN or Inf is never applied: it is recorded as dropped
(reason 1), its worker gets a receipt marked ``DROPPED``, and a group it was
part of is averaged over the others; under ``--nonfinite abort`` the shard
raises :class:`RunAborted` instead. A gradient its worker flagged ``SKIP``
(the step API's skipped step: a GradScaler found Inf or NaN) is dropped the
same way (reason 2), whatever ``--nonfinite`` says: it still counts in its
round, so a BSP round never waits for a step nobody will push, and a round
whose every gradient was skipped applies nothing (the version stays).

Updates: the shard's slice of trainable parameters is stepped by its
:class:`~hpcps.training.optim.ShardOptimizer` (torch.optim, the learning rate
scheduled by version and multiplied by the update's factors; see
:mod:`hpcps.training.optim`). The rest of the slice holds model buffers (BatchNorm
statistics): there the update adds the mean of the pushed changes, so after
a BSP round the buffers are the mean of the workers' buffers. A change pushed
from buffers ``s`` versions old is added times ``1/(1+s)``: each change is
``m x (batch statistic - buffer when pulled)``, and added undamped to buffers
that moved on since, it made a delayed feedback loop that grows without
bound once ``m`` times the staleness is large (running means of +-8000 under
asp); damped, the loop is stable for every BatchNorm momentum up to 1 at any
fixed staleness (``m/(1+s)`` is below the delayed loop's bound,
``2 sin(pi/(2(2s+1)))``).

Order of one step, and why: apply the updates the policy names, publish the
new parameters, *then* send receipts and grants. A granted worker pulls
after it sees its grant, so it always sees the version the grant promised.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from hpcps.errors import RunAborted
from hpcps.metrics.timeline import NullTimeline
from hpcps.training.hyper import ShardHypers
from hpcps.training.optim import APPLY_CHUNK, update_terms
from hpcps.policies import Decision, Policy
from hpcps.runtime.parts import Records, ServerHooks, ServerPorts, ShardUpdate, Watch
from hpcps.transport import wire
from hpcps.transport.poll import Backoff, wait_until
from hpcps.transport.compress import Codec, all_finite
from hpcps.transport.failures import found_dead
from hpcps.transport.push import LeaveEvent, LostEvent, PushEvent
from hpcps.runtime.release import PieceRelease, _Release
from hpcps.runtime.residence import HostSlice
from hpcps.runtime.spares import JoinEvent
from hpcps.runtime.stalls import ShardStalls

log = logging.getLogger("hpcps")


def apply_update(master: torch.Tensor, grads: Sequence[torch.Tensor], coeffs: Sequence[float], *,
                 progress: Callable[[], object], chunk: int = APPLY_CHUNK) -> int:
    """``master -= sum(c * g)`` in place, chunk by chunk, calling ``progress`` after each.

    Returns the number of chunks (= progress calls). No temporaries: each
    chunk is updated by fused ``add_`` calls while it is hot in cache.
    """
    n = master.numel()
    chunks = 0
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        part = master[lo:hi]
        for g, c in zip(grads, coeffs):
            part.add_(g[lo:hi], alpha=-c)
        progress()
        chunks += 1
    return chunks


class _Membership:
    """A shard's changes of membership under run-through (a mixin of :class:`ShardServer`, whose attributes it
    reads and changes): a worker's death (:meth:`_lost`) and a spare taking its place (:meth:`_join`)."""

    def _lost(self, event: LostEvent, now: float, notices: dict[int, list]) -> None:
        """A worker died (run-through): its pushes in flight here are lost, each with a row; it leaves the
        paradigm's bounds as a worker that finished does, and its notifier sends it nothing more. A gradient of it
        that came whole stays pending: the paradigm applies it like any other."""
        worker, rank = event.worker, self.worker_ranks[event.worker]
        if event.leaves:
            self.recorder.add("servers/lost", (self.rank, self.shard, now, rank, self.clocks[worker], 0))
        for clock in event.clocks:
            self.recorder.add("servers/lost", (self.rank, self.shard, now, rank, clock, 1))
        self.lost_clocks.setdefault(worker, []).extend(event.clocks)
        if not event.leaves:
            return
        self.gone.add(worker)
        self.awaiting.discard(worker)
        lost = f"; its gradient(s) {', '.join(map(str, event.clocks))} lost in flight" if event.clocks else ""
        log.warning("shard %d: worker rank %d died after its gradient %d%s; going on with %d workers", self.shard,
                    rank, self.clocks[worker], lost, len(self.worker_ranks) - len(self.inbox.lost))
        decision = self.policy.on_leave(worker, now)
        if self.round_sum is not None:
            self._sum_round()
            self.inbox.offer()
        self._carry_out(decision, notices)
        self.dead_workers.add(worker)
        if self.spares is not None:
            self.spares.died(worker, self.clocks[worker], rank, stopping=self.window.stop_raised())

    def _join(self, event: JoinEvent, now: float, notices: dict[int, list]) -> None:
        """A spare takes the place of a dead worker (:mod:`hpcps.runtime.spares`): its messages are that
        worker's from now on, and the paradigm counts it again, at the dead worker's clock."""
        worker, dead = event.worker, self.worker_ranks[event.worker]
        self.dead_workers.discard(worker)
        self.worker_ranks[worker] = self.notifier.worker_ranks[worker] = event.rank
        self.inbox.rejoin(worker, event.rank)
        self.gone.discard(worker)
        self.stalls.joined(worker, now)
        self.recorder.add("servers/joins", (self.rank, self.shard, now, dead, event.rank, event.clock))
        log.warning("shard %d: spare rank %d takes the place of worker rank %d, from its gradient %d on",
                    self.shard, event.rank, dead, event.clock + 1)
        self._carry_out(self.policy.on_join(worker, now), notices)


class _Gradients:
    """What a held gradient is to a shard (a mixin of :class:`ShardServer`, whose attributes it reads): its
    values where the slice is stepped, and whether it may be applied."""

    def _gradient(self, worker: int) -> torch.Tensor:
        """The held gradient of ``worker`` where the slice is stepped: a view of the inbox's buffer (fp32, or
        16-bit under ``--compress bf16/fp16``), or a dense tensor made from a top-k payload; or its copy."""
        return self.home.upload(self.codec.gradient(self.inbox.gradient(worker), len(self.master)))

    def _finite(self, push: PushEvent) -> bool:
        """Whether a gradient may be applied (called once per push); a skipped one (its worker said so) or a
        non-finite one is dropped, or a non-finite one ends the run. Finite or not is the worker's verdict on
        its whole gradient where it gave one (in the header, or after the payload of a push begun during
        backward), so every shard decides alike; a push without one (a group server's) is scanned here."""
        if push.skip:
            return False
        if push.flags & wire.VERDICT:
            held = self.release.verdicts.take(push.worker) if self.release is not None else None
            finite = received_verdict(self.inbox, push, self.shard, held)
            if finite is None:
                return False
        elif push.flags & (wire.CHECKED | wire.NONFINITE):
            finite = not push.flags & wire.NONFINITE
        else:
            self.tl.enter("scan")
            finite = all_finite(self.codec.values(self.inbox.gradient(push.worker)))
        if finite:
            return True
        if self.abort_on_nonfinite:
            raise RunAborted(f"worker rank {self.worker_ranks[push.worker]} pushed a non-finite gradient "
                             f"(its gradient {push.clock}) and --nonfinite is abort")
        return False


class ShardServer(_Membership, _Gradients, _Release):
    """Serve shard ``shard`` (parameters ``master``) until every worker has left.

    ``master[:n_params]`` are trainable parameters, stepped by ``optimizer``;
    the rest are buffers. ``unit_lr`` is the learning rate a push asks for at
    factor 1 (``--lr``): a push's factor is its learning rate over it.
    """

    def __init__(self, *, shard: int, rank: int, policy: Policy, worker_ranks: Sequence[int], ports: ServerPorts,
                 update: ShardUpdate, records: Records, watch: Watch = Watch(), hooks: ServerHooks = ServerHooks(),
                 table: str = "servers/updates") -> None:
        """Shard ``shard`` on rank ``rank`` serves ``worker_ranks`` under ``policy``: it receives, answers and
        publishes through ``ports``, steps what ``update`` says (:mod:`hpcps.runtime.parts`), calls ``hooks``
        besides its loop, puts its rows in table ``table`` of ``records``, and its waits are watched as
        ``watch`` says."""
        self.shard, self.rank, self.policy, self.table = shard, rank, policy, table
        self.inbox, self.notifier, self.window = ports.inbox, ports.notifier, ports.window
        self.progress, self.sender, self.spares = ports.progress, ports.sender, ports.spares
        self.master, self.optimizer, self.unit_lr = update.master, update.optimizer, update.unit_lr
        self.home = update.home if update.home is not None else HostSlice(update.master)  # (where it is stepped)
        self.master_t = self.home.tensor
        self.n_params = len(update.master) if update.n_params is None else update.n_params
        self.version, self.round_sum = update.version, update.round_sum
        self.codec, self.abort_on_nonfinite = update.codec or Codec(), update.abort_on_nonfinite
        self.recorder, self.clock, self.tl = records.recorder, records.clock, records.timeline or NullTimeline()
        self.side_tasks, self.on_applied, self.on_published = list(hooks.side_tasks), hooks.on_applied, \
            hooks.on_published
        self.release = PieceRelease(self.inbox, update.pieces) if update.pieces else None
        self.backoff = watch.backoff or Backoff()
        self.worker_ranks = list(worker_ranks)
        #: each worker's optimizer hyperparameters as its loop last set them (hpcps.training.hyper), by index
        self.hypers = ShardHypers(shard, self.worker_ranks)  # (the same list: a spare's join renames its worker)
        self.pending: dict[int, PushEvent] = {}
        self.gradients_applied = 0  # by this shard (a resumed run: its workers' clocks, all together)
        self.clocks = [0] * len(self.worker_ranks)
        self.awaiting: set[int] = set()
        self.gone: set[int] = set()
        self.lost_clocks: dict[int, list[int]] = {}  # a dead worker's pushes cut off here (run-through)
        self.dead_workers: set[int] = set()  # workers whose death this loop has handled, no spare in their place
        # stall detection: when each worker was last heard of, and who waits for a grant
        self.stalls = ShardStalls(shard, self.worker_ranks, self.inbox, lambda: self.clocks, lambda: self.awaiting,
                                  warn=watch.stall_warn, abort=watch.stall_abort)

    def run(self) -> None:
        tl = self.tl
        tl.at(self.version)
        tl.enter("publish")
        self.window.publish(self.master, self.version)
        tl.enter("wait")
        while self.inbox.open or (self.spares is not None and self.spares.pending()):
            self.window.publish_held()  # a version deferred while a lapped reader held this shard
            t = self.clock() if tl.enabled else 0.0
            events = self.inbox.poll()
            if self.spares is not None:  # after the deaths found in this poll: a join follows its death
                events += self.spares.poll(self.dead_workers.__contains__, self.clocks,
                                           self.inbox.dead.check if self.inbox.dead is not None else None)
            if events:  # the poll that completed them: their last bytes' copy (an empty poll is waiting)
                tl.enter("receive", t)
                tl.enter("other")
            self._release_pieces()
            self._log_transfers()
            for phase, task in self.side_tasks:
                t = self.clock() if tl.enabled else 0.0
                if task():
                    tl.enter(phase, t)
                    tl.enter("other")
            self._check_stall()
            if not events:
                tl.enter("wait")
                self.notifier.progress()
                if self.sender is not None:
                    self.sender.progress()
                self.backoff.pause()
                continue
            self.backoff.reset()
            notices: dict[int, list] = {}
            version_before = self.version
            for event in events:
                self._handle(event, notices)
            if self.version != version_before:
                tl.enter("publish")
                self.home.download()  # a device's slice into the master the window publishes
                self.window.publish(self.master, self.version)
                tl.at(self.version)
                if self.on_published is not None:  # before any grant: every blocked worker still waits
                    self.on_published(self.version)
            tl.enter("notify")
            for worker, (flags, clock, version, staleness, lr) in notices.items():
                self.notifier.send(worker, flags, clock, version, staleness, lr)  # never to the dead (run-through)
            granted = [w for w, (flags, *_) in notices.items() if flags & wire.GRANT] if self.sender is not None else []
            if granted and self.sender.announced != self.version:  # (a round released a piece at a time: sent)
                # after the grants, which must not queue behind the values on the wire
                self.sender.send(granted, self.master, self.version, self.window.stop_raised(), self.backoff)
            tl.enter("wait")
        if self.pending:
            raise RuntimeError(f"shard {self.shard}: gradients of workers {sorted(self.pending)} never applied")
        while not self.window.publish_held():  # the final version goes out whatever readers were doing
            self.backoff.pause()
        self.notifier.drain(self.backoff)
        if self.sender is not None:
            self.sender.drain(self.backoff)
        self.tl.close()

    def _log_transfers(self) -> None:
        """Serial transfers (hsp): record who streamed into this shard when."""
        for worker, began, ended in self.inbox.transfers:
            self.recorder.add("servers/transfers", (self.rank, self.shard, self.worker_ranks[worker], began, ended))
        self.inbox.transfers.clear()

    def _handle(self, event: PushEvent | LeaveEvent | LostEvent, notices: dict[int, list]) -> None:
        now = self.clock()
        if isinstance(event, LostEvent):
            self._lost(event, now, notices)
            return
        if isinstance(event, JoinEvent):
            self._join(event, now, notices)
            return
        self.stalls.heard[event.worker] = now
        if isinstance(event, PushEvent):
            if event.hyper:  # sent before the header: here or on its way
                source = self.inbox.worker_ranks[event.worker]
                self.hypers.edits[event.worker] = self.inbox.comm.recv(source=source, tag=wire.TAG_HYPER)
            self.stalls.pushed.add(event.worker)
            self.clocks[event.worker] = event.clock
            if self.policy.worker_blocks:
                self.awaiting.add(event.worker)
            self.pending[event.worker] = event
            extra = {"extra": event.extra} if self.policy.extra_gradients else {}
            decision = self.policy.on_push(event.worker, event.clock, event.version, now, **extra)
            if decision.drops and self.round_sum is not None:
                raise RuntimeError(f"paradigm {self.policy.name!r} holds rounds (holds_rounds) and cannot drop "
                                   f"gradients; drop them from a policy that holds its own")
            if self.round_sum is not None and not event.extra:  # an extra (hsp) is applied alone, at once
                self.round_sum.arrive(event.worker)
                self._sum_round()
            self._carry_out(decision, notices)
        else:
            self.gone.add(event.worker)
            decision = self.policy.on_leave(event.worker, now)
            if self.round_sum is not None:  # whose turn it is may have moved past the leaver
                self._sum_round()
                self.inbox.offer()
            self._carry_out(decision, notices)
            _note(notices, event.worker, wire.BYE)

    def _sum_round(self) -> None:
        """Add the round's gradients whose turn has come (worker order); free their buffers at once."""
        def take(worker: int) -> tuple[torch.Tensor | None, float]:
            push = self.pending[worker]
            finite = self._finite(push)
            self.tl.enter("sum")
            return (self._gradient(worker) if finite else None), push.lr / self.unit_lr

        for worker in self.round_sum.add_ready(take):
            self.inbox.free_buffer(worker)
        self.tl.enter("other")

    def _carry_out(self, decision: Decision, notices: dict[int, list]) -> None:
        named = [w for group in decision.updates for w in group] + list(decision.drops)
        if len(set(named)) != len(named) or not self.pending.keys() >= set(named):
            raise RuntimeError(f"paradigm {self.policy.name or type(self.policy).__name__!r} decided {decision}, but "
                               f"only workers {sorted(self.pending)} have a gradient pending here, and each "
                               f"can be applied or dropped once")
        for w in decision.drops:  # discarded by the paradigm (a round's late gradient): never applied
            push = self.pending.pop(w)
            self._row(push, self.version, self.clock(), applied=False, reason=3, lr=math.nan)
            _note(notices, w, wire.RECEIPT | wire.DROPPED, push.clock, self.version, -1, math.nan)
            self.inbox.release(w)
            if self.on_applied is not None:
                self.on_applied(1)
        for k, group in enumerate(decision.updates):
            pushes = [self.pending.pop(w) for w in group]
            summed = self.round_sum is not None and not pushes[0].extra  # a round's, summed already
            if summed:
                finite = [p for p in pushes if self.round_sum.finite[p.worker]]
            else:
                finite = [p for p in pushes if self._finite(p)]
                self.tl.enter("other")
            at, position = self.version, self.position()
            weight = decision.weights[k] if decision.weights else 1.0
            coeffs, factor = update_terms([p.lr / self.unit_lr for p in finite]) if finite else ([], 1.0)
            released = summed and self._released([p.worker for p in finite])
            if finite and not released:
                self._use_hypers(finite)
            if released:  # stepped and sent a piece at a time (hpcps.runtime.release)
                at = self._applied()
            elif finite and summed:
                n = len(finite)
                at = self._update([self.round_sum.acc], [1.0 / (n * factor)], weight * factor, means=[1.0 / n])
            elif finite:
                # each buffer change damped by its staleness (1 for a gradient computed on this version)
                means = [1.0 / (len(finite) * (1 + max(self.version - p.version, 0))) for p in finite]
                stale = sum(max(self.version - p.version, 0) for p in finite) / len(finite)
                at = self._update([self._gradient(p.worker) for p in finite], coeffs, weight * factor, means=means,
                                  staleness=stale)
            where = position if self.policy.extra_gradients else at  # a group server's: the central version
            lr = self._rate(where, weight * factor) if finite else math.nan
            self.gradients_applied += len(finite)
            t = self.clock()
            for p in pushes:
                applied = p in finite
                staleness = at - p.version if applied else -1
                self._row(p, at, t, applied=applied, reason=0 if applied else 2 if p.skip else 1, lr=lr,
                          momentum=self._momentum() if applied else math.nan)
                flags = wire.RECEIPT if applied else wire.RECEIPT | wire.DROPPED
                _note(notices, p.worker, flags, p.clock, at, staleness, lr if applied else math.nan)
                self.inbox.release(p.worker)
            if summed:
                self.round_sum.close()
            if self.on_applied is not None:
                self.on_applied(len(pushes))
        for w in decision.grants:
            self.awaiting.discard(w)
            _note(notices, w, wire.GRANT)


    def _use_hypers(self, pushes: list[PushEvent]) -> None:
        """The optimizer's hyperparameters for an update of ``pushes`` (:class:`~hpcps.training.hyper.ShardHypers`)."""
        if self.optimizer is not None:
            self.hypers.use([p.worker for p in pushes], self.optimizer,
                            lambda worker, rows: self._hyper_rows(worker, rows))

    def _hyper_rows(self, worker: int, rows: list[tuple[int, str, float]]) -> None:
        t, rank = self.clock(), self.worker_ranks[worker]
        for g, name, number in rows:
            self.recorder.add("servers/hypers", (self.rank, self.shard, t, rank, self.version, g, name.encode()[:32],
                                                 number))

    def _row(self, push: PushEvent, version: int, t: float, *, applied: bool, reason: int, lr: float,
             momentum: float = math.nan) -> None:
        """``push``'s row of this shard's table, at time ``t``: applied at ``version`` at rate ``lr`` and
        ``momentum``, or dropped for ``reason``."""
        self.recorder.add(self.table, (
            self.rank, self.shard, t, self.worker_ranks[push.worker], push.clock, version,
            version - push.version if applied else -1, self.policy.threshold(push.worker), int(applied), reason, lr,
            momentum))

    def _momentum(self) -> float:
        """The momentum the last update was applied with (its first param group's; NaN: none, or a group
        server, whose sums the central shards apply)."""
        return self.optimizer.momentum if self.optimizer is not None else math.nan

    def position(self) -> float:
        """Where the learning-rate schedule is: the version, or for a paradigm with extra gradients (hsp,
        whose extras are versions too, in numbers nobody knows ahead) the gradients applied over the
        clients, so that the run's last gradient is at ``--steps``, the schedule's horizon."""
        if self.policy.extra_gradients:
            return self.gradients_applied / len(self.worker_ranks)
        return self.version

    def _rate(self, version: float, factor: float) -> float:
        """The learning rate an update at ``version`` with factor ``factor`` is applied at (the optimizer's
        own rate, or its first param group's, x the schedule x the factor; a group server: ``--lr`` x
        the factor, the central shards' schedule applying on top)."""
        if self.optimizer is None or self.optimizer.recorded_lr is None:
            return self.unit_lr * factor
        return self.optimizer.recorded_lr * self.optimizer.schedule(version) * factor * self.optimizer.rate_factor

    def _update(self, grads: list[torch.Tensor], coeffs: list[float], factor: float,
                means: list[float] | None = None, staleness: float = 0.0) -> int:
        """Apply one update: an optimizer step from ``sum(c * g)`` with the learning rate times
        ``factor``, and the buffers' mean change ``sum(m * g)`` (``means``: ``1/len(grads)`` each
        by default; a round's sum passes ``[1/n]``); return the version it was applied to."""
        p = self.n_params
        means = means or [1.0 / len(grads)] * len(grads)
        self.tl.enter("step")
        self.optimizer.step([g[:p] for g in grads], coeffs, version=self.position(), factor=factor,
                            progress=self.progress, staleness=staleness)
        if p < len(self.master):
            apply_update(self.master_t[p:], [g[p:] for g in grads], [-m for m in means], progress=self.progress)
        self.tl.enter("other")
        return self._applied()

    def _applied(self) -> int:
        """An update was applied: the version it was applied to (the version moves on)."""
        self.version += 1
        return self.version - 1

    def _check_stall(self) -> None:
        """Name the workers that owe this shard a message and have been silent too long
        (:class:`~hpcps.runtime.stalls.ShardStalls`)."""
        self.stalls.check(self.clock(), self.gone | self.awaiting)


def _note(notices: dict[int, list], worker: int, flag: int, *fields) -> None:
    """Merge ``flag`` (and receipt fields: clock, version, staleness, rate) into the one notice ``worker``
    gets this step."""
    entry = notices.setdefault(worker, [0, -1, -1, -1, math.nan])
    entry[0] |= flag
    if fields:
        entry[1:] = fields


#: the wait for a verdict: short sleeps (it comes as its worker's backward pass ends, on the round's critical path)
VERDICT_BACKOFF = (1e-5, 1e-4)


def received_verdict(inbox, push: PushEvent, shard: int, held=None) -> bool | None:
    """The verdict that follows the payload of a push begun during backward; None where its worker died
    before sending it (run-through: the gradient is dropped, and the inbox's next poll finds the death).
    ``held``: its receive, posted already (:class:`hpcps.runtime.release.Verdicts`), and its buffer.

    A shard's slice can come whole long before its worker's backward pass ends (the last layers' gradients
    come first), and the verdict follows that end: the wait polls and sleeps. A blocking receive spins
    there, 1.5-2 ms a step on each shard of the box's 4-node ``deep_mlp``, taking a core from the
    workers whose backward pass it waits for."""
    request, verdict = held if held is not None else (None, np.empty(1, np.int64))
    rank = inbox.worker_ranks[push.worker]
    try:
        if request is None:
            request = inbox.comm.Irecv(verdict, source=rank, tag=wire.TAG_VERDICT)
        wait_until(request.Test, Backoff(*VERDICT_BACKOFF),
                   what=f"worker rank {rank}'s verdict on its gradient {push.clock}")
    except MPI.Exception as exc:
        found_dead(inbox.dead, exc)  # raised again where it is not a death under run-through
        log.warning("shard %d: worker rank %d died before the verdict on its gradient %d: dropped",
                    shard, rank, push.clock)
        return None
    return bool(verdict[0])
