"""``hpcps check``'s measurements (the MPI mechanism; :mod:`hpcps.check.findings` decides what they mean).

Every function is collective over ``comm`` unless it says otherwise. Ranks that take no part in a
measurement wait in a polite barrier, so that on an oversubscribed node they leave the cores to the
ranks that measure.

* :func:`rank_facts`: the library, the thread level, the GPUs and CUDA-awareness of each rank.
* :func:`passive_progress`: a :class:`~hpcps.transport.window.ParamWindow` pull, the one hpcps's workers
  make, while the window's owner computes without calling MPI. Where passive-target RMA progresses on its
  own, the pulls complete meanwhile; elsewhere they wait until the owner enters MPI again.
* :func:`pair_path` and :func:`fan_in`: the bandwidth of a path (a stream of large messages, one way, then
  the other) and its latency (half a small round trip); and of every other node into one at once, which is
  what measures a node whose link is faster than each of its peers' (a server's).
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np
from mpi4py import MPI

from hpcps.box import node_label
from hpcps.cluster.device import detect_cuda_aware
from hpcps.check.findings import Link, Progress, RankFacts
from hpcps.transport.mpilib import implementation, library_version, query_cuda_support
from hpcps.transport.poll import Backoff, polite_barrier, wait_until
from hpcps.transport.window import ParamWindow

THREAD_LEVELS = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
                 MPI.THREAD_SERIALIZED: "SERIALIZED", MPI.THREAD_MULTIPLE: "MULTIPLE"}
_TAG = 0x5C  # the check's messages, on a communicator of its own


def rank_facts(comm: MPI.Comm) -> list[RankFacts]:
    """Every rank's :class:`RankFacts`, on every rank."""
    import torch

    gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else ()
    aware = detect_cuda_aware(MPI.Get_library_version(), os.environ, query_cuda_support())
    mine = RankFacts(rank=comm.rank, node=node_label(socket.gethostname()), library=library_version(),
                     implementation=implementation(), thread_level=THREAD_LEVELS.get(MPI.Query_thread(), "?"),
                     gpus=gpus, cuda_aware=aware.aware, cuda_why=aware.reason)
    return comm.allgather(mine)


def _busy(seconds: float) -> None:
    """Compute for ``seconds`` without calling MPI (numpy releases no lock MPI would need)."""
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = np.tanh(a @ a.T * 1e-3)


def passive_progress(comm: MPI.Comm, target: int, reader: int, *, same_node: bool, busy_s: float = 1.0,
                     n: int = 1 << 20) -> Progress | None:
    """Pulls of ``n`` floats by ``reader`` from ``target``'s window while ``target`` computes ``busy_s``
    seconds without MPI; on every rank, the :class:`Progress` (None if the two ranks are one). ``same_node``:
    whether the two share a node (as :func:`rank_facts` says)."""
    if target == reader:
        return None
    window = ParamWindow(comm, shard_ranks=[target], bounds=[(0, n)], local_len=n if comm.rank == target else 0)
    values = np.arange(n, dtype=np.float32)
    times: list[float] = []
    intact = True
    try:
        if comm.rank == target:
            window.publish(values, 1)
        polite_barrier(comm)
        if comm.rank == target:
            _busy(busy_s)  # no MPI call: whatever the reader gets meanwhile, it got without this rank's CPU
        elif comm.rank == reader:
            out = np.empty(n, np.float32)
            end = time.perf_counter() + 0.8 * busy_s
            while time.perf_counter() < end:
                t = time.perf_counter()
                versions, _ = window.pull(out, Backoff())
                times.append(time.perf_counter() - t)
                intact = intact and int(versions[0]) == 1 and bool(np.array_equal(out, values))
        polite_barrier(comm)
    finally:
        window.free()
    times, intact = comm.bcast((times, intact) if comm.rank == reader else None, root=reader)
    if not times:  # the first pull outlasted the whole computation
        times = [busy_s]
    return Progress(target=target, reader=reader, same_node=same_node, busy_s=busy_s,
                    slowest_pull_s=float(max(times)), median_pull_s=float(np.median(times)), intact=intact)


def _stream(comm: MPI.Comm, senders: list[int], dst: int, buf: np.ndarray, count: int) -> float:
    """``count`` messages of ``buf`` from each of ``senders`` to ``dst``, at once (only those ranks call);
    seconds, at ``dst``, from its start signals (zero-byte messages, once its receives are posted) to its
    last receive completed; 0 on the senders. The receives share one buffer, as the OSU bandwidth test's
    do: only the time is wanted."""
    backoff = Backoff(first=1e-6, cap=1e-4)
    if comm.rank == dst:
        reqs = [comm.Irecv(buf, source=s, tag=_TAG) for s in senders for _ in range(count)]
        for s in senders:
            comm.Send(b"", dest=s, tag=_TAG + 1)
        t = time.perf_counter()
        wait_until(lambda: MPI.Request.Testall(reqs), backoff)
        return time.perf_counter() - t
    comm.Recv(bytearray(0), source=dst, tag=_TAG + 1)
    reqs = [comm.Isend(buf, dest=dst, tag=_TAG) for _ in range(count)]
    wait_until(lambda: MPI.Request.Testall(reqs), backoff)
    return 0.0


def link_between_nodes(comm: MPI.Comm, nodes: list[int], *, seconds: float = 0.1,
                       chunk_bytes: int = 1 << 20) -> float:
    """Bits per second from rank 0 to the first rank on another node (``nodes[r]``: rank r's node; the job
    spans nodes), on every rank: what ``--pull auto`` and ``--partition-mb auto`` read (about half a second
    at 100 Mbit/s, a tenth at 1 Gbit/s, at start-up). One path stands for all: a cluster's nodes share one
    kind of link (``hpcps check`` measures each). Collective; the others wait."""
    other = next(r for r, n in enumerate(nodes) if n != nodes[0])
    probe = comm.Dup()  # its messages apart from the run's
    try:
        rate = None
        if probe.rank in (0, other):
            rate = _bandwidth(probe, 0, other, seconds=seconds, cap_bytes=64 << 20, chunk_bytes=chunk_bytes)
        polite_barrier(probe)
        return probe.bcast(rate, root=0)
    finally:
        probe.Free()


def _bandwidth(comm: MPI.Comm, src: int, dst: int, *, seconds: float, cap_bytes: int,
               chunk_bytes: int = 1 << 22) -> float:
    """Bits per second from ``src`` to ``dst`` (both call): messages of ``chunk_bytes``, as many as take
    about ``seconds`` at the rate a first short stream showed; the best of two."""
    chunk = np.zeros(chunk_bytes, np.uint8)
    first = _stream(comm, [src], dst, chunk, 2)
    rate = _exchange(comm, src, dst, chunk.nbytes * 2 / max(first, 1e-6) if comm.rank == dst else None)  # bytes/s
    count = int(max(2, min(cap_bytes // chunk.nbytes, rate * seconds // chunk.nbytes)))
    best = min(_stream(comm, [src], dst, chunk, count) or float("inf") for _ in range(2))
    return _exchange(comm, src, dst, count * chunk.nbytes * 8 / best if comm.rank == dst else None)


def _exchange(comm: MPI.Comm, src: int, dst: int, value):
    """``dst``'s ``value`` on ``src`` too (point to point: only the two take part)."""
    if comm.rank == dst:
        comm.send(value, dest=src, tag=_TAG + 2)
        return value
    return comm.recv(source=dst, tag=_TAG + 2)


def _latency(comm: MPI.Comm, a: int, b: int, rounds: int = 200) -> float:
    """Half the median round trip of an 8-byte message between ``a`` and ``b`` (both call)."""
    msg = np.zeros(1, np.float64)
    other = b if comm.rank == a else a
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        if comm.rank == a:
            comm.Send(msg, dest=other, tag=_TAG + 3)
            comm.Recv(msg, source=other, tag=_TAG + 3)
        else:
            comm.Recv(msg, source=other, tag=_TAG + 3)
            comm.Send(msg, dest=other, tag=_TAG + 3)
        times.append(time.perf_counter() - t)
    return float(np.median(times)) / 2


def pair_path(comm: MPI.Comm, a: int, b: int, names: tuple[str, str], *, seconds: float = 0.5,
              cap_bytes: int = 1 << 30) -> Link:
    """The path between ranks ``a`` and ``b``: the slower direction's bandwidth, and the latency; on every
    rank. The others wait."""
    link = None
    if comm.rank in (a, b):
        there = _bandwidth(comm, a, b, seconds=seconds, cap_bytes=cap_bytes)
        back = _bandwidth(comm, b, a, seconds=seconds, cap_bytes=cap_bytes)
        link = Link(names[0], names[1], min(there, back), _latency(comm, a, b))
    polite_barrier(comm)
    return comm.bcast(link, root=a)


def fan_in(comm: MPI.Comm, into: int, senders: list[int], name: str, *, seconds: float = 0.5,
           cap_bytes: int = 1 << 30) -> Link:
    """Every rank of ``senders`` streams into rank ``into`` at once, for about three times ``seconds`` (many
    streams take longer to settle than one): the bits per second it received; on every rank. Each sender
    sends the same number of bytes, sized from a first short round."""
    chunk = np.zeros(1 << 22, np.uint8)
    count = 2
    rate = None
    for _ in range(2):  # a short round sizes the measured one
        polite_barrier(comm)
        t = _stream(comm, senders, into, chunk, count) if comm.rank == into or comm.rank in senders else None
        rate = comm.bcast(len(senders) * count * chunk.nbytes * 8 / t if comm.rank == into else None, root=into)
        count = int(max(2, min(cap_bytes // (chunk.nbytes * len(senders)),
                               rate / 8 * 3 * seconds // (chunk.nbytes * len(senders)))))
    return Link("*", name, rate)
