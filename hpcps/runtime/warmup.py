"""The warm-up that ``--group-by speed`` (``--groups auto``) forms its groups from.

Before the topology is built, every worker times a few real gradient passes
on its own batches, with the emulated compute time (``--compute-time``,
``--slowdown``, ``--jitter``) on top exactly as in training; the gradients
are thrown away and the parameters are not touched. The median time per
pass of every worker is gathered on every rank, so all ranks compute the
same groups (:func:`hpcps.cluster.grouping.speed_groups`) without another message.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

from hpcps.data.batches import BatchSource, to_device
from hpcps.cluster.emulation import ComputeTime, end_pass
from hpcps.training.flat import FlatParameters
from hpcps.transport.poll import Backoff, wait_until

#: timed passes per worker (the first also pays for warming caches, hence the median)
WARMUP_PASSES = 5


def measure_pass_time(model: torch.nn.Module, flat: FlatParameters, batches: BatchSource, loss: Callable, *,
                      rank: int, seed: int, compute_time: ComputeTime, passes: int = WARMUP_PASSES) -> float:
    """Median seconds per gradient pass of this worker, emulated compute time included.

    What the passes do to the model's buffers (BatchNorm statistics) does not
    last: every worker starts training with a pull, which brings the servers' buffers.
    """
    rng = np.random.default_rng([seed, rank, 11])
    times = []
    for step in range(passes):
        batch = to_device(batches.batch(step), flat.device)
        started = time.perf_counter()
        flat.begin_pass()
        loss(model, batch).backward()
        times.append(end_pass(flat, started, compute_time, rng))
    flat.zero_grad()
    return float(np.median(times))


def gather_pass_times(comm: MPI.Comm, mine: float | None, backoff: Backoff | None = None) -> dict[int, float]:
    """Collective: every worker's measured time, by rank (non-workers pass None).

    Polls a nonblocking allgather: ranks that wait must not spin on the cores
    the workers are timing themselves on.
    """
    send = np.array([np.nan if mine is None else mine], np.float64)
    recv = np.empty(comm.size, np.float64)
    request = comm.Iallgather(send, recv)
    wait_until(request.Test, backoff)
    return {rank: float(t) for rank, t in enumerate(recv) if not np.isnan(t)}
