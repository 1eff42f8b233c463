"""The warm-up that ``--group-by speed`` (``--groups auto``) forms its groups from.

Before the topology is built, every worker times a few real gradient passes
on its own batches, with the emulated compute time (``--compute-time``,
``--slowdown``, ``--jitter``) on top exactly as in training; the gradients
are thrown away and the parameters are not touched. The median time per
pass of every worker is gathered on every rank, so all ranks compute the
same groups (:func:`hpcps.grouping.speed_groups`) without another message.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from hpcps.data import Dataset, batch_indices
from hpcps.emulation import ComputeTime
from hpcps.flat import FlatParameters
from hpcps.transport.poll import Backoff, wait_until
from hpcps.worker import emulated_pass

#: timed passes per worker (the first also pays for warming caches, hence the median)
WARMUP_PASSES = 5


def measure_pass_time(model: torch.nn.Module, flat: FlatParameters, data: Dataset, *, rank: int, index: int,
                      n_workers: int, batch_size: int, seed: int, compute_time: ComputeTime,
                      passes: int = WARMUP_PASSES) -> float:
    """Median seconds per gradient pass of this worker, emulated compute time included."""
    x, y = torch.from_numpy(data.x_train).to(flat.device), torch.from_numpy(data.y_train).to(flat.device)
    rng = np.random.default_rng([seed, rank, 11])
    times = []
    for step in range(passes):
        idx = torch.from_numpy(batch_indices(len(y), batch_size=batch_size, n_workers=n_workers, worker=index,
                                             step=step, seed=seed)).to(flat.device)
        times.append(emulated_pass(model, flat, x[idx], y[idx], compute_time, rng)[1])
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
