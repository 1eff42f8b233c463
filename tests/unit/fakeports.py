"""Fake transports for the roles, without MPI: one shard and its workers joined in one process.

A :class:`Fabric` stands in for MPI between one central shard and ``n`` workers: pushes go into the
shard's inbox, notices into each worker's box, the window is a copy of what the shard published (and a
round the shard sends, ``--pull send``, a copy in each worker's queue), all under one lock, so a :class:`~hpcps.runtime.server.ShardServer` in one thread and
:class:`~hpcps.runtime.worker.Worker`\\ s in others talk as over MPI. Each fake implements the port of
:mod:`hpcps.runtime.parts` that it stands for, and no more: a role that calls something else fails loudly.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from hpcps.runtime.parts import Records, ServerPorts, WorkerPorts
from hpcps.transport import wire
from hpcps.transport.notices import Notice
from hpcps.runtime.spares import JoinEvent
from hpcps.transport.push import LeaveEvent, LostEvent, PushEvent


class Fabric:
    """The wire between one shard (rank 0) and ``n_workers`` workers (ranks 1..n), in one process."""

    def __init__(self, n_workers: int, size: int) -> None:
        self.lock = threading.Lock()
        self.n_workers, self.size = n_workers, size
        self.published = np.zeros(size, np.float32)
        self.version = -1  # nothing published yet
        self.stop = False
        self.pushes: deque = deque()  # (event, payload) in arrival order
        self.notices = [deque() for _ in range(n_workers)]
        self.pulls = [0] * n_workers  # pulls each worker made
        self.sent: list[tuple[int, int, int]] = []  # (worker, clock, version) of every push
        self.dead: set[int] = set()  # ranks that died: notices to them are lost, as MPI's would be
        self.rounds = [deque() for _ in range(n_workers)]  # sent rounds (--pull send): (version, stop, values)

    def kill(self, worker: int) -> None:
        """Worker ``worker`` (rank ``worker + 1``) dies after what it has pushed: the shard finds it dead
        (run-through) after those pushes."""
        with self.lock:
            self.dead.add(worker + 1)
            self.pushes.append((LostEvent(worker), None))

    def worker_ports(self, worker: int, buffer: np.ndarray) -> WorkerPorts:
        return WorkerPorts(FakeWindow(self, worker), FakePusher(self, worker, buffer), FakeNoticeBox(self, worker))

    def server_ports(self, spares: "FakeSpares | None" = None, sent: bool = False) -> ServerPorts:
        """``sent``: the shard sends each round to its granted workers (``--pull send``, :class:`FakeSender`)."""
        return ServerPorts(FakeInbox(self), FakeNotifier(self), FakeWindow(self, None), spares=spares,
                           sender=FakeSender(self) if sent else None)

    def sent_pull(self, worker: int):
        """A worker's ``sent_pull`` (:attr:`~hpcps.runtime.parts.PullPlan.sent_pull`): its next sent round."""
        return lambda out, parts, watch: FakeSentPull(self, worker, out)


class FakeSender:
    """The shard's side of ``--pull send`` (:class:`~hpcps.transport.sent.ParamSender`): a round is in each
    granted worker's queue at once, copied."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.announced = -1  # (no round released a piece at a time: the fabric's rounds go whole)

    def send(self, workers, params: np.ndarray, version: int, stop: bool, backoff=None) -> None:
        with self.fabric.lock:
            for w in workers:
                self.fabric.rounds[w].append((version, stop, params.copy()))

    def progress(self) -> None:
        pass

    def drain(self, backoff=None) -> None:
        pass


class FakeSentPull:
    """A worker's side (:class:`~hpcps.transport.sent.SentPull`): the next round sent to it."""

    def __init__(self, fabric: Fabric, worker: int, out: np.ndarray) -> None:
        self.fabric, self.worker, self.out = fabric, worker, out

    def test(self) -> bool:
        return bool(self.fabric.rounds[self.worker])

    def wait(self) -> tuple[np.ndarray, bool]:
        deadline = time.monotonic() + 10
        while not self.test():
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.worker}: no sent round came in 10 s")
            time.sleep(0.0005)
        with self.fabric.lock:
            version, stop, values = self.fabric.rounds[self.worker].popleft()
        self.out[:] = values
        return np.array([version], np.int64), stop


class FakePull:
    """A pull begun: the window's values at :meth:`wait` (a pull's data may be read up to its completion)."""

    def __init__(self, window: "FakeWindow", out: np.ndarray) -> None:
        self.window, self.out = window, out

    def test(self) -> bool:
        return True

    def wait(self) -> tuple[np.ndarray, bool]:
        return self.window.pull(self.out)


class FakeWindow:
    """:class:`~hpcps.runtime.parts.PullSource` for a worker, :class:`~hpcps.runtime.parts.PublishTarget`
    for the shard (``worker`` None)."""

    shard_ranks = [0]

    def __init__(self, fabric: Fabric, worker: int | None) -> None:
        self.fabric, self.worker = fabric, worker

    def publish(self, params: np.ndarray, version: int) -> bool:
        with self.fabric.lock:
            self.fabric.published[:] = params
            self.fabric.version = version
        return True

    def publish_held(self) -> bool:
        return True

    def set_stop(self) -> None:
        self.fabric.stop = True

    request_stop = set_stop

    def stop_raised(self) -> bool:
        return self.fabric.stop

    stop_once_published = stop_raised  # (a stop goes up at once here)

    def pull(self, out: np.ndarray, backoff=None, *, exact: bool = False) -> tuple[np.ndarray, bool]:
        with self.fabric.lock:
            out[:] = self.fabric.published
            self.fabric.pulls[self.worker] += 1
            return np.array([self.fabric.version], np.int64), self.fabric.stop

    def begin_pull(self, out: np.ndarray, backoff=None, **kw) -> FakePull:
        return FakePull(self, out)

    def peek(self, backoff=None) -> np.ndarray:
        with self.fabric.lock:
            return np.array([self.fabric.version], np.int64)


class FakePusher:
    """:class:`~hpcps.runtime.parts.PushSink`: a push arrives whole at once (its payload copied)."""

    shard_ranks = [0]
    fanout = None

    def __init__(self, fabric: Fabric, worker: int, buffer: np.ndarray) -> None:
        self.fabric, self.worker, self.buffers = fabric, worker, [buffer]

    def start(self, clock: int, versions: np.ndarray, lr: float, slot: int = 0, flags: int = 0) -> None:
        event = PushEvent(self.worker, clock, int(versions[0]), lr, flags)
        with self.fabric.lock:
            self.fabric.pushes.append((event, self.buffers[slot].copy()))
            self.fabric.sent.append((self.worker, clock, int(versions[0])))

    def test(self, slot: int | None = None) -> bool:
        return True

    def transfer(self, shard: int) -> None:
        pass  # (every push here arrives whole: no turn to stream)

    def start_done(self, clock: int) -> None:
        with self.fabric.lock:
            self.fabric.pushes.append((LeaveEvent(self.worker, clock), None))

    def test_done(self) -> bool:
        return True


class FakeNoticeBox:
    """:class:`~hpcps.runtime.parts.NoticeSource`: open until the shard's ``BYE``."""

    def __init__(self, fabric: Fabric, worker: int) -> None:
        self.fabric, self.worker, self.open = fabric, worker, 1

    def poll(self) -> list[Notice]:
        with self.fabric.lock:
            box = self.fabric.notices[self.worker]
            out = [box.popleft() for _ in range(len(box))]
        self.open -= sum(1 for n in out if n.flags & wire.BYE)
        return out


class FakeInbox:
    """:class:`~hpcps.runtime.parts.Inbox`: every push whole, held until released."""

    dead = None
    comm = None  # (verdicts and hyperparameters come over MPI: a push that needs them fails here)

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.worker_ranks = list(range(1, fabric.n_workers + 1))
        self.open = fabric.n_workers
        self.held: dict[int, np.ndarray] = {}
        self.backlog: dict[int, deque] = {}  # each worker's events not yet taken up
        self.transfers: list = []
        self.lost: set[int] = set()

    def poll(self) -> list:
        """The events come in order per worker, and a worker's next one only once its gradient in hand is
        released (as :class:`~hpcps.transport.push.PushInbox` takes headers: MPI keeps a sender's order)."""
        with self.fabric.lock:
            arrived = [self.fabric.pushes.popleft() for _ in range(len(self.fabric.pushes))]
        for event, payload in arrived:
            self.backlog.setdefault(event.worker, deque()).append((event, payload))
        events = []
        for worker, queue in self.backlog.items():
            while queue and worker not in self.held:
                event, payload = queue.popleft()
                if isinstance(event, PushEvent):
                    self.held[event.worker] = payload
                else:  # a leave, or (run-through) a death
                    if isinstance(event, LostEvent):
                        self.lost.add(event.worker)
                    self.open -= 1
                events.append(event)
        return events

    def gradient(self, worker: int) -> np.ndarray:
        return self.held[worker]

    def release(self, worker: int) -> None:
        self.held.pop(worker, None)

    free_buffer = release

    def offer(self) -> None:
        pass

    def payloads_coming(self) -> list[int]:
        return []

    def waiting_for_shard(self) -> list[int]:
        return []

    def unmatched(self, worker: int) -> str | None:
        return None

    def rejoin(self, worker: int, rank: int) -> None:
        """A spare (``rank``) takes dead ``worker``'s place: its pushes are that worker's, and it will leave."""
        self.lost.discard(worker)
        self.worker_ranks[worker] = rank
        self.open += 1


class FakeSpares:
    """A shard's spare desk (:class:`~hpcps.runtime.spares.SpareDesk`) with one spare, rank ``rank``: told of a
    death (``died``), it calls ``start(worker, clock)`` (the test starts the spare's worker there) and hands
    the shard the join at its next poll."""

    def __init__(self, rank: int, start) -> None:
        self.rank, self.start = rank, start
        self.joins: list[JoinEvent] = []
        self.deaths: list[tuple[int, int, int]] = []  # (worker, clock, rank)

    def died(self, worker: int, clock: int, rank: int, *, stopping: bool = False) -> None:
        self.deaths.append((worker, clock, rank))
        if not stopping and len(self.deaths) == 1:
            self.start(worker, clock)
            self.joins.append(JoinEvent(worker, self.rank, clock))

    def poll(self, lost, clocks, check=None) -> list[JoinEvent]:
        ready = [j for j in self.joins if lost(j.worker)]
        self.joins = [j for j in self.joins if j not in ready]
        return ready

    def pending(self) -> bool:
        return bool(self.joins)


class FakeNotifier:
    """:class:`~hpcps.runtime.parts.NoticeSink`: a notice is in the worker's box at once."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.worker_ranks = list(range(1, fabric.n_workers + 1))

    def send(self, worker: int, flags: int, clock: int = -1, version: int = -1, staleness: int = -1,
             lr: float = float("nan")) -> None:
        if self.worker_ranks[worker] in self.fabric.dead:
            return
        with self.fabric.lock:
            self.fabric.notices[worker].append(Notice(0, flags, clock, version, staleness, lr))

    def progress(self) -> None:
        pass

    def drain(self, backoff=None) -> None:
        pass


class Rows:
    """A recorder that keeps every row, by table."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tables: dict[str, list[tuple]] = {}
        self.t0 = time.perf_counter()

    def add(self, table: str, row: tuple) -> None:
        with self.lock:
            self.tables.setdefault(table, []).append(row)

    def tick(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def records(self) -> Records:
        return Records(self, clock=lambda: time.perf_counter() - self.t0)  # the run's clock starts at 0
