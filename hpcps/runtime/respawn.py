"""``--respawn``: a process the job spawns after a worker's death takes the dead worker's place.

A spare (:mod:`hpcps.runtime.spares`) must be launched with the job: the RMA windows the pulls read and the
communicator the shards' inboxes listen on are formed once, collectively, over a fixed group, and a process
started later is outside them. ``--respawn`` forms them again, with the newcomer in:

1. A shard that finds a worker dead stops the run, as a stop signal would (:class:`DeathStop`): every living
   worker leaves after its current step, the shards apply every gradient that came whole, and the run writes
   its stop checkpoint. There the dead worker's clock is the gradients every shard received whole from it
   (the least over the shards: a gradient cut off between two shards is pushed again, and the shard that had
   it whole applies it twice; none is lost).
2. The living shrink the job's communicator and spawn one process per dead rank (``MPI_Comm_spawn`` over
   the survivors: under Open MPI 5 the one way a process started after a death can join, docs/running.md),
   merge with them and renumber, so that each newcomer holds a dead rank's number (:func:`grow`).
3. Every rank, the newcomers too, resumes the run from that checkpoint on the grown communicator: windows,
   inboxes and communicators formed afresh at the checkpoint's versions; the newcomer in the dead worker's
   place (its index, share of the data and clock, so it pushes exactly the gradients the dead one had not
   delivered). Faults (``--fault``) are not armed again. Each resumed part writes its own run file,
   ``<out>-respawn<K>.h5``, beside its checkpoints.

The living pay a stop and a start (the windows, the model on each rank, a barrier); the newcomer pays a
Python and torch start-up. What is not carried over: the dead worker's inner optimizer (``--local-steps``),
and the shards' paradigm counters where the checkpoint does not keep them, as in any resume.

Paradigms: those that take a spare (asp, ssp, dssp, eager), for the same reason
(:data:`hpcps.options.effects.REFUSALS`). Needs run-through (``mpirun --with-ft ulfm``): elsewhere a death
ends the job, and the run says so at the start.

How a newcomer ends: as the living do once they saw a death, without ``MPI_Finalize`` (``os._exit``). Open
MPI 5.0's would first wait at a barrier with every process a spawn connected it to that still shares a
communicator with it, the living, who never come (seen across nodes in the box: four such communicators
left, ``ompi_dpm_dyn_finalize`` waiting for good). Open MPI's launcher takes an end without it as a failure
of the spawned job unless every job of the launch is recoverable:
:data:`hpcps.cluster.launcher.ULFM_LAUNCH` (``--prtemca state_base_recoverable 1``), which docs/running.md
gives and ``hpcps emulate --ulfm`` passes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import replace
from typing import Callable, Sequence

from mpi4py import MPI

log = logging.getLogger("hpcps")

#: what ``/summary``'s ``stopped_by`` says of a run that a death stopped for a respawn
STOPPED_BY = "respawn"
#: the module a spawned process runs (``python -m``): :mod:`hpcps.runtime.newcomer`
NEWCOMER = "hpcps.runtime.newcomer"


class DeathStop:
    """A shard's answer to a worker's death under ``--respawn``: stop the run, so that it resumes with a
    process spawned in the dead worker's place. The calls of :class:`~hpcps.runtime.spares.SpareDesk` a shard
    makes (it takes a desk's place in the shard's loop). ``stop()`` raises every shard's stop flag; ``signals``:
    the rank's :class:`~hpcps.runtime.signals.StopSignals`, whose ``acted`` the run's end reads; ``rounds``:
    the pushes each worker makes (a dead worker that made them all needs no newcomer)."""

    def __init__(self, *, shard: int, stop: Callable[[], None], signals, rounds: int) -> None:
        self.shard, self.stop, self.signals, self.rounds = shard, stop, signals, rounds

    def died(self, worker: int, clock: int, rank: int, *, stopping: bool = False) -> None:
        """Worker ``worker`` (at ``rank``) died after ``clock`` gradients received whole here."""
        if clock >= self.rounds:
            return
        if self.signals.acted is None:
            self.signals.acted = STOPPED_BY
            log.warning("shard %d: worker rank %d died after its gradient %d: stopping the run at a checkpoint, "
                        "to resume it with a process spawned in its place (--respawn)", self.shard, rank, clock)
        self.stop()

    def poll(self, lost, clocks, check=None) -> list:
        return []  # nobody joins this run: the next one takes the newcomer in

    def pending(self) -> bool:
        return False

    def close(self, backoff) -> None:
        pass


def grow(shrunk: MPI.Comm, before: MPI.Comm, gone: Sequence[int]) -> MPI.Comm:
    """Collective over the living (``shrunk``, the shrink of ``before``): spawn a process for each rank of
    ``before`` in ``gone`` and return a communicator of ``before``'s size in which each holds that rank's
    number and every living rank its own. The newcomers run :func:`hpcps.runtime.newcomer.join`."""
    inter = shrunk.Spawn(sys.executable, ["-m", NEWCOMER], maxprocs=len(gone), root=0)
    merged = inter.Merge(high=False)
    inter.Free()
    merged.bcast(list(gone), root=0)
    return _renumbered(merged, before.rank)


def joined() -> tuple[MPI.Comm, int]:
    """A spawned process: the grown communicator (:func:`grow`'s other side) and the dead rank it takes."""
    parent = MPI.Comm.Get_parent()
    merged = parent.Merge(high=True)
    parent.Free()
    gone = merged.bcast(None, root=0)
    mine = gone[merged.rank - (merged.size - len(gone))]
    return _renumbered(merged, mine), mine


def _renumbered(merged: MPI.Comm, rank: int) -> MPI.Comm:
    """Collective over the living and the newcomers (``merged``, which it frees): the grown job, each process at
    ``rank``, its number in the job before the death; errors returned, as run-through needs."""
    grown = merged.Split(0, rank)
    merged.Free()
    grown.Set_errhandler(MPI.ERRORS_RETURN)
    return grown


def resumed(cfg, checkpoint: str, n_servers: int, part: int, first_out: str):
    """``cfg`` for the ``part``-th resumed part: from ``checkpoint``, on its ``n_servers`` shards (the newcomer
    may sit on another node, and ``--servers auto`` would count again), faults not armed again, its run file
    ``<first_out>-respawn<part>.h5`` and its checkpoints where the first part's were."""
    from hpcps.runtime.checkpoints.schedule import checkpoint_dir

    stem, ext = os.path.splitext(first_out)
    return cfg.model_copy(update={"resume": checkpoint, "fault": [], "servers": n_servers,
                                  "out": f"{stem}-respawn{part}{ext or '.h5'}",
                                  "checkpoint_dir": checkpoint_dir(cfg, first_out)})


def respawning(train: Callable):
    """``train(cfg, comm)`` (a run; its result on rank 0), run again on a grown communicator each time a death
    stopped it under ``--respawn`` (see the module's docstring). Collective; the result of the last part.
    Each resumed part's run file says (attribute ``respawn``, JSON) which ranks were spawned and the wall
    times of the spawn's call and of the grown job's forming, against the file's ``clock_start``; the last
    part's result names the earlier parts' files (``earlier``)."""

    def run(cfg, comm: MPI.Comm, *, part: int = 0, first_out: str | None = None, leg=None):
        """``part``, ``first_out``: a newcomer's, which joins at that part of a run whose first part wrote
        ``first_out`` (each later part's file and checkpoints are named from it); ``leg``: the first part's
        (:class:`hpcps.runtime.plan.Leg`: ``--paradigm auto``'s run going on from its trials)."""
        from hpcps.transport.failures import left_out, part_ways, ulfm_enabled

        result, earlier = train(cfg, comm, leg=leg), []
        while cfg.respawn and ulfm_enabled():
            shrunk = comm.Shrink()
            gone = sorted(left_out(comm, shrunk))
            said = _what_stopped(result) if shrunk.rank == 0 else None
            stopped_by, checkpoint, path, n_servers = shrunk.bcast(said, root=0)
            first_out = first_out or path
            if stopped_by != STOPPED_BY or not gone:
                # every rank ends after this without MPI_Finalize: not before every other has the broadcast (a
                # root that sent and ended made a receive fail, MPI_ERR_PROC_FAILED: a spawned rank's in CI)
                part_ways(shrunk, _watch(cfg, "the others to take the run's end", shrunk.rank))
                shrunk.Free()
                return replace(result, earlier=tuple(earlier)) if result is not None and earlier else result
            part += 1
            earlier.append(path)
            if shrunk.rank == 0:
                log.warning("rank(s) %s died: spawning %d process(es) in their place; the run resumes from %s",
                            ", ".join(map(str, gone)), len(gone), checkpoint)
            spawned = time.time()
            comm = grow(shrunk, comm, gone)
            shrunk.Free()
            formed = time.time()
            cfg = resumed(cfg, checkpoint, n_servers, part, first_out)
            comm.bcast((cfg, part, first_out), root=0)
            meet(comm, cfg, "the spawned process(es) starting")
            if comm.rank == 0:
                log.info("the job is whole again %.2f s after the spawn's call, %.2f s with the newcomers started: "
                         "part %d of the run writes %s", formed - spawned, time.time() - spawned, part + 1, cfg.out)
            result = train(cfg, comm)
            if comm.rank == 0:
                _note(result.path, {"ranks": gone, "spawned": spawned, "formed": formed, "from": checkpoint})
        return result

    return run


def meet(comm: MPI.Comm, cfg, what: str) -> None:
    """Collective over the grown job: every rank here, waited for politely. The living wait here while a
    newcomer starts Python and torch; the run's first collectives spin, and on a node the living share with
    it they would take its CPU (seen in the box: its start-up 3x as long). A newcomer that never comes ends
    the job after ``--stall-abort``, saying so."""
    from hpcps.transport.poll import Backoff, polite_barrier

    polite_barrier(comm, Backoff(cap=0.01), _watch(cfg, what, comm.rank))


def _watch(cfg, what: str, rank: int):
    """The stall watch of a wait of this module's: warned of after ``--stall-warn``, ended after
    ``--stall-abort``."""
    from hpcps.errors import RunAborted
    from hpcps.transport.poll import StallWatch

    return StallWatch(warn=cfg.stall_warn, abort=cfg.stall_limit, log=log, error=RunAborted,
                      describe=lambda: f"rank {rank} waiting for {what}")


def _note(path: str, what: dict) -> None:
    """Rank 0: what a resumed part's respawn was, into its run file (attribute ``respawn``)."""
    import h5py

    with h5py.File(path, "a") as f:
        f.attrs["respawn"] = json.dumps(what)


def _what_stopped(result) -> tuple:
    """Rank 0, after a part: what stopped it, its checkpoint, its run file and the shards' count."""
    import h5py

    stopped_by, checkpoint = result.summary.get("stopped_by", ""), result.summary.get("checkpoint", "")
    n_servers = 0
    if stopped_by == STOPPED_BY and checkpoint:
        with h5py.File(checkpoint, "r") as f:
            n_servers = int(f.attrs["n_servers"])
    return stopped_by, checkpoint, result.path, n_servers
