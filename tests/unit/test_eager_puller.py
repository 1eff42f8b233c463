"""The eager helper thread (no MPI: a fake window)."""

import threading

import numpy as np
import pytest

from hpcps.transport.eager import EagerPuller
from hpcps.transport.poll import wait_until


class _Done:
    """A begun pull whose result is already known (the fakes' ParamWindow.Pull)."""

    def __init__(self, result, finish=None):
        self.result, self.finish = result, finish

    def wait(self):
        return self.finish() if self.finish else self.result


class _BrokenWindow:
    shard_ranks = [0]

    def begin_pull(self, out, backoff=None):
        return _Done(self.pull(out, backoff))

    def pull(self, out, backoff=None):
        raise OSError("the window went away")

    def peek(self, backoff=None):
        return np.zeros(1, np.int64)


class _Window:
    shard_ranks = [0]

    def __init__(self):
        self.version = 3

    def begin_pull(self, out, backoff=None):
        return _Done(self.pull(out, backoff))

    def pull(self, out, backoff=None):
        out[:] = self.version
        return np.array([self.version]), False

    def peek(self, backoff=None):
        return np.array([self.version])


def test_a_dead_helper_ends_the_waiting_worker_with_its_error():
    puller = EagerPuller(_BrokenWindow(), 4)
    try:
        puller.request()
        with pytest.raises(OSError, match="the window went away"):
            wait_until(puller.ready)  # before: True, and a --staleness worker then waited on no snapshot
    finally:
        puller.close()


def test_a_pull_is_staged_and_taken():
    puller = EagerPuller(_Window(), 4)
    try:
        puller.request()
        wait_until(puller.ready)
        out = np.zeros(4, np.float32)
        versions, stop, _ = puller.take(out)
        assert versions.tolist() == [3] and not stop and out.tolist() == [3.0] * 4
    finally:
        puller.close()


class _GatedWindow:
    """Each pull reads the version it starts with, then waits for the test to let it finish."""

    shard_ranks = [0]

    def __init__(self):
        self.version = 1
        self.started, self.gate = threading.Event(), threading.Event()

    def begin_pull(self, out, backoff=None):
        version = self.version  # read with the requests, as ParamWindow pins the newest slot
        self.started.set()

        def finish():
            assert self.gate.wait(10), "the test never released the pull"
            self.gate.clear()
            out[:] = version
            return np.array([version]), False

        return _Done(None, finish)

    def peek(self, backoff=None):
        return np.array([self.version])


def test_a_pull_begun_before_a_request_does_not_count_as_fresh_for_it():
    window = _GatedWindow()
    puller = EagerPuller(window, 2)
    try:
        puller.request()
        assert window.started.wait(10)
        window.started.clear()
        puller.request()  # a new request while the first pull is in flight; version 2 is published
        window.version = 2
        window.gate.set()  # the old pull (version 1) lands
        wait_until(lambda: puller.ready() or window.started.is_set())
        assert not puller.ready()  # before: ready, with version 1 staged, as if fresh for the new request
        window.started.clear()
        window.gate.set()
        wait_until(puller.ready)
        versions, _, _ = puller.take(np.zeros(2, np.float32))
        assert versions.tolist() == [2]
    finally:
        window.gate.set()
        puller.close()


def test_begun_says_the_pull_is_on_the_wire_before_it_completes():
    """The eager worker starts its push only once the helper's pull has begun (its requests would
    otherwise queue behind the gradient on a TCP link): begun() must come before the pull completes."""
    window = _GatedWindow()
    puller = EagerPuller(window, 4)
    try:
        puller.request()
        wait_until(puller.begun)
        assert window.started.is_set() and not puller.ready()  # begun, not yet arrived
        window.gate.set()
        wait_until(puller.ready)
        puller.request(expected=60.0)  # just in time, a minute from now: begun at once, pulled later
        wait_until(puller.begun)
        assert not puller.ready()
    finally:
        puller.close()
