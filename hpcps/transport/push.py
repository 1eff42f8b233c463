"""Pushes: worker-side persistent sends, server-side receives.

A worker pushes from one of a ring of send *slots*: by default a single slot
that is its flat gradient buffer itself (no copy), or several buffers it
copies gradients into so that a push can still be in flight while the next
backward runs (eager). Each slot has persistent sends per shard; the header
travels in a separate small message ahead of the gradient (format in
:mod:`wire`). Buffer ownership: a started push owns its slot's buffer until
``test(slot)`` returns true.

With ``fanout=K`` a push's payloads go to at most ``K`` shards at once: the shards in a rotation that
starts at shard ``S - 1 - first`` (``first``: the worker's index) and goes down, so that in a lock-step
round each phase's pushes reach every shard from one worker (a permutation: no shard's link takes
every worker's push at once), and the first shard a worker's rotation reaches is the one whose pieces
backward produces first for worker 0 (pieces go last layers first, and striped slices deal the last
chunks to the last shards). A shard's pieces are sent as they are ready once its turn has come; the
next shard's turn comes when one shard's pieces have all left. The rotation moves on whenever the
worker tests its push (:meth:`Pusher.test`, which every wait of a worker calls).

With ``serial=True`` (hsp) a push sends its headers only, and the payload
to shard s leaves when shard s says ``TRANSFER`` (:meth:`Pusher.transfer`);
the inbox then lets one worker at a time stream into the shard and keeps a
log of who transferred when (:attr:`PushInbox.transfers`).

The inbox takes headers by a matched probe from any source (``MPI_Improbe``, then ``MPI_Mrecv`` of the
message it matched), never by a posted wildcard receive: under MPICH over UCX's TCP transport a posted
``MPI_ANY_SOURCE`` receive can miss a message that a probe sees (when the sender has a receive of its own
posted from this rank, as every worker has for its notices), and every run hung at its first rounds. A
header whose worker still has a message in hand waits in that worker's backlog (MPI keeps one sender's
messages in order), so a poll costs one probe plus one test per payload in flight, whatever the worker
count.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from hpcps.transport import wire
from hpcps.transport.failures import found_dead


class Pusher:
    """Worker side: sends a slot's buffer (sliced by ``bounds``) to every shard.

    ``pieces[s]``, if given: the ``(lo, hi)`` ranges of the buffer that go to shard ``s``, one message
    each, in this order (by default one, ``bounds[s]``): its inbox receives them so
    (:class:`PushInbox`'s ``pieces``). A push may then send its header first (:meth:`start_header`) and
    each piece as it is ready (:meth:`start_piece`), the rest with :meth:`start_rest`.
    """

    def __init__(self, comm: MPI.Comm, *, buffers: Sequence[np.ndarray], shard_ranks: Sequence[int],
                 bounds: Sequence[tuple[int, int]], worker_rank: int, serial: bool = False,
                 pieces: Sequence[Sequence[tuple[int, int]]] | None = None, fanout: int = 0,
                 first: int = 0) -> None:
        self.comm = comm
        self.serial = serial
        n = len(shard_ranks)
        #: shards a push's payloads go to at once (0: all; serial pushes take their turns from the shards)
        self.fanout = fanout if 0 < fanout < n and not serial else 0
        self.order = [(n - 1 - first - j) % n for j in range(n)]  # the fan-out's rotation of the shards
        self.waiting: list[deque[int]] = [deque() for _ in shard_ranks]  # serial: slots owed to each shard
        self.worker_rank = worker_rank
        self.shard_ranks = list(shard_ranks)
        self.buffers = list(buffers)
        self.pieces = [list(p) for p in pieces] if pieces is not None else [[b] for b in bounds]
        self.headers = np.zeros((len(buffers), len(self.shard_ranks), wire.HEADER_LEN), np.int64)
        self.header_reqs: list[list[MPI.Prequest]] = []  # [slot][shard]
        self.data_reqs: list[list[list[MPI.Prequest]]] = []  # [slot][shard][piece]
        self.sent: list[list[list[bool]]] = []  # [slot][shard][piece]: ready to go in the push under way
        self.started: list[list[list[bool]]] = []  # [slot][shard][piece]: on the wire (differs under a fan-out)
        for slot, buf in enumerate(buffers):
            self.header_reqs.append([comm.Send_init(self.headers[slot, s], dest=rank, tag=wire.TAG_PUSH_HEADER)
                                     for s, rank in enumerate(self.shard_ranks)])
            self.data_reqs.append([[comm.Send_init(buf[lo:hi], dest=rank, tag=wire.TAG_PUSH_DATA)
                                    for lo, hi in self.pieces[s]] for s, rank in enumerate(self.shard_ranks)])
            self.sent.append([[True] * len(p) for p in self.pieces])
            self.started.append([[True] * len(p) for p in self.pieces])
        # every persistent send of a slot, in one list (a poll tests them at once)
        self.requests = [[*h, *(r for rs in d for r in rs)] for h, d in zip(self.header_reqs, self.data_reqs)]
        self._done: list[tuple[MPI.Request, np.ndarray]] = []

    def start(self, clock: int, versions: np.ndarray, lr: float, slot: int = 0, flags: int = 0) -> None:
        """Push ``slot``'s buffer as the gradient with ``clock``; ``versions[s]``: shard s's version it used."""
        self.start_header(clock, versions, lr, slot, flags)
        if not self.serial:
            self.start_rest(slot)
            return
        for owed in self.waiting:  # serial: payloads wait for TRANSFER
            owed.append(slot)

    def start_header(self, clock: int, versions: np.ndarray, lr: float, slot: int = 0, flags: int = 0) -> None:
        """Begin a push from ``slot``: its headers, no payload yet (:meth:`start_piece`, :meth:`start_rest`)."""
        if not self.test(slot):
            raise RuntimeError(f"push slot {slot} started while its previous push is still in flight")
        for s in range(len(self.shard_ranks)):
            wire.encode_header(self.headers[slot, s], wire.KIND_PUSH, self.worker_rank, clock, int(versions[s]), lr,
                               flags)
            self.sent[slot][s] = [False] * len(self.pieces[s])
            self.started[slot][s] = [False] * len(self.pieces[s])
        MPI.Prequest.Startall(self.header_reqs[slot])

    def start_piece(self, slot: int, shard: int, k: int) -> None:
        """Send piece ``k`` of ``shard`` from ``slot`` (its values are in the buffer; under a fan-out, once
        the shard's turn has come); the pieces of a shard must be sent in their order."""
        if self.sent[slot][shard][k] or (k and not self.sent[slot][shard][k - 1]):
            raise RuntimeError(f"piece {k} of shard {shard} sent out of order")
        self.sent[slot][shard][k] = True
        if self.fanout:
            self._advance(slot)
        else:
            self.started[slot][shard][k] = True
            self.data_reqs[slot][shard][k].Start()

    def _advance(self, slot: int) -> None:
        """Fan-out: start the ready pieces of the first ``fanout`` shards in the rotation whose pieces have
        not all left."""
        turns = 0
        for s in self.order:
            started = self.started[slot][s]
            if all(started) and MPI.Request.Testall(self.data_reqs[slot][s]):
                continue  # (an inactive persistent request tests complete: pieces of no push under way)
            for k, ready in enumerate(self.sent[slot][s]):
                if ready and not started[k]:
                    started[k] = True
                    self.data_reqs[slot][s][k].Start()
            turns += 1
            if turns == self.fanout:
                return

    def start_rest(self, slot: int, shard: int | None = None) -> None:
        """Send every piece of ``slot`` not sent yet (to ``shard``, or to every shard), in order."""
        for s in range(len(self.shard_ranks)) if shard is None else (shard,):
            for k, sent in enumerate(self.sent[slot][s]):
                if not sent:
                    self.start_piece(slot, s, k)

    def transfer(self, shard: int) -> None:
        """Serial: ``shard`` said TRANSFER; send it the payload of this worker's oldest waiting push."""
        self.start_rest(self.waiting[shard].popleft(), shard)

    def test(self, slot: int | None = None) -> bool:
        """True once ``slot``'s (default: every slot's) buffer may be reused."""
        if any(slot in owed if slot is not None else owed for owed in self.waiting):
            return False
        slots = range(len(self.buffers)) if slot is None else (slot,)
        if self.fanout:
            for k in slots:
                self._advance(k)
        return all(all(map(all, self.started[k])) and MPI.Request.Testall(self.requests[k]) for k in slots)

    def headers_sent(self, slot: int) -> bool:
        """Whether the headers of ``slot``'s push have left (its payloads may not have)."""
        return MPI.Request.Testall(self.header_reqs[slot])

    def start_done(self, clock: int) -> None:
        """Tell every shard this worker leaves after ``clock`` pushes (after any push in flight)."""
        for s, rank in enumerate(self.shard_ranks):
            buf = np.zeros(wire.HEADER_LEN, np.int64)
            wire.encode_header(buf, wire.KIND_DONE, self.worker_rank, clock, -1, 0.0)
            self._done.append((self.comm.Isend(buf, dest=rank, tag=wire.TAG_PUSH_HEADER), buf))

    def test_done(self) -> bool:
        return MPI.Request.Testall([r for r, _ in self._done]) and self.test()

    def free(self) -> None:
        for reqs in self.requests:
            for req in reqs:
                req.Free()
        self.requests, self.header_reqs, self.data_reqs = [], [], []


@dataclass(frozen=True)
class RunThrough:
    """A shard's inbox under run-through (Open MPI's ULFM): ``dead``, a
    :class:`~hpcps.transport.failures.DeadRanks` over its communicator (a worker that dies comes out of
    :meth:`PushInbox.poll` as a :class:`LostEvent` instead of an MPI error); ``spares``, the ranks that may
    take a dead worker's place (:meth:`PushInbox.rejoin`; their headers before it wait)."""

    dead: Any
    spares: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class PushEvent:
    """A complete push (gradient held in the inbox until released)."""

    worker: int
    clock: int
    version: int
    lr: float
    flags: int = 0  # the header's push flags (wire.EXTRA ...; the worker's verdict on the gradient among them)

    @property
    def extra(self) -> bool:
        """An hsp gradient computed while its worker waited for its round to close."""
        return bool(self.flags & wire.EXTRA)

    @property
    def skip(self) -> bool:
        """The worker skipped the step: counted in its round, never applied."""
        return bool(self.flags & wire.SKIP)

    @property
    def hyper(self) -> bool:
        """The worker sent new optimizer hyperparameters before this push (tag HYPER)."""
        return bool(self.flags & wire.HYPER)


@dataclass(frozen=True, slots=True)
class LeaveEvent:
    worker: int
    clock: int


@dataclass(frozen=True, slots=True)
class LostEvent:
    """Worker ``worker`` died (run-through, :mod:`hpcps.transport.failures`): it leaves without a word.
    ``clocks``: its pushes this shard had taken up (their headers here) whose payloads never came whole."""

    worker: int
    clocks: tuple[int, ...] = ()
    leaves: bool = True  # False: a push of a worker already found dead, whose header MPI delivered since


class PushInbox:
    """Server side: the workers' push headers, and receive buffers for their gradients.

    Worker ``i`` (index into ``worker_ranks``) goes through the states
    header -> payload -> held. A held gradient stays in :meth:`gradient`
    until :meth:`release`, and only then is that worker's next header
    taken up, so a worker's later messages (including ``DONE``) are never
    acted on before its previous gradient is dealt with.

    Headers come by a matched probe (the module docstring says why).

    Gradient buffers: a pool of ``pool`` buffers shared by all workers (one
    per worker with ``pool=None``, or where the pool is at least the worker
    count): a worker whose header came while every buffer is taken waits
    for one, and its payload waits meanwhile where large messages wait in
    MPI, at the sender (rendezvous). The shard then holds ``pool``
    gradients whatever the worker count. ``reserve()``, if given, names the worker the last free
    buffer is kept for: a BSP shard that sums its round in worker order
    (:mod:`hpcps.runtime.rounds`) keeps it for the worker whose turn it is, frees
    each buffer as soon as its gradient is summed (:meth:`free_buffer`),
    and takes up the next headers only once the round is applied
    (:meth:`release`). Serial transfers (hsp) take a buffer the same way,
    one worker at a time, in the order their headers came.
    """

    def __init__(self, comm: MPI.Comm, *, worker_ranks: Sequence[int], shard_len: int,
                 on_transfer: Callable[[int], object] | None = None,
                 clock: Callable[[], float] = time.perf_counter, pool: int | None = None,
                 reserve: Callable[[], int | None] | None = None, dtype: np.dtype = np.dtype(np.float32),
                 pieces: Sequence[tuple[int, int]] | None = None, runthrough: RunThrough | None = None) -> None:
        """``on_transfer(i)``, if given, makes transfers serial: it must tell worker ``i`` to send its payload;
        ``shard_len`` and ``dtype``: a payload's elements and their type (compressed pushes:
        :mod:`hpcps.transport.compress`); ``pieces``: the ``(lo, hi)`` ranges of a payload, one message
        each, in the order the workers send them (:class:`Pusher`'s; by default the whole payload);
        ``runthrough``: the ranks found dead and the spares, under run-through (:class:`RunThrough`)."""
        n = len(worker_ranks)
        dead, spares = (runthrough.dead, runthrough.spares) if runthrough is not None else (None, ())
        self.dead = dead
        self.comm, self.worker_ranks = comm, list(worker_ranks)
        self.index_of = {r: i for i, r in enumerate(self.worker_ranks)}
        self.reserve = reserve
        self.on_transfer, self.clock = on_transfer, clock
        self.streaming: tuple[int, float] | None = None  # serial: (worker, since when)
        self.transfers: list[tuple[int, float, float]] = []  # serial: (worker, began, ended), to be drained
        self.headers = np.zeros((n, wire.HEADER_LEN), np.int64)  # each worker's header in hand
        self.grads = np.zeros((n if pool is None else min(pool, n), shard_len), dtype)
        self.pieces = list(pieces) if pieces is not None else [(0, shard_len)]
        self.incoming = np.zeros(wire.HEADER_LEN, np.int64)
        self.status = MPI.Status()
        self.backlog: dict[int, deque[np.ndarray]] = {}  # headers that came while their worker had one in hand
        self.early: list[LeaveEvent | LostEvent] = []  # leaves taken up from a backlog by release(), for the next poll
        self.free_buffers: deque[int] = deque(range(len(self.grads)))  # buffers nobody holds
        self.buffer_of: dict[int, int] = {}  # worker -> the buffer its gradient is in (or comes to)
        self.awaiting_buffer: dict[int, None] = {}  # workers whose header came, in arrival order
        self.receiving: dict[int, list[MPI.Request]] = {}  # worker -> its payload's receives, while in flight
        self._status_pool: list[MPI.Status] = []  # see _statuses
        self.listening = set(range(n))  # workers whose next header is taken up as it comes
        self.cut: list[int] | None = None  # a checkpoint's cut: the last clock taken up per worker (hold_after)
        self.regulars = [0] * n  # pushes not flagged EXTRA taken up per worker in this run (a round's, hsp)
        self.round_cut: int | None = None  # a checkpoint's cut: the regular pushes taken up per worker
        self.open = n  # workers whose leave poll() has not returned yet
        self.lost: set[int] = set()  # workers found dead (run-through)
        self.spares = set(spares)
        self.unplaced: dict[int, deque[np.ndarray]] = {}  # a spare's headers that came before its join here
        #: ranks out of the run for good: dead workers whose places spares took. A message of theirs that MPI
        #: delivers late (a header sent just before the death) is dropped: their index is the spare's now
        self.retired: set[int] = set()

    @property
    def pooled(self) -> bool:
        """Whether workers share fewer buffers than there are workers (and may wait for one)."""
        return len(self.grads) < len(self.worker_ranks)

    def poll(self) -> list[PushEvent | LeaveEvent | LostEvent]:
        """Advance every worker's state; return the pushes and leaves that completed, and the deaths found."""
        events: list[PushEvent | LeaveEvent | LostEvent] = self.early
        self.early = []
        if self.dead is not None and self.dead.dead:  # found by any user of the communicator
            self._lose(self.dead.dead, events)
        while self._header_came(events):
            source = self.status.Get_source()
            header = self.incoming.copy()
            if source in self.retired:  # sent before it died, come after a spare took its place: nobody's now
                continue
            i = self.index_of.get(source)
            if i is None and source in self.spares:  # a spare whose join has not reached this shard yet
                self.unplaced.setdefault(source, deque()).append(header)
                continue
            if i is None:
                raise RuntimeError(f"push header from rank {source}, which is not a worker of this server")
            if i in self.lost:  # sent before it died: its payload will never be received
                if header[0] == wire.KIND_PUSH:
                    events.append(LostEvent(i, (int(header[2]),), leaves=False))
                continue
            if i in self.listening and self._admits(i, header):
                self._take_up(i, header, events)
            else:
                self.backlog.setdefault(i, deque()).append(header)
        for i in self._payloads_done():
            h = self.headers[i]
            events.append(PushEvent(i, int(h[2]), int(h[3]), wire.decode_lr(h), int(h[5])))
            if self.streaming is not None and self.streaming[0] == i:
                self.transfers.append((i, self.streaming[1], self.clock()))
                self.streaming = None
        self.open -= sum(isinstance(e, LeaveEvent) or isinstance(e, LostEvent) and e.leaves
                         for e in events)  # counted when returned, not when taken up
        if self.on_transfer is not None:  # serial: the next one, if the last is in
            self._give_buffers()
        return events

    def _take_up(self, i: int, header: np.ndarray, events: list) -> None:
        """Worker ``i``'s next header: a leave, or a push whose payload is to be received."""
        self.listening.discard(i)
        self.headers[i] = header
        if header[0] != wire.KIND_PUSH:
            events.append(LeaveEvent(i, int(header[2])))
        else:
            self.regulars[i] += int(not header[5] & wire.EXTRA)
            self.awaiting_buffer[i] = None
            self._give_buffers()

    def _receive(self, i: int) -> None:
        """Start worker ``i``'s payload receive into the buffer just given to it; serial: tell it to
        send, and note the transfer as the one streaming."""
        buf, source = self.grads[self.buffer_of[i]], self.worker_ranks[i]
        self.receiving[i] = [self.comm.Irecv(buf[lo:hi], source=source, tag=wire.TAG_PUSH_DATA)
                             for lo, hi in self.pieces]
        if self.on_transfer is not None:  # the receive is posted before the worker is told to send
            self.streaming = (i, self.clock())
            self.on_transfer(i)

    def _header_came(self, events: list) -> bool:
        """Whether a header came (now in ``self.incoming``, its sender in ``self.status``); a death MPI
        reports instead goes into ``events``."""
        try:
            message = self.comm.Improbe(source=MPI.ANY_SOURCE, tag=wire.TAG_PUSH_HEADER, status=self.status)
        except MPI.Exception as exc:  # a wildcard probe while a death is not acknowledged
            self._lose(found_dead(self.dead, exc), events)
            message = self.comm.Improbe(source=MPI.ANY_SOURCE, tag=wire.TAG_PUSH_HEADER,
                                        status=self.status)  # acknowledged: it matches the living again
        if message is None:
            return False
        message.Recv(self.incoming)  # the matched message, already here: no other receive can take it
        return True

    def _payloads_done(self) -> list[int]:
        """Workers whose payload came whole; one whose receive failed because it died leaves (next poll)."""
        done = []
        for w, reqs in list(self.receiving.items()):
            statuses = self._statuses(len(reqs))
            try:
                complete = MPI.Request.Testall(reqs, statuses)
            except MPI.Exception as exc:  # MPI_ERR_IN_STATUS: the death is in a status
                self._lose(found_dead(self.dead, exc, statuses) | {self.worker_ranks[w]}, self.early)
                continue
            if complete:
                del self.receiving[w]
                done.append(w)
        return done

    def _statuses(self, n: int) -> list[MPI.Status]:
        """``n`` statuses for a ``Testall`` to fill (kept: the server polls in a loop)."""
        while len(self._status_pool) < n:
            self._status_pool.append(MPI.Status())
        return self._status_pool[:n]

    def _lose(self, ranks: set[int], events: list) -> None:
        """Dead ``ranks``: each worker among them leaves with the pushes it had begun here (:class:`LostEvent`).
        Its header backlog goes with it; its buffer is freed; its receives are left to MPI (they failed)."""
        for rank in sorted(ranks):
            i = self.index_of.get(rank)
            if i is None or i in self.lost:
                continue  # a server's death: the caller's to handle
            if i not in self.listening and self.headers[i][0] != wire.KIND_PUSH:
                continue  # it had left (its leave taken up) before it died: nothing of it is lost
            self.lost.add(i)
            clocks = [int(h[2]) for h in self.backlog.pop(i, ()) if h[0] == wire.KIND_PUSH]
            in_hand = i not in self.listening and self.headers[i][0] == wire.KIND_PUSH
            if in_hand and (i in self.receiving or i in self.awaiting_buffer):
                clocks.insert(0, int(self.headers[i][2]))
                self.receiving.pop(i, None)
                self.awaiting_buffer.pop(i, None)
                self.free_buffer(i)
            self.listening.discard(i)
            if self.streaming is not None and self.streaming[0] == i:
                self.streaming = None
            events.append(LostEvent(i, tuple(clocks)))

    def rejoin(self, worker: int, rank: int) -> None:
        """Spare ``rank`` takes the place of ``worker``, found dead (:mod:`hpcps.runtime.spares`): its messages
        are that worker's from now on, the headers it sent before this first."""
        self.index_of.pop(self.worker_ranks[worker], None)
        self.retired.add(self.worker_ranks[worker])
        self.worker_ranks[worker] = rank
        self.index_of[rank] = worker
        self.lost.discard(worker)
        self.headers[worker] = 0
        self.backlog[worker] = self.unplaced.pop(rank, deque())
        self.listening.add(worker)
        self.open += 1
        self._take_up_queued(worker)

    def _give_buffers(self) -> None:
        """Start the payload receive of waiting workers, in arrival order, while buffers are free;
        with ``reserve``, the last free buffer only for the worker it names; serial: one at a time."""
        while self.free_buffers and self.awaiting_buffer and (self.on_transfer is None or self.streaming is None):
            if self.reserve is not None and len(self.free_buffers) == 1:
                i = self.reserve()
                if i is None or i not in self.awaiting_buffer:
                    return
            else:
                i = next(iter(self.awaiting_buffer))
            del self.awaiting_buffer[i]
            self.buffer_of[i] = self.free_buffers.popleft()
            self._receive(i)

    def unmatched(self, worker: int) -> str | None:
        """What MPI holds from ``worker`` that no receive has taken (a probe, for a stall's report): the tag of
        its oldest such message, or None. A silent worker with a message here is a matching fault above MPI
        (hpcps's, or the MPI's own: see the module docstring); none means the bytes never arrived."""
        status = MPI.Status()
        try:
            if self.comm.Iprobe(source=self.worker_ranks[worker], tag=MPI.ANY_TAG, status=status):
                return wire.TAG_NAMES.get(status.Get_tag(), str(status.Get_tag()))
        except MPI.Exception:  # a dead rank under run-through: nothing to say
            pass
        return None

    def payloads_coming(self) -> list[int]:
        """Workers whose payload is coming in now (its receive posted, not complete): over a slow link
        one gradient can take longer than the stall limits, and the worker is not silent meanwhile."""
        return sorted(self.receiving)

    def waiting_for_shard(self) -> list[int]:
        """Workers whose header is in and whose payload waits for this shard (a free buffer, or its
        serial turn): they have sent what they can, and owe the shard nothing."""
        return list(self.awaiting_buffer)

    def gradient(self, worker: int) -> np.ndarray:
        return self.grads[self.buffer_of[worker]]

    def offer(self) -> None:
        """Give free buffers to waiting workers (call when ``reserve``'s answer may have changed)."""
        self._give_buffers()

    def free_buffer(self, worker: int) -> None:
        """``worker``'s gradient is used up (summed); its buffer goes to whoever waits for one."""
        if worker in self.buffer_of:
            self.free_buffers.append(self.buffer_of.pop(worker))
            self._give_buffers()

    def release(self, worker: int) -> None:
        """The held gradient of ``worker`` is used up; take up its next message."""
        self.free_buffer(worker)
        self.listening.add(worker)
        self._take_up_queued(worker)

    def _take_up_queued(self, worker: int) -> None:
        queued = self.backlog.get(worker)
        if queued and worker in self.listening and self._admits(worker, queued[0]):
            self._take_up(worker, queued.popleft(), self.early)

    def _admits(self, i: int, header: np.ndarray) -> bool:
        """Whether worker ``i``'s message ``header`` may be taken up: always, unless a cut holds its messages
        past the cut's clock (:meth:`hold_after`) or past its cut's regular push (:meth:`hold_after_regulars`)."""
        return (self.cut is None or int(header[2]) <= self.cut[i]) and \
            (self.round_cut is None or self.regulars[i] < self.round_cut)

    def clocks_in_hand(self, clocks: Sequence[int]) -> list[int]:
        """Each worker's clock counting the push whose header is taken up but not yet handled (its payload
        waiting for a buffer, or coming in), over ``clocks``, those the shard handled."""
        return [int(self.headers[i][2]) if i not in self.listening and self.headers[i][0] == wire.KIND_PUSH
                else int(clocks[i]) for i in range(len(self.worker_ranks))]

    def hold_after(self, cut: Sequence[int] | None) -> None:
        """A consistent cut (hpcps.runtime.checkpoints.cut): take up worker ``i``'s messages only up to clock
        ``cut[i]``; later ones wait (their headers here, their payloads at the senders) until
        ``hold_after(None)``, which takes them up again."""
        self.cut = None if cut is None else [int(c) for c in cut]
        self._admit_held()

    def hold_after_regulars(self, n: int | None) -> None:
        """A consistent cut between rounds (hsp; hpcps.runtime.checkpoints.cut): take up worker ``i``'s messages only
        up to its ``n``-th push not flagged ``EXTRA`` in this run, the gradient it pushed for round ``n-1``
        (the extras it computed before it come first); later ones wait until ``hold_after_regulars(None)``."""
        self.round_cut = n
        self._admit_held()

    def _admit_held(self) -> None:
        for worker in list(self.backlog):  # what the new cut (or none) admits
            self._take_up_queued(worker)

    def free(self) -> None:
        """Release the receives (headers are probed for: none is posted)."""
        self.listening.clear()
        for reqs in self.receiving.values():  # none once every worker has left
            for req in reqs:
                req.Cancel()
                req.Wait()
        self.receiving.clear()
