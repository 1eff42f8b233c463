"""The workers' side of each paradigm: pull, (compute), push, (wait for the grant), pull again.

A worker is driven step by step by a loop (:class:`hpcps.runtime.session.Session`:
hpcps's own loop or the user's): ``begin()``, then ``open_step()`` before
each computation and ``close_step()`` after it, and ``finish()``. One
iteration of :class:`Worker` ``w`` at ``step`` k::

    compute   the loop's: forward and backward into the flat gradient buffer (with the
              change of the model's buffers, and clipped under --clip-norm), then the
              emulated compute time (hpcps.cluster.emulation), all in the session
    push      start the persistent sends of header + gradient to every shard, with
              the learning rate scaled by the staleness the worker knows of
    wait      if the paradigm blocks: until every shard granted clock k+1
    pull      RMA Get of every shard's parameters (overlaps the push in flight; a
              worker that never blocks begins the pull before the push, so that over
              TCP its requests do not queue behind the gradient)
    settle    the push must have left before backward writes the buffer again

With ``--partition-mb`` the pull comes in partitions that the next pass waits for layer by
layer (:mod:`hpcps.runtime.partitions`), the push leaves from a copy, and in hpcps's own loop
under a blocking paradigm the push begins before backward: its headers, then each chunk of the
gradient as backward completes it (:meth:`Worker.before_backward`, :mod:`hpcps.runtime.backward`).

:class:`EagerWorker` (paradigm ``eager``) decouples both: as it starts a
computation (once it has taken its parameters, before it pushes the last
gradient, so that on a TCP link the pull's requests do not queue behind
that gradient) it asks a helper thread for the newest parameters, which the
thread pulls behind the computation and keeps refreshing whenever a shard
publishes a newer version; the worker pushes from a copy of its gradients,
so it does not wait for a push before computing again, and swaps the freshest
pulled parameters in after computing. It waits for the pull issued
when computing started (so it never computes on parameters older than the
newest version published when its previous computation started), with
``--staleness s`` until what it computes on is at most ``s`` versions
behind the newest it knows of, and before a push until the shards have applied
its gradient of two pushes ago (a shard slower than its workers would otherwise
hold a queue of their gradients that grows without end).

The staleness a worker *knows of* when it pushes is the newest version it
has seen (from pulls; from receipts, since a gradient applied at version v
means the server is past v; and, when a learning-rate schedule is in force,
from reading the shards' headers just before pushing) minus the version it
computed on. Receipts
(apply version and staleness of each push) arrive as notices; an
iteration's row goes to the metrics once every shard's receipt is in. On
leaving, the worker sends ``DONE`` and reads notices until every shard has
said ``BYE``, so no message is left unreceived.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import torch

from hpcps.options.faults import IN_PUSH, Fault
from hpcps.policies.base import UNAPPLIED_AT_MOST
from hpcps.runtime.faults import inject
from hpcps.runtime.receipts import Receipts
from hpcps.runtime.parts import PullPlan, PushPlan, Records, StepPlan, Watch, WorkerPorts
from hpcps.training.flat import FlatParameters
from hpcps.training.lr import scaled_lr
from hpcps.metrics.schema import ITERATION
from hpcps.metrics.timeline import NullTimeline
from hpcps.transport import wire
from hpcps.transport.compress import all_finite
from hpcps.transport.eager import EagerPuller
from hpcps.errors import RunAborted
from hpcps.transport.poll import Backoff, StallWatch, wait_until
from hpcps.transport.window import Pull

log = logging.getLogger("hpcps")


class _Pulls:
    """A worker's pulls (a mixin of :class:`Worker`, whose attributes it reads): whole, in partitions that the
    next pass waits for layer by layer (:mod:`hpcps.runtime.partitions`), or deferred behind the next round's
    first steps (``--overlap-steps``: :meth:`take_round`); and what the versions pulled tell it."""

    def _advance_deferred(self) -> bool:
        """``defer_pull``: begin the pull of the round last pushed once it may (at once where the paradigm
        does not block, else at its grant; into :attr:`side`); keep it moving. Whether it has begun."""
        if self.deferred is None:
            if not self.pending or not self._granted():
                return False
            self.deferred = self.window.begin_pull(self.side, self.backoff)
        self.deferred.test()  # (drives MPI's progress)
        return True

    def take_round(self, row: dict | None) -> np.ndarray:
        """``defer_pull``: the round last pushed, now: wait for its grant where the paradigm blocks and for
        its pull, begun as soon as it could be (:meth:`poke`); return the parameters pulled (:attr:`side`: the
        model's own are untouched, the loop rebases onto them, and may write there until the next push). The
        waits count in ``row`` (the round under way's; None: nowhere), which computes on the versions pulled
        from now on."""
        self._settle_pull()
        with self.tl.within("grant"):
            waited = self._wait(self._advance_deferred, "its grant") if self.deferred is None else 0.0
        with self.tl.within("pull"):
            t = time.perf_counter()
            self.versions, self.stop = self.deferred.wait()
            pulled = time.perf_counter() - t
        self.pending, self.deferred = False, None
        self._seen(self.versions)
        if row is not None:
            row["wait_s"] += waited
            row["pull_s"] = row.get("pull_s", 0.0) + pulled
            row["pull_wait_s"] = row.get("pull_wait_s", 0.0) + pulled
            row["version"], row["lag"] = int(self.versions.min()), self._lag(self.versions)
        return self.side

    def _begin_pull(self) -> Pull:
        """Start a pull into the model's parameters (in partitions, with ``partitions``)."""
        if self.parts is not None:
            return self.parts.begin(self.window, self.flat.params, self.backoff)
        return self.window.begin_pull(self.flat.params, self.backoff)

    def _pull(self, begun: Pull | None = None) -> tuple[np.ndarray, bool]:
        """Finish the pull ``begun`` (or pull now) into the model's parameters; with ``partitions``, only
        its versions and what the pass needs before it starts: the pass waits for the rest layer by layer."""
        pull = begun or self._begin_pull()
        if self.parts is not None:  # (on a GPU each partition goes up as it comes)
            versions, stop = self.parts.start(pull)
        else:
            versions, stop = pull.wait()
            self.flat.upload()
        self._seen(versions)
        return versions, stop

    def _seen(self, versions: np.ndarray) -> None:
        """Shard versions observed somewhere: raise what the worker knows the servers are at."""
        self.book.seen(versions)

    def _lag(self, versions: np.ndarray) -> int:
        """How far ``versions`` are behind the newest the worker knows of (largest over shards)."""
        return self.book.lag(versions)

    @property
    def pass_waited(self) -> float:
        """Seconds the pass under way has waited for its pull's partitions, and settled the rest of the pull
        (0 without partitions)."""
        return self.pass_pull + (self.parts.waited if self.parts is not None else 0.0)

    def _settle_pull(self) -> None:
        """Partitioned pulls: the rest of the pull in flight, before the gradient goes (``pass_pull``: the
        pass's waits for it and this one, which its row counts as pull time, not compute)."""
        if self.parts is None:
            return
        t = time.perf_counter()
        waited = self.parts.waited
        with self.tl.within("pull"):  # (before backward, the pass goes on in its own phase after it)
            self.parts.settle()
        self.parts.waited = 0.0
        self.pass_pull += waited + time.perf_counter() - t  # (settled before backward, then again before the push)


class _Pushes:
    """A worker's pushes from a copy of its gradient (a mixin of :class:`Worker`, whose attributes it reads),
    and the pace the shards hold a worker that never waits for a grant to."""

    def _keep_pace(self) -> None:
        """A worker that never waits for a grant is still held to the shards' pace: before a push, wait
        until no more than :data:`~hpcps.policies.base.UNAPPLIED_AT_MOST` of its pushes, this one included,
        would be unapplied
        by some shard (their receipts not all in). A push that has left the worker's memory is not yet
        applied (an MPI send completes once the transport holds it): a shard slower than its workers (a
        busy node, a slow apply) would otherwise gather a queue of their gradients that grows without end,
        every gradient in it computed on parameters older by the whole queue (measured under eager:
        staleness 150 after 400 updates of 4 workers, with two CPU hogs on the box's two cores)."""
        if not self.blocks:
            self._wait(lambda: len(self.book.rows) < UNAPPLIED_AT_MOST,
                       f"the shards to apply its gradient of {UNAPPLIED_AT_MOST} pushes ago")

    def _push_copy(self, step: int, versions: np.ndarray, row: dict, flags: int = 0) -> int:
        """Copy the gradient into slot ``step % 2`` once its previous push has left (and the shards kept
        pace: :meth:`_keep_pace`), push it; return the slot."""
        slot = step % 2
        self.tl.enter("push")
        t = time.perf_counter()
        self._keep_pace()
        self._wait(lambda: self.pusher.test(slot), "its push to leave")  # pushed two iterations ago, as a rule
        self.stage(self.send_buffers[slot], not flags & (wire.SKIP | wire.NONFINITE))
        self._push(versions, row, slot, flags)
        row["push_s"] = time.perf_counter() - t
        return slot


class Worker(_Pulls, _Pushes):
    """Run ``steps`` iterations (or until a shard raises the stop flag)."""

    #: read the shards' versions just before pushing when the learning rate depends on staleness:
    #: a worker that pulled after its grant would otherwise know of no newer version than its own
    peek_before_push = True

    def __init__(self, *, rank: int, model: torch.nn.Module, flat: FlatParameters, ports: WorkerPorts,
                 plan: StepPlan, records: Records, push: PushPlan = PushPlan(), pull: PullPlan = PullPlan(),
                 watch: Watch = Watch()) -> None:
        """Worker rank ``rank`` trains ``model`` through its flat vector ``flat``: it pulls, pushes and hears
        through ``ports``, takes the steps ``plan`` says, its gradients leaving as ``push`` says and its
        parameters coming as ``pull`` says (:mod:`hpcps.runtime.parts`); its rows go to ``records``, and its
        waits are watched as ``watch`` says."""
        if pull.defer_pull and push.send_buffers is None:
            raise ValueError("a worker that defers its pull pushes from a copy (send_buffers)")
        if pull.sent_pull is not None and pull.defer_pull:
            raise ValueError("a sent pull is taken after each push's grant, not deferred")
        self.rank, self.model, self.flat = rank, model, flat
        self.window, self.pusher, self.notices = ports.window, ports.pusher, ports.notices
        self.defer_pull, self.sent_pull, self.parts = pull.defer_pull, pull.sent_pull, pull.partitions
        self.pending = False  # a push whose grant and pull are still to be taken (defer_pull)
        self.deferred: Pull | None = None  # that pull, once begun (into ``side``, not the model's memory)
        self.side = np.empty(flat.size, np.float32) if pull.defer_pull else None
        self.pass_pull = 0.0  # partitioned pulls: seconds the last pass waited for its pull, and its settling
        self.stage = push.stage or (lambda out, keep: self.flat.stage_grads(out))
        self.send_buffers, self.backward_pushes, self.overflow = push.send_buffers, push.backward_pushes, \
            push.overflow
        self._verdict_sends: list = []  # (request, buffer) of verdicts sent after a push begun in backward
        self.early_push_s = 0.0  # the push's time spent before backward (its slot, its headers)
        self.recorder, self.clock = records.recorder, records.clock
        self.tl = records.timeline or NullTimeline()  # the phases of this rank's time (hpcps.metrics.timeline)
        self.blocks, self.steps, self.lr = plan.blocks, plan.steps, plan.lr  # (a row's lr: the rate applied)
        self.lr_staleness = plan.lr_staleness
        self.extra_scale = 1.0  # an extra gradient's rate over a round's (HSPWorker)
        #: the loop's optimizer edits since the last push, or None (the step API's ps.optimizer:
        #: hpcps.training.hyper); they go to every shard ahead of the next push
        self.hyper_edits: Callable[[], list[dict] | None] | None = None
        self._hyper_sends: list = []  # their sends not yet known complete (all are by the time it leaves)
        self.faults = {f.step: f for f in plan.faults}
        self.after_pass = {f.step for f in plan.faults if f.kind not in IN_PUSH}  # steps whose fault may change it
        # a worker blocked on its grant is waiting on a peer the server names first; it speaks up
        # (and gives up) only at twice the limits, when the server itself may be what is stuck
        self.stall_warn = 2 * watch.stall_warn
        self.stall_abort = 2 * watch.stall_abort if watch.stall_abort is not None else None
        self.backoff = watch.backoff or Backoff()
        self.book = Receipts(len(ports.window.shard_ranks), plan.start_step)
        self.start_step = plan.start_step  # > 0 when resuming: gradients pushed (and granted) before
        self.clock_count = plan.start_step
        self.take_signal = watch.take_signal  # a stop signal this rank received (hpcps.runtime.signals), once

    # -- the steps ---------------------------------------------------------
    # A loop drives a worker as ``begin(); while open_step(): <compute>; close_step(...)``, then
    # ``finish()``: hpcps.runtime.session's Session does, under the built-in loop and the user's own alike.
    def begin(self) -> None:
        """Pull the parameters the first step computes on."""
        self.tl.at(self.start_step)
        self.tl.enter("pull")
        self.versions, self.stop = self._pull()
        self.step = self.start_step
        self.tl.enter("other")

    @property
    def running(self) -> bool:
        """Whether another step is due: ``steps`` not reached and no shard raised the stop flag."""
        return not self.stop and self.step < self.steps

    def open_step(self) -> bool:
        """Before computing step ``self.step``: wait for what the paradigm asks for; False when the run
        is over instead (the steps are done, or a shard raised the stop flag)."""
        if not self.running:
            return False
        self.row = self._start_row(self.step, self.versions)
        return True

    def close_step(self, loss: float, compute_s: float, *, skip: bool = False) -> None:
        """After computing (the gradient is in the flat buffer): record the computation, inject a
        ``--fault`` due at this step, then the paradigm's exchange (:meth:`_exchange`: push, wait,
        pull). ``skip``: push the gradient flagged ``SKIP`` (counted in its round, never applied)."""
        self.row["loss"], self.row["compute_s"] = loss, compute_s
        self._settle_pull()
        if self.step in self.faults and not self._pushed_in_backward:  # (killverdict's: in the push)
            self._inject(self.faults[self.step])
        flags = wire.SKIP if skip else 0
        if not skip and not self._pushed_in_backward:
            flags |= self._verdict()  # before staging: a gradient no shard applies leaves no residual behind
        self._exchange(self.row, flags)

    @property
    def _pushed_in_backward(self) -> bool:
        """Whether this step's push began before backward (its verdict follows its payload)."""
        return self.backward_pushes is not None and self.backward_pushes.armed

    def before_backward(self) -> None:
        """hpcps's own loop, before its backward pass: with backward pushes, begin the step's push now (its
        slot, its headers), so each piece of the gradient leaves as soon as backward has produced it. Not
        at a step with a ``--fault``, which changes the gradient after the pass."""
        if self.backward_pushes is None or not self.running or self.step in self.after_pass:
            return
        self._settle_pull()  # (the pass has what it needed; the rest of the pull before the push, as always)
        slot = self.step % 2
        t = time.perf_counter()
        with self.tl.within("push"):
            self._wait(lambda: self.pusher.test(slot), "its push to leave")  # pushed two iterations ago
            self._push(self.versions, self.row, slot, headers_only=True)
        self.early_push_s = time.perf_counter() - t
        self.backward_pushes.arm(slot)

    def _exchange(self, row: dict, flags: int) -> None:
        """Push the step's gradient (with ``flags``), wait for the grant if the paradigm blocks, pull."""
        tl = self.tl
        tl.enter("push")
        t = time.perf_counter()
        slotted = self.send_buffers is not None
        during_backward = self._pushed_in_backward
        if during_backward and flags:
            raise RuntimeError("a push begun before backward cannot be flagged after it (its verdict follows it)")
        if not slotted:
            self.stage(self.pusher.buffers[0], not flags & (wire.SKIP | wire.NONFINITE))
        # a worker that never waits for a grant begins its pull before its push: over a network the
        # pull's requests would otherwise queue behind the whole gradient (see ParamWindow.begin_pull)
        early, begun = None, 0.0
        if not self.blocks:
            tl.enter("pull")
            if self.defer_pull:  # into the side buffer: the model computes on meanwhile
                self.deferred, begun = self._timed(self.window.begin_pull, self.side, self.backoff)
            else:
                early, begun = self._timed(self._begin_pull)
            tl.enter("push")
        if during_backward:
            # the pieces backward did not complete, the buffers' change; each piece was checked as it left
            finite = self.backward_pushes.finish()
            if self.step in self.faults:  # killverdict: dies with its payload sent, before its verdict
                self._inject(self.faults[self.step])
            self._send_verdict(finite)
        elif slotted:
            self._push_copy(self.step, self.versions, row, flags)
        else:
            self._keep_pace()
            self._push(self.versions, row, flags=flags)
        row["push_s"] = time.perf_counter() - t - begun + (self.early_push_s if during_backward else 0.0)
        if self.defer_pull:  # the grant and the pull come meanwhile, the next computation under way
            self.pending = True
            row["pull_s"] = row.get("pull_s", 0.0) + begun
            row["pull_wait_s"] = row.get("pull_wait_s", 0.0) + begun
        else:
            if self.sent_pull is not None and self.blocks:  # --pull send: the receives, before the values come
                early = self.sent_pull(self.flat.params, self.parts.plan.parts if self.parts is not None else None,
                                       lambda: self._stall_watch("its round's parameters from the shards (--pull send)"))
            tl.enter("grant")
            # a sent round's header says its shard granted the push (a round released a piece at a time
            # sends it first, and the grant queues behind the values: hpcps.runtime.release)
            announced = getattr(early, "announced", None) if self.sent_pull is not None else None
            row["wait_s"] = self._wait(lambda: self._granted() or (announced is not None and announced()),
                                       "its grant") if self.blocks else 0.0
            tl.enter("pull")
            t = time.perf_counter()
            self.versions, self.stop = self._pull(early)
            row["pull_s"] = row["pull_wait_s"] = time.perf_counter() - t + begun
        if not slotted:  # the gradient buffer is the push's: it must have left before the next pass
            tl.enter("push")
            row["push_s"] += self._wait(self.pusher.test, "its push to leave")
        tl.enter("other")
        self._finish_row(row)
        self.step += 1
        tl.at(self.step)

    def _granted(self) -> bool:
        """Whether every shard has granted the worker's last push (its clock)."""
        return self.book.granted(self.clock_count)

    def finish(self) -> int:
        """Leave (``DONE``, then every shard's ``BYE``); return the number of gradients pushed."""
        self.tl.enter("other")
        self._settle_pull()
        if self.deferred is not None:  # (a loop that left before taking its last round: unpin the slots)
            self.deferred.wait()
            self.pending, self.deferred = False, None
        self._leave()
        self.tl.close()
        return self.clock_count

    def close(self) -> None:
        """Release what the worker holds beyond its transfers (eager's helper thread, the partitioned pulls'
        hooks on the model); idempotent."""
        if self.parts is not None:
            self.parts.remove()
        if self.backward_pushes is not None:
            self.backward_pushes.remove()

    @staticmethod
    def _timed(fn, *args):
        t = time.perf_counter()
        return fn(*args), time.perf_counter() - t

    def _push(self, versions: np.ndarray, row: dict, slot: int = 0, flags: int = 0, *,
              headers_only: bool = False) -> None:
        """Push the gradient computed on ``versions``, its learning rate scaled by known staleness
        (``headers_only``: its headers, the payload to follow piece by piece)."""
        self._read_notices()
        if self.lr_staleness != "none" and self.peek_before_push:
            self._seen(self.window.peek(self.backoff))
        row["lr_staleness"] = self._lag(versions)
        lr = self.lr * self.extra_scale if flags & wire.EXTRA else self.lr
        row["lr"] = scaled_lr(self.lr_staleness, lr, row["lr_staleness"])
        self.clock_count += 1
        edits = self.hyper_edits() if self.hyper_edits is not None else None
        if edits is not None:  # ahead of the header that says they came; the sends done since, let go
            self._hyper_sends = [r for r in self._hyper_sends if not r.Test()]
            self._hyper_sends += [self.pusher.comm.isend(edits, dest=rank, tag=wire.TAG_HYPER)
                                  for rank in self.pusher.shard_ranks]
            flags |= wire.HYPER
        if headers_only:
            flags |= wire.VERDICT  # backward has not produced the gradient yet: the verdict follows it
        start = self.pusher.start_header if headers_only else self.pusher.start
        start(self.clock_count, versions, row["lr"], slot, flags)

    def _verdict(self) -> int:
        """``CHECKED`` or ``NONFINITE``: whether every value of the step's gradient (its buffers' change
        too) is finite as the wire will carry it. The worker holds the whole gradient and a shard its slice
        only: one verdict makes every shard apply it, or none."""
        with self.tl.within("scan"):
            finite = all_finite(self.flat.grads_t[:self.flat.size], self.overflow)
        return wire.CHECKED if finite else wire.NONFINITE

    def _send_verdict(self, finite: bool) -> None:
        """After a push begun during backward: its verdict to every shard (each waits for it to apply);
        ``finite``: whether every value it sent was (checked piece by piece as they left)."""
        verdict = np.array([1 if finite else 0], np.int64)
        self._verdict_sends = [(r, b) for r, b in self._verdict_sends if not r.Test()]
        self._verdict_sends += [(self.pusher.comm.Isend(verdict, dest=rank, tag=wire.TAG_VERDICT), verdict)
                                for rank in self.pusher.shard_ranks]

    def _start_row(self, step: int, versions: np.ndarray) -> dict:
        return {"rank": self.rank, "step": step, "t_start": self.clock(), "version": int(versions.min()),
                "lag": self._lag(versions), "wait_s": 0.0}

    def _finish_row(self, row: dict) -> None:
        row["pull_s"] = row.get("pull_s", 0.0) + self.pass_pull
        row["pull_wait_s"] = row.get("pull_wait_s", 0.0) + self.pass_pull
        self.pass_pull = 0.0
        row["t_end"] = self.clock()
        row["staleness"] = -1
        self.book.rows[self.clock_count] = row
        self._read_notices()

    def poke(self) -> None:
        """While the emulated accelerator computes: keep pushes moving and take notices (hsp's TRANSFER
        turns, grants, receipts) as a worker's free CPU thread would."""
        self._read_notices()
        self.pusher.test()
        if self.parts is not None:
            self.parts.poke()
        if self.pending:
            self._advance_deferred()

    def _inject(self, fault: Fault) -> None:
        """``--fault``: poison the gradient, raise, or die (:func:`hpcps.runtime.faults.inject`)."""
        inject(fault, self)

    def _leave(self) -> None:
        self.pusher.start_done(self.clock_count)
        self._wait(lambda: self.notices.open == 0 and self.pusher.test_done(), "the servers' goodbye")
        for request in self._hyper_sends:  # each shard took them with their push, before its goodbye
            request.wait()
        self._hyper_sends = []
        for request, _ in self._verdict_sends:  # and its verdicts, before applying them
            request.Wait()
        self._verdict_sends = []
        if self.book.rows:
            raise RuntimeError(f"worker rank {self.rank}: no receipt for pushes {sorted(self.book.rows)}")

    # -- notices ----------------------------------------------------------
    def _wait(self, condition: Callable[[], bool], what: str = "the servers") -> float:
        def ready() -> bool:
            self._read_notices()
            return condition()
        return wait_until(ready, self.backoff, self._stall_watch(what))

    def _stall_watch(self, what: str) -> StallWatch:
        """One wait's stall watch: a warning every ``stall_warn`` seconds, :class:`RunAborted` past
        ``stall_abort``, naming ``what`` is awaited."""
        return StallWatch(warn=self.stall_warn, abort=self.stall_abort, log=log, error=RunAborted,
                          describe=lambda: f"worker rank {self.rank} (gradient {self.clock_count}) waiting for {what}")

    def _read_notices(self) -> None:
        if self.take_signal is not None and self.take_signal():
            self.window.request_stop()  # every shard's stop flag: the whole job sees it at its next pull
        self.recorder.tick()
        if self.pusher.fanout:  # a push's next shards get their turn as the last ones' pieces leave
            self.pusher.test()
        for row in self.book.take(self.notices.poll(), self.pusher.transfer):
            self.recorder.add("workers/iterations", tuple(row[name] for name in ITERATION.names))


class _SlottedWorker(Worker):
    """A worker that always pushes from a copy of its gradient in one of two ``send_buffers`` (the pusher's
    slots), so a push may still be in flight while the next gradient is computed."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.send_buffers is None:
            raise ValueError(f"{type(self).__name__} pushes from a copy: give it send_buffers (PushPlan)")


class EagerWorker(_SlottedWorker):
    """Decoupled push and pull (paradigm ``eager``); see the module docstring.

    ``pusher`` must have two slots, ``send_buffers``: the gradient is copied
    into slot ``k % 2`` and pushed from there, so a push may still be in
    flight while the next gradient is computed.
    """

    #: the helper thread's pull, issued when computing started, already brings fresh versions
    #: (and two threads must not lock the same window target at once)
    peek_before_push = False

    def __init__(self, *, bound: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bound = bound
        self.puller = EagerPuller(self.window, self.flat.size)

    def begin(self) -> None:
        self.tl.at(self.start_step)
        self.tl.enter("pull")
        self.puller.request()
        wait_until(self.puller.ready, self.backoff)
        self.versions, self.stop, _ = self._take()
        self.step = self.start_step
        self.expected = 0.0  # running average of the compute time: when to start the pull
        self.puller.request(self.expected)  # the take used up the request: the next, for the first step's end
        self.tl.enter("other")

    def open_step(self) -> bool:
        if not self.running:
            return False
        self._seen(self.puller.latest())
        held = 0.0
        while self.bound is not None and self._lag(self.versions) > self.bound and not self.stop:
            # what the worker knows moved on after its last take (a receipt, a peek): refresh first
            self.tl.enter("pull")
            self.puller.request()
            self.puller.hurry()
            held += self._wait(self._fresh_enough, "fresh parameters")
            self.versions, self.stop, _ = self._take()
            self.puller.request(self.expected)  # the take used up the request for this computation
        self.tl.enter("other")
        if self.stop:
            return False
        self.row = self._start_row(self.step, self.versions)  # nothing between the check and here raises known
        self.held = held
        return True

    def _exchange(self, row: dict, flags: int) -> None:
        step, compute_s = self.step, row["compute_s"]
        self.expected = compute_s if step == self.start_step else 0.7 * self.expected + 0.3 * compute_s
        self.tl.enter("pull")
        self.puller.hurry()
        row["pull_wait_s"] = self.held + self._wait(self._fresh_enough, "fresh parameters")
        t = time.perf_counter()
        computed_on, (self.versions, self.stop, row["pull_s"]) = self.versions, self._take()
        row["pull_wait_s"] += time.perf_counter() - t  # swapping the snapshot in is the worker's own time
        if step + 1 < self.steps and not self.stop:
            # the newest parameters for the next computation, fetched just in time behind it; the
            # pull's requests leave before this push, which would otherwise hold them up on a TCP link
            self.puller.request(self.expected)
            row["pull_wait_s"] += self._wait(self.puller.begun, "its pull to begin")
        self._push_copy(step, computed_on, row, flags)
        self.tl.enter("other")
        self._finish_row(row)
        self.step += 1
        self.tl.at(self.step)

    def close(self) -> None:
        super().close()
        self.puller.close()

    def _take(self) -> tuple[np.ndarray, bool, float]:
        """Swap the staged parameters in (:meth:`EagerPuller.take`: the staging buffer becomes the model's
        memory on the CPU, no copy; then onto the device)."""
        if self.flat.transfer == "shared":
            versions, stop, pull_s = self.puller.take(swap=self.flat.swap_params)
        else:  # the host array stays pinned memory (fast uploads): copy into it
            versions, stop, pull_s = self.puller.take(self.flat.params)
        self.flat.upload()
        self._seen(versions)
        return versions, stop, pull_s

    def _fresh_enough(self) -> bool:
        """A pull issued since computing started has arrived, and (``--staleness``) is within the bound."""
        if not self.puller.ready():
            return False
        if self.bound is None:
            return True
        self._seen(self.puller.latest())
        return self._lag(self.puller.staged()) <= self.bound


class HSPWorker(_SlottedWorker):
    """Paradigm ``hsp``: a round's gradient, then up to ``max_extra`` extra ones while the round is open.

    After pushing its round's gradient (and waiting for its turn to stream
    it in: computing meanwhile would hold up the shard's serial transfers)
    the worker does not sit idle: while its grant has not come it computes
    further gradients on the parameters it has and pushes them flagged
    ``EXTRA`` (the shard scales them by their staleness), at most
    ``max_extra`` per round. Each extra is an iteration
    of its own (a row, a step), so a worker still pushes ``steps``
    gradients in all. Pushes go from two send buffers, as a payload may wait
    for its ``TRANSFER`` turn while the next gradient is computed.
    """

    def __init__(self, *, max_extra: int = 1, extra_scale: float = 1.0, **kwargs) -> None:
        """``extra_scale``: an extra gradient's learning rate over a round's (``--lr-scaling``)."""
        super().__init__(**kwargs)
        self.max_extra = max_extra
        self.extra_scale = extra_scale

    def begin(self) -> None:
        super().begin()
        self.extras = 0  # extra gradients pushed in this round
        self.extra = False  # this gradient is computed while an earlier push of the round waits for its grant

    def _exchange(self, row: dict, flags: int) -> None:
        step = self.step
        slot = self._push_copy(step, self.versions, row, flags | (wire.EXTRA if self.extra else 0))
        self.extras += self.extra
        self.step += 1
        self.tl.at(self.step)
        if not self.extra:  # the round's gradient: idle until its turn to stream in is over
            row["push_s"] += self._wait(lambda: self.pusher.test(slot), "its turn to transfer")
        if self.extras < self.max_extra and not self._granted() and self.step < self.steps:
            row["pull_s"] = row["pull_wait_s"] = 0.0  # go on computing on the parameters it has
            self.tl.enter("other")
            self._finish_row(row)
            self.extra = True
            return
        self.tl.enter("grant")
        row["wait_s"] = self._wait(self._granted, "its grant")
        self.extras, self.extra = 0, False
        self.tl.enter("pull")
        t = time.perf_counter()
        self.versions, self.stop = self._pull()
        row["pull_s"] = row["pull_wait_s"] = time.perf_counter() - t
        self.tl.enter("other")
        self._finish_row(row)
