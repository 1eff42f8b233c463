"""The parameter window: pulls never tear, and stay fast while the server is busy (both protocols)."""

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpitest import share
from hpcps.layout import shard_bounds
from hpcps.server import apply_update
from hpcps.transport.poll import Backoff, polite_barrier
from hpcps.transport.window import ParamWindow

pytestmark = pytest.mark.mpi(min_size=5)


@pytest.mark.parametrize("protocol", ["seqlock", "locked"])
def test_pulls_never_return_a_torn_snapshot(world, protocol):
    """Shards 0 and 1 publish version v as a block of v's as fast as they can; 3 readers check every pull."""
    n, shards, pulls = 1 << 18, [0, 1], 200
    bounds = shard_bounds(n, 2)
    is_server = world.rank in shards
    lo, hi = bounds[world.rank] if is_server else (0, 0)
    window = ParamWindow(world, shard_ranks=shards, bounds=bounds, local_len=hi - lo, protocol=protocol)
    bad, seen = 0, set()
    if is_server:
        block = np.zeros(hi - lo, np.float32)
        window.publish(block, 0)
    world.Barrier()
    done = None
    if is_server:
        done, v = world.Ibarrier(), 0
        while not done.Test():
            v += 1
            block.fill(v)
            window.publish(block, v)
        seen.add(v)
    else:
        out = np.empty(n, np.float32)
        for _ in range(pulls):
            versions, _ = window.pull(out)
            for s, (a, b) in enumerate(bounds):
                bad += int(not np.all(out[a:b] == versions[s]))
                seen.add(int(versions[s]))
        polite_barrier(world)
    window.free()
    facts = share(world, {"bad": world.reduce(bad, root=0),
                          "distinct": world.reduce(len(seen), root=0)})
    assert facts["bad"] == 0
    assert facts["distinct"] > 10  # the readers really raced the publisher


def _pull_latency(comm, protocol: str, monolithic: bool, n_busy: int = 1 << 23, pulls: int = 40) -> float | None:
    """Rank 0 publishes, then applies big updates back to back; rank 1 times small pulls (median, s)."""
    bounds = [(0, 1024)]
    window = ParamWindow(comm, shard_ranks=[0], bounds=bounds, local_len=1024 if comm.rank == 0 else 0,
                         protocol=protocol)
    median = None
    if comm.rank == 0:
        window.publish(np.zeros(1024, np.float32), 0)
        master, grad = torch.zeros(n_busy), torch.ones(n_busy)
        comm.Barrier()
        done = comm.Ibarrier()
        poke = lambda: comm.Iprobe(source=MPI.ANY_SOURCE, tag=99)  # noqa: E731
        while not done.Test():
            apply_update(master, [grad], [1e-6], progress=poke, chunk=n_busy if monolithic else 1 << 18)
    elif comm.rank == 1:
        out = np.empty(1024, np.float32)
        comm.Barrier()
        times = []
        for _ in range(pulls):
            t = time.perf_counter()
            window.pull(out, Backoff())
            times.append(time.perf_counter() - t)
            time.sleep(0.002)
        median = float(np.median(times))
        polite_barrier(comm)
    window.free()
    return median


def test_pulls_stay_fast_while_the_server_applies_updates(world):
    """Seqlock pulls need nothing from the server's CPU; locked ones need it inside MPI, hence the chunked apply.

    Under ``locked``, one monolithic apply (no MPI call inside) holds pulls
    up and the chunked apply with progress pokes does not; under
    ``seqlock`` even the monolithic apply does not hold pulls up.
    """
    pair = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)
    results = None
    if pair != MPI.COMM_NULL:
        results = {(protocol, monolithic): _pull_latency(pair, protocol, monolithic)
                   for protocol in ("locked", "seqlock") for monolithic in (False, True)}
        pair.Free()
    polite_barrier(world)  # idle ranks must not spin in a blocking collective meanwhile
    t = world.bcast(results, root=1)
    print("median pull while busy (ms): " + ", ".join(
        f"{p} {'monolithic' if m else 'chunked'} {v * 1e3:.3f}" for (p, m), v in t.items()))
    assert t["locked", False] * 3 < t["locked", True]
    assert t["seqlock", True] * 3 < t["locked", True]
