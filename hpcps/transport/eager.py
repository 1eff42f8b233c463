"""Eager pulls: keep the newest parameters arriving behind the worker's computation.

A helper thread (mpi4py initialises MPI with ``MPI_THREAD_MULTIPLE``) starts
pulling when the worker asks (:meth:`EagerPuller.request`, when it starts
computing) and, until the worker takes the snapshot, keeps it fresh: it reads
the shards' version headers with a backoff and pulls again as soon as a
shard has published a version newer than the one staged. Each pull is the
window's ordinary locked ``Rget``, so the shared locks are held only for a
transfer, never across the caller's compute, and the server's exclusive-lock
publishes are not held up by a worker's forward/backward.

Two staging buffers: the helper writes the one that is not *ready* and
swaps them under a lock when a pull completes; :meth:`take` copies the ready
one out under the same lock (one copy at memory bandwidth), so a snapshot is
never torn.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from hpcps.transport.poll import Backoff
from hpcps.transport.window import ParamWindow


class EagerPuller:
    """Call :meth:`close` before the window is freed."""

    def __init__(self, window: ParamWindow, size: int, *, refresh_cap: float = 2e-3) -> None:
        self.window = window
        self.staging = [np.empty(size, np.float32), np.empty(size, np.float32)]
        n = len(window.shard_ranks)
        self._meta = [(np.full(n, -1, np.int64), False, 0.0), (np.full(n, -1, np.int64), False, 0.0)]
        self._ready = -1  # index of the staged snapshot, -1: none yet
        self._lock = threading.Lock()
        self._wanted = threading.Event()  # the worker wants fresh parameters
        self._arrived = threading.Event()  # a snapshot is staged
        self._closing = False
        self._error: BaseException | None = None
        self.pulls = 0
        self._refresh = Backoff(first=1e-4, cap=refresh_cap)
        self._thread = threading.Thread(target=self._run, name="hpcps-eager-pull", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = Backoff()
        try:
            while True:
                self._wanted.wait()
                if self._closing:
                    return
                if self._arrived.is_set() and not self._newer_published(backoff):
                    self._refresh.pause()
                    continue
                self._refresh.reset()
                target = 1 - self._ready if self._ready >= 0 else 0
                t = time.perf_counter()
                versions, stop = self.window.pull(self.staging[target], backoff)
                with self._lock:
                    self._meta[target] = (versions, stop, time.perf_counter() - t)
                    self._ready = target
                    self.pulls += 1
                self._arrived.set()
        except BaseException as exc:  # surfaced to the caller by take()
            self._error = exc
            self._arrived.set()

    def _newer_published(self, backoff: Backoff) -> bool:
        staged = self._meta[self._ready][0]
        return bool((self.window.peek(backoff) > staged).any())

    def request(self) -> None:
        """Start fetching the newest parameters, and keep them fresh until :meth:`take`."""
        self._arrived.clear()
        self._wanted.set()

    def ready(self) -> bool:
        return self._arrived.is_set()

    def take(self, out: np.ndarray) -> tuple[np.ndarray, bool, float]:
        """Copy the freshest staged snapshot into ``out``; return (versions, stop flag, last pull's duration)."""
        if self._error is not None:
            raise self._error
        if not self._arrived.is_set():
            raise RuntimeError("take() before a pull completed")
        with self._lock:
            self._wanted.clear()
            versions, stop, duration = self._meta[self._ready]
            np.copyto(out, self.staging[self._ready])
        return versions.copy(), stop, duration

    def close(self) -> None:
        """End the helper thread (after the pull or peek it may be in)."""
        if self._thread.is_alive():
            self._closing = True
            self._wanted.set()
            self._thread.join()
