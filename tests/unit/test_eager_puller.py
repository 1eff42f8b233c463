"""The eager helper thread (no MPI: a fake window)."""

import threading
import time

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


def test_a_snapshot_is_taken_once():
    """After a take, ready() waits for the next request's pull. Before, it stayed True: the eager worker's
    first step took the snapshot of its start-up twice, and the second take swapped back in the array the
    worker held before the first (its own initial parameters), labelled with the versions the start-up
    pulled, which are not version 0 where other workers have pushed already."""
    window = _Window()
    params = [np.full(4, -1.0, np.float32)]

    def swap(new):
        old, params[0] = params[0], new
        return old

    puller = EagerPuller(window, 4)
    try:
        puller.request()
        wait_until(puller.ready)
        assert puller.take(swap=swap)[0].tolist() == [3] and params[0].tolist() == [3.0] * 4
        assert not puller.ready()
        with pytest.raises(RuntimeError, match="before a pull completed"):
            puller.take(swap=swap)
        window.version = 4
        puller.request()
        wait_until(puller.ready)
        assert puller.take(swap=swap)[0].tolist() == [4] and params[0].tolist() == [4.0] * 4
    finally:
        puller.close()


class _SlowWindow:
    """Pulls that write the version they read a block at a time, pausing now and then, while a thread
    publishes new versions: a take or a swap racing a pull shows as a torn or relabelled snapshot."""

    shard_ranks = [0]

    def __init__(self, rng):
        self.version, self.rng = 0, rng

    def begin_pull(self, out, backoff=None):
        version, pauses = self.version, self.rng.random(len(out) // 64 + 1) < 0.05

        def finish():
            for k, lo in enumerate(range(0, len(out), 64)):
                out[lo:lo + 64] = version
                if pauses[k]:
                    time.sleep(1e-4)
            return np.array([version]), False

        return _Done(None, finish)

    def peek(self, backoff=None):
        return np.array([self.version])


def test_the_worker_s_parameters_hold_the_version_they_are_labelled_and_never_change_under_it():
    """The eager worker's own calls (request, hurry, ready, take with a swap, request again), 300 steps
    against pulls racing new versions: every snapshot taken holds exactly the version it comes with, and
    the array the worker computes on is never written while it does."""
    rng = np.random.default_rng(7)
    window, stop = _SlowWindow(rng), threading.Event()

    def publish():
        while not stop.wait(1e-3 * rng.random()):
            window.version += 1

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    params = [np.full(1024, -1.0, np.float32)]

    def swap(new):
        old, params[0] = params[0], new
        return old

    puller = EagerPuller(window, 1024)
    wrong = []
    try:
        puller.request()
        wait_until(puller.ready)
        versions, _, _ = puller.take(swap=swap)
        puller.request()  # as EagerWorker.begin: the next pull, for the first step's end
        for step in range(300):
            mine, held = params[0], params[0].copy()
            if not (held == versions[0]).all():
                wrong.append((step, "labelled", int(versions[0]), sorted(set(held.tolist()))[:3]))
            time.sleep(1e-3 * rng.random())  # computing
            if not np.array_equal(mine, held):
                wrong.append((step, "written while computing"))
            puller.hurry()
            wait_until(puller.ready)
            versions, _, _ = puller.take(swap=swap)
            puller.request(1e-3 * rng.random())
    finally:
        stop.set()
        publisher.join()
        puller.close()
    assert wrong == []
