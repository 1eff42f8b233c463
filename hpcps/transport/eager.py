"""Eager pulls: keep the newest parameters arriving behind the worker's computation.

A helper thread (mpi4py initialises MPI with ``MPI_THREAD_MULTIPLE``) pulls
when the worker asks (:meth:`EagerPuller.request`, when it starts
computing) and, until the worker takes the snapshot, keeps it fresh.

*Just in time.* The worker says how long it expects to compute; the helper
starts the pull that much later, less twice the recent pull duration and a
margin, so one transfer per iteration lands just before the worker needs it
and brings the newest version there is then. (Pulling at once and again on
every new version would bring the same freshness only at many times the
transfers, which on a busy node costs the worker its CPU and memory
bandwidth.) While time is left before the expected end, or once the worker
:meth:`hurry`-s (it finished computing, or needs fresher parameters), the
helper reads the shards' version headers with a backoff and pulls again as
soon as a shard has published a version newer than the one staged.

Each pull is the window's ordinary ``pull``, so under the ``locked`` window
protocol the shared locks are held only for a transfer, never across the
caller's compute. The newest versions the helper has seen (:meth:`latest`)
let the worker bound how far behind the staged snapshot may be.

Two staging buffers: the helper writes the one that is not *ready* and
swaps them under a lock when a pull completes; :meth:`take` hands the ready
one over under the same lock, so a snapshot is never torn: by a pointer swap
(the worker's parameter array takes its place among the staging buffers, no
byte copied) where the worker gives a ``swap``, else by one copy at memory
bandwidth.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from hpcps.transport.poll import Backoff
from hpcps.transport.window import ParamWindow


#: seconds between the helper's pull landing and the worker's expected take (thread wake-up, jitter)
JIT_MARGIN = 5e-4


class EagerPuller:
    """Call :meth:`close` before the window is freed."""

    def __init__(self, window: ParamWindow, size: int, *, refresh_cap: float = 2e-3) -> None:
        self.window = window
        self.staging = [np.empty(size, np.float32), np.empty(size, np.float32)]
        n = len(window.shard_ranks)
        self._meta = [(np.full(n, -1, np.int64), False, 0.0), (np.full(n, -1, np.int64), False, 0.0)]
        self._ready = -1  # index of the staged snapshot, -1: none yet
        self._generation = 0  # requests so far: a pull counts as fresh only for the request it began under
        self._latest = np.zeros(n, np.int64)  # newest versions seen by a peek or a pull
        self._lock = threading.Lock()
        self._wanted = threading.Event()  # the worker wants fresh parameters
        self._arrived = threading.Event()  # a snapshot is staged
        self._closing = False
        self._error: BaseException | None = None
        self.pulls = 0
        self._refresh = Backoff(first=1e-4, cap=refresh_cap)
        self._hurry = threading.Event()  # the worker is waiting: pull (again) now, whatever the schedule
        self._begun = threading.Event()  # the pull for the current request has begun (or is scheduled later)
        self._start_at = self._due = 0.0  # perf_counter times: first pull of this request; expected take
        self.pull_s = 0.0  # running average of a pull's duration
        self._thread = threading.Thread(target=self._run, name="hpcps-eager-pull", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = Backoff()
        try:
            while True:
                self._wanted.wait()
                if self._closing:
                    return
                if not self._arrived.is_set():
                    delay = self._start_at - time.perf_counter()
                    if delay > 0:
                        self._begun.set()  # not now: the worker's push goes first
                        self._hurry.wait(delay)  # close() hurries too; the check below then ends the loop
                elif self._hurry.is_set() or time.perf_counter() + self.pull_s < self._due:
                    if not self._newer_published(backoff):
                        self._refresh.pause()
                        continue
                else:  # staged, and no time for another pull before the worker takes: idle
                    self._hurry.wait(self._refresh.cap)
                    continue
                if self._closing or not self._wanted.is_set():
                    continue
                self._refresh.reset()
                target = 1 - self._ready if self._ready >= 0 else 0
                generation = self._generation
                t = time.perf_counter()
                pull = self.window.begin_pull(self.staging[target], backoff)
                if generation == self._generation:
                    self._begun.set()  # its requests are on the wire: the worker's push may follow them
                versions, stop = pull.wait()
                took = time.perf_counter() - t
                self.pull_s = took if self.pulls == 0 else 0.7 * self.pull_s + 0.3 * took
                with self._lock:
                    np.maximum(self._latest, versions, out=self._latest)
                    self._meta[target] = (versions, stop, took)
                    self._ready = target
                    self.pulls += 1
                    # else it began before the request: pull again. (Under the lock, as request() clears it:
                    # checked outside, a request between the check and the set left it set for a pull begun
                    # before that request.)
                    if generation == self._generation:
                        self._arrived.set()
        except BaseException as exc:  # surfaced to the caller by take()
            self._error = exc
            self._arrived.set()
            self._begun.set()

    def _newer_published(self, backoff: Backoff) -> bool:
        staged = self._meta[self._ready][0]
        published = self.window.peek(backoff)
        with self._lock:
            np.maximum(self._latest, published, out=self._latest)
        return bool((published > staged).any())

    def request(self, expected: float = 0.0) -> None:
        """Fetch the newest parameters for a take expected in ``expected`` seconds; keep them fresh until then."""
        now = time.perf_counter()
        with self._lock:
            self._generation += 1
            self._arrived.clear()
        self._due = now + expected
        self._start_at = now + max(0.0, expected - 2.0 * self.pull_s - JIT_MARGIN)
        self._hurry.clear()
        self._begun.clear()
        self._wanted.set()

    def begun(self) -> bool:
        """The pull for the last :meth:`request` has put its requests on the wire, or is scheduled for
        later (just in time). A push started after this does not hold the pull up on a TCP link, where
        a rank's messages to one peer leave in order."""
        if self._error is not None:
            raise self._error
        return self._begun.is_set()

    def hurry(self) -> None:
        """The worker is waiting: start the pull now if it has not started, refresh whenever newer is published."""
        self._hurry.set()

    def ready(self) -> bool:
        """A snapshot is staged; raises the helper thread's error if it died (a waiting worker then ends
        with it, instead of waiting for a snapshot that never comes)."""
        if self._error is not None:
            raise self._error
        return self._arrived.is_set()

    def latest(self) -> np.ndarray:
        """The newest version of every shard the helper has seen published (a copy)."""
        with self._lock:
            return self._latest.copy()

    def staged(self) -> np.ndarray:
        """The versions of the staged snapshot (valid once :meth:`ready`)."""
        with self._lock:
            return self._meta[self._ready][0].copy()

    def take(self, out: np.ndarray | None = None, *,
             swap: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[np.ndarray, bool, float]:
        """Hand the freshest staged snapshot over: ``swap(snapshot)`` installs the array itself and returns
        the one it replaces, which becomes a staging buffer (no copy); or it is copied into ``out``.
        Return (versions, stop flag, last pull's duration).

        A snapshot is taken once: :meth:`ready` is False after it until a pull for the next :meth:`request`
        lands. (It stayed True: a second take without a request between swapped back in the array the worker
        held before the first, labelled with the first's versions.)"""
        if self._error is not None:
            raise self._error
        if not self._arrived.is_set():
            raise RuntimeError("take() before a pull completed")
        with self._lock:
            self._wanted.clear()
            self._arrived.clear()
            versions, stop, duration = self._meta[self._ready]
            if swap is not None:  # the helper writes only the other buffer: this one is the worker's now
                self.staging[self._ready] = swap(self.staging[self._ready])
            else:
                np.copyto(out, self.staging[self._ready])
        return versions.copy(), stop, duration

    def close(self) -> None:
        """End the helper thread (after the pull or peek it may be in)."""
        if self._thread.is_alive():
            self._closing = True
            self._hurry.set()
            self._wanted.set()
            self._thread.join()
