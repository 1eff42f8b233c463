"""A worker's side of the local-SGD family: H inner steps, then the round's pseudo-gradient (no MPI).

Under ``--local-steps H`` (and the presets ``localsgd`` and ``diloco``) a
worker's ``ps.step()`` does not push every gradient: it steps the worker's own
*inner* optimizer (``--inner-optimizer``, ``--inner-lr``: torch.optim over
the model's parameters, its state the worker's alone), and every H steps it
pushes the change of its parameters over the round,

    pseudo-gradient = parameters at the round's start - parameters now,

in the place of a gradient (so compression, partitions and every paradigm's
accounting carry it unchanged). The shards apply it with their optimizer,
which is the *outer* optimizer: at rate 1 without momentum the new
parameters are the workers' mean (local SGD), with Nesterov sgd it is
DiLoCo's outer step. The model's float buffers (BatchNorm's statistics) go
as their change over the round, which the shards add as they add a pass's.

The worker's clock counts rounds: a run of ``--steps S`` takes ``ceil(S/H)``
rounds, the last one shorter where H does not divide S, and batch ``k`` of
the data feeds inner step ``k`` as without local steps. With
``--local-steps-by-speed`` the workers time their first round (:func:`seconds_per_step`) and each takes
its own share of H per round from then on (:func:`steps_by_speed`).

With ``--overlap-steps T`` (Streaming DiLoCo's overlap, Douillard et al.
2025) the outer step is hidden behind computation: a worker pushes its
round and goes on at once with the next round's first T steps, on its own
parameters (those it pushed, ``p``); the round closes and its new global
parameters ``g`` come meanwhile (under bsp the worker waits for its grant
only then). After those T steps it *rebases*: its parameters become
``g + (now - p)``, the new global ones with the change of the T steps on
top, and the round's anchor is ``g``, so the round's pseudo-gradient is
still against the global parameters it builds on (:meth:`LocalSteps.rebase`).
With one worker and outer sgd at rate 1, ``g = p`` and the run is the
plain local loop, as without overlap.

The inner optimizer's state is checkpointed by each worker (one file per
worker and round: :class:`InnerFiles`) and taken back when a run resumes at
that round.
"""

from __future__ import annotations

import glob
import os
import re

import numpy as np
import torch

from hpcps.training.optim import OptimizerFactory


class LocalSteps:
    """H inner steps with the worker's own optimizer, then the pseudo-gradient into the flat gradient buffer.

    ``flat`` is the model's :class:`~hpcps.training.flat.FlatParameters`; ``make_optimizer`` builds the
    inner optimizer over the model's trainable parameters (views into the flat buffer, so the inner step
    writes there); ``every``: H; ``steps``: the run's inner steps per worker (the last round ends there).
    """

    def __init__(self, model: torch.nn.Module, flat, make_optimizer: OptimizerFactory, *, every: int,
                 steps: int) -> None:
        if every < 1:
            raise ValueError("local steps: H must be at least 1")
        self.flat, self.every, self.steps = flat, every, steps
        self.optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
        self.anchor = flat.values().detach().clone()  # the parameters and buffers the round started from
        self.taken = 0  # inner steps taken in the round under way
        self.own = every  # this worker's steps per round: fewer for a slow worker (:func:`steps_by_speed`)
        self.pushed: np.ndarray | None = None  # --overlap-steps: the parameters pushed, until the rebase

    def begin_round(self, pulled: bool = True) -> None:
        """A round begins: from the pull that has landed in the model (``pulled``), which is its anchor;
        or, under overlap, from the parameters just pushed, the anchor to come with the rebase."""
        if pulled:
            self.anchor.copy_(self.flat.values())
        self.taken = 0

    def mark_pushed(self) -> None:
        """Under overlap: the round's pseudo-gradient is about to go; keep the parameters it leaves at (host
        memory: a copy, as the model's own go on changing)."""
        self.pushed = self.flat.values().detach().cpu().numpy().copy()

    def rebase(self, pulled: np.ndarray, moved: bool = True) -> None:
        """Under overlap: the global parameters ``pulled`` (host, the whole flat vector) after the round last
        pushed. The model's parameters and float buffers become ``pulled + (now - pushed)``; the anchor of
        the round under way becomes ``pulled``. ``pulled`` is written (it holds the result). ``moved``
        False: no step was taken since the push (the run's end), so the model takes ``pulled`` as it is."""
        flat = self.flat
        self.anchor.copy_(torch.from_numpy(pulled))
        if moved:
            now = flat.values().detach().cpu().numpy()  # (on the CPU a view of the model's own memory)
            pulled += now
            pulled -= self.pushed
        flat.params[:] = pulled
        flat.upload()
        self.pushed = None

    def inner_step(self, skip: bool = False) -> None:
        """Step the inner optimizer on the gradient backward left (not for a ``skip``ped step)."""
        if not skip:
            self.optimizer.step()
        self.taken += 1

    def round_over(self, round_index: int) -> bool:
        """Whether the round ``round_index`` (0-based) has taken all its inner steps."""
        return self.taken >= self.own or round_index * self.every + self.taken >= self.steps

    def pseudo_gradient(self) -> None:
        """The round's change into the flat gradient buffer: ``anchor - parameters`` for the trainable
        parameters (a step's direction, as a gradient's), ``buffers - anchor`` for the float buffers (their
        change, as a pass records it: :meth:`hpcps.training.flat.FlatParameters.end_pass`)."""
        flat, n = self.flat, self.flat.n_params
        with torch.no_grad():
            now = flat.values()
            torch.sub(self.anchor[:n], now[:n], out=flat.grads_t[:n])
            if flat.size > n:
                torch.sub(now[n:], self.anchor[n:], out=flat.grads_t[n:])


def seconds_per_step(steps: list[float]) -> float:
    """A worker's seconds per step from the computation times of its first round's ``steps``: the median of
    all but the first, which also pays for warming up (caches, allocators, and on a GPU the libraries'
    first calls: far longer than a step), or the only one there is."""
    return float(np.median(steps[1:] if len(steps) > 1 else steps))


def steps_by_speed(every: int, seconds: list[float]) -> list[int]:
    """Dynamic local updates (Liu et al. 2024): each worker's steps per round from the seconds one of its
    steps takes, ``every`` for the fastest and in proportion fewer for the others (at least 1), so that the
    workers' rounds take about as long. Batch ``k`` of a round still feeds step ``k``: a slow worker leaves
    the rest of its round's batches unused."""
    fastest = min(seconds)
    return [max(1, min(every, round(every * fastest / s))) if s > 0 else every for s in seconds]


class InnerFiles:
    """Where each worker's inner optimizer state goes in a checkpoint directory: ``inner/worker-W.round-R.pt``,
    the state after round R (the worker's clock once that round is pushed), written before the push, so it is
    on disk before any checkpoint that counts the round can be complete."""

    PATTERN = re.compile(r"worker-(\d+)\.round-(\d+)\.pt$")

    def __init__(self, directory: str, worker: int) -> None:
        self.directory, self.worker = os.path.join(directory, "inner"), worker

    def path(self, clock: int) -> str:
        return os.path.join(self.directory, f"worker-{self.worker}.round-{clock}.pt")

    def write(self, clock: int, state: dict) -> str:
        """Write atomically (a temporary file, then a rename); return the file."""
        os.makedirs(self.directory, exist_ok=True)
        path = self.path(clock)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        return path

    def read(self, clock: int) -> dict | None:
        """The state after round ``clock``, or None where no file holds it."""
        path = self.path(clock)
        return torch.load(path, weights_only=True) if os.path.exists(path) else None

    def prune(self, keep_from: int) -> None:
        """Remove this worker's files of rounds before ``keep_from`` (no checkpoint resumes there any more)."""
        for path in glob.glob(os.path.join(self.directory, f"worker-{self.worker}.round-*.pt")):
            found = self.PATTERN.search(path)
            if found and int(found.group(2)) < keep_from:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
