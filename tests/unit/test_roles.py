"""The roles without MPI: a real :class:`~hpcps.runtime.server.ShardServer` and real
:class:`~hpcps.runtime.worker.Worker`\\ s, joined by the fake transports of :mod:`fakeports` in one process
(the shard and each worker in a thread of its own), for the cases the MPI suite covers under ``mpiexec``:
bsp's rounds (parameters against a torch.optim replay, pulled or sent), ssp's bound, a non-finite gradient's
verdict, a stop.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

import numpy as np
import pytest
import torch

from fakeports import Fabric, FakeSpares, Rows
from hpcps.metrics.schema import ITERATION, UPDATE
from hpcps.policies import make_policy
from hpcps.runtime.parts import PullPlan, ServerHooks, ShardUpdate, StepPlan, Watch
from hpcps.runtime.residence import DeviceSlice, HostSlice
from hpcps.runtime.rounds import RoundSum
from hpcps.runtime.server import ShardServer
from hpcps.runtime.worker import Worker
from hpcps.training.flat import FlatParameters
from hpcps.training.optim import ShardOptimizer, builtin_optimizer

LR = 0.1
#: every wait ends the test in seconds, never hangs it
WATCH = Watch(stall_warn=5.0, stall_abort=10.0)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def gradient(params: np.ndarray, worker: int, step: int) -> np.ndarray:
    """A gradient that depends on the parameters it is computed on (so a pull of the wrong version shows)."""
    k = np.arange(len(params), dtype=np.float32)
    return (0.5 * params + 0.01 * (worker + 1) * (step + 1) * (k - 2)).astype(np.float32)


class Job:
    """One shard and ``n`` workers of ``paradigm`` over a :class:`Fabric`, each role in its thread."""

    def __init__(self, paradigm: str, n: int, steps: int, *, staleness: int = 0, rounds: bool = False,
                 hooks: ServerHooks = ServerHooks(), spare: bool = False, momentum: float = 0.0,
                 on_device: bool = False, sent: bool = False) -> None:
        """``on_device``: the shard steps its slice on a device (torch's CPU: a copy of its own,
        :class:`~hpcps.runtime.residence.DeviceSlice`), not the master in place; ``sent``: it sends each
        round to its workers (``--pull send``), which take it in the place of a window pull."""
        self.steps = steps
        self.flats = [FlatParameters(model()) for _ in range(n)]
        size = self.flats[0].size
        self.fabric, self.rows = Fabric(n, size), Rows()
        self.master = self.flats[0].params.copy()
        self.policy = make_policy(paradigm, n, staleness=staleness)
        home = DeviceSlice(self.master, torch.device("cpu")) if on_device else HostSlice(self.master)
        optimizer = ShardOptimizer(home.tensor, builtin_optimizer("sgd", lr=LR, momentum=momentum), lambda v: 1.0)
        round_sum = RoundSum(size, size, n, self.policy.active, device=home.device) if rounds else None
        self.pushed: dict[tuple[int, int], np.ndarray] = {}  # (worker, clock): the gradient it pushed
        self.server = ShardServer(
            shard=0, rank=0, policy=self.policy, worker_ranks=list(range(1, n + 1)),
            ports=self.fabric.server_ports(FakeSpares(n + 1, self._place) if spare else None, sent=sent),
            update=ShardUpdate(self.master, LR, optimizer=optimizer, n_params=size, round_sum=round_sum,
                               home=home),
            records=self.rows.records(), watch=WATCH, hooks=hooks)
        self.workers = [Worker(rank=w + 1, model=torch.nn.Linear(3, 2), flat=flat,
                               ports=self.fabric.worker_ports(w, flat.push_grads),
                               plan=StepPlan(steps=steps, lr=LR, blocks=self.policy.worker_blocks),
                               records=self.rows.records(), watch=WATCH,
                               pull=PullPlan(sent_pull=self.fabric.sent_pull(w) if sent else None))
                        for w, flat in enumerate(self.flats)]
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.spare: Worker | None = None

    def _place(self, worker: int, clock: int) -> None:
        """The spare (rank n + 1) takes dead ``worker``'s place, from its gradient ``clock + 1`` on."""
        flat = FlatParameters(model())
        self.fabric.notices[worker] = deque()  # (what was sent to the dead rank died with it)
        self.spare = Worker(rank=len(self.workers) + 1, model=torch.nn.Linear(3, 2), flat=flat,
                            ports=self.fabric.worker_ports(worker, flat.push_grads),
                            plan=StepPlan(steps=self.steps, lr=LR, blocks=self.policy.worker_blocks, start_step=clock),
                            records=self.rows.records(), watch=WATCH)
        self._start(self._train(self.spare, flat, worker, None))

    def run(self, *, compute=None, nan_at: tuple[int, int] | None = None,
            die: tuple[int, int] | None = None) -> None:
        """Serve, and train every worker: each step's gradient from :func:`gradient` on what it pulled;
        ``compute(worker, step)``: seconds the step takes; ``nan_at``: the (worker, step) whose gradient is
        NaN; ``die``: the (worker, step) at which a worker dies, before computing it."""
        self._start(lambda: self.server.run())
        for w, worker in enumerate(self.workers):
            self._start(self._train(worker, self.flats[w], w, compute, nan_at, die))
        deadline = time.monotonic() + 30
        while any(t.is_alive() for t in self.threads) and not self.errors and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.errors:  # (the others may wait for the failed role: left to die with the process)
            raise self.errors[0]
        assert not any(t.is_alive() for t in self.threads), "a role is still waiting after 30 s"

    def _start(self, fn) -> None:
        thread = threading.Thread(target=self._guard, args=(fn,), daemon=True)
        self.threads.append(thread)
        thread.start()

    def _train(self, worker: Worker, flat: FlatParameters, w: int, compute, nan_at=None, die=None):
        def loop():
            worker.begin()
            while worker.open_step():
                if die == (w, worker.step):
                    self.fabric.kill(w)
                    return  # (no goodbye: it died)
                if compute is not None:
                    time.sleep(compute(w, worker.step))
                g = gradient(flat.params, w, worker.step)
                if nan_at == (w, worker.step):
                    g[0] = np.nan
                self.pushed[w, worker.step + 1] = g.copy()
                flat.grads_t[:] = torch.from_numpy(g)
                worker.close_step(1.0, 0.0)
            worker.finish()
        return loop

    def _guard(self, fn) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 (kept for the test's thread to raise)
            self.errors.append(exc)
            self.fabric.stop = True

    def iterations(self) -> list[dict]:
        return [dict(zip(ITERATION.names, row)) for row in self.rows.tables.get("workers/iterations", [])]


def sgd_replay(start: np.ndarray, rounds: list[list[np.ndarray]]) -> np.ndarray:
    """torch.optim.SGD stepped once per round on the mean of the round's gradients."""
    p = torch.nn.Parameter(torch.from_numpy(start.copy()))
    opt = torch.optim.SGD([p], lr=LR)
    for grads in rounds:
        p.grad = torch.from_numpy(np.mean(grads, axis=0).astype(np.float32))
        opt.step()
    return p.detach().numpy()


@pytest.mark.parametrize("sent", [False, True], ids=["pulled", "sent"])
@pytest.mark.parametrize("summed", [True, False], ids=["round-sum", "held"])
def test_bsp_rounds_train_as_sgd_on_the_mean_gradient(summed, sent):
    """Pulled from the window or sent by the shard (``--pull send``), each round's values are the version
    the round closed at: every gradient is computed on them."""
    steps, n = 4, 3
    job = Job("bsp", n, steps, rounds=summed, sent=sent)
    start = job.master.copy()
    job.run(compute=lambda w, k: 0.002 * ((w + k) % 3))  # arrivals in every order
    # the replay: every worker computes round k's gradient on the parameters after k rounds
    params, rounds = start, []
    for k in range(steps):
        grads = [gradient(params, w, k) for w in range(n)]
        params = sgd_replay(params, [grads])
        rounds.append(grads)
    np.testing.assert_allclose(job.master, sgd_replay(start, rounds), rtol=1e-6, atol=1e-7)
    assert job.server.version == steps and job.server.gradients_applied == n * steps
    rows = job.iterations()
    assert len(rows) == n * steps  # every push's receipt came
    assert all(r["staleness"] == 0 and r["version"] == r["step"] for r in rows)  # computed on round k's version
    assert all(math.isclose(r["lr"], LR) for r in rows)
    assert sorted(c for _, c, _ in job.fabric.sent) == sorted(list(range(1, steps + 1)) * n)


def test_ssp_lets_no_worker_run_more_than_its_bound_ahead_of_the_slowest():
    s, steps, n = 1, 8, 2
    job = Job("ssp", n, steps, staleness=s)
    job.run(compute=lambda w, k: 0.05 if w == 1 else 0.0)  # worker 1 is slow
    pushed = {w: 0 for w in range(n)}
    ahead = 0
    for w, clock, _ in job.fabric.sent:  # in the order the shard received them
        pushed[w] = clock
        ahead = max(ahead, pushed[0] - pushed[1])
        # ssp: a worker's push of gradient c is granted once the slowest has pushed c - s
        assert clock - min(pushed.values()) <= s + 1, (w, clock, pushed)
    assert ahead == s + 1  # the bound held the fast worker, and did bind
    assert job.server.gradients_applied == n * steps  # applied on arrival, every one
    rows = job.iterations()
    assert max(r["staleness"] for r in rows) <= n * (s + 1)


def test_a_nonfinite_gradient_is_dropped_with_its_verdict_and_the_others_applied():
    steps, n = 3, 2
    job = Job("bsp", n, steps, rounds=True)
    start = job.master.copy()
    job.run(nan_at=(1, 1))
    params, rounds = start, []
    for k in range(steps):  # round 1 is worker 0's gradient alone
        grads = [gradient(params, w, k) for w in range(n) if (w, k) != (1, 1)]
        params = sgd_replay(params, [grads])
        rounds.append(grads)
    np.testing.assert_allclose(job.master, params, rtol=1e-6, atol=1e-7)
    assert np.isfinite(job.master).all()
    updates = [dict(zip(UPDATE.names, row)) for row in job.rows.tables["servers/updates"]]
    assert len(updates) == n * steps
    dropped = [u for u in updates if not u["applied"]]
    assert [(u["worker"], u["worker_clock"], u["reason"]) for u in dropped] == [(2, 2, 1)]  # reason 1: not finite
    mine = [r for r in job.iterations() if r["rank"] == 2 and r["step"] == 1]
    assert len(mine) == 1 and mine[0]["staleness"] == -1 and math.isnan(mine[0]["lr"])  # its receipt: dropped
    assert job.server.gradients_applied == n * steps - 1


@pytest.mark.parametrize("sent", [False, True], ids=["pulled", "sent"])
def test_a_stop_raised_at_a_publish_ends_every_worker_after_that_round_and_the_shard_with_them(sent):
    """As the evaluator raises it on reaching --stop-target: the flag is up before the round's grants go, so
    every worker's pull after its grant sees it (in the window, or in the header of the round the shard
    sends), and no worker pushes again."""
    steps, n, at = 50, 3, 3
    fabric = []
    hooks = ServerHooks(on_published=lambda version: fabric[0].__setattr__("stop", True) if version == at else None)
    job = Job("bsp", n, steps, rounds=True, hooks=hooks, sent=sent)
    fabric.append(job.fabric)
    job.run(compute=lambda w, k: 0.001 * w)
    assert job.server.version == at
    assert [w.clock_count for w in job.workers] == [at] * n
    assert job.server.gradients_applied == n * at and len(job.iterations()) == n * at


def test_a_spare_takes_a_dead_workers_place_and_every_planned_gradient_is_applied():
    """Run-through: worker 1 dies before its step 2; the shard records it lost at its clock, hands its place to
    the spare (rank 4), which pushes its gradients 3..6 as worker 1; every planned gradient is applied once."""
    steps, n = 6, 3
    job = Job("asp", n, steps, spare=True)
    job.run(compute=lambda w, k: 0.002, die=(1, 2))
    assert job.spare is not None and job.spare.clock_count == steps
    assert job.server.gradients_applied == n * steps  # the dead worker's 2, the spare's 4, the others' 12
    assert sorted(c for w, c, _ in job.fabric.sent if w == 1) == list(range(1, steps + 1))
    assert job.rows.tables["servers/lost"] == [(0, 0, pytest.approx(job.rows.tables["servers/lost"][0][2]), 2, 2, 0)]
    (joined,) = job.rows.tables["servers/joins"]
    assert (joined[3], joined[4], joined[5]) == (2, 4, 2)  # dead rank 2, spare rank 4, from its clock 2
    spare_rows = [r for r in job.iterations() if r["rank"] == 4]
    assert sorted(r["step"] for r in spare_rows) == list(range(2, steps))  # its steps, where worker 1 stopped



@pytest.mark.parametrize("paradigm", ["bsp", "ssp"])
def test_a_slice_stepped_on_a_device_ends_bit_for_bit_as_one_stepped_in_place(paradigm):
    """``--server-device``: the shard's slice, momentum and round sum on a device (torch's CPU here, a copy
    apart from the master), each gradient copied up and each update copied down before its publish. Held to
    the host path bit for bit: bsp against a second job in host memory (its rounds sum in worker order, so
    two jobs end alike), ssp (whose order is the timing's) against the host optimizer stepped in the order
    the device job applied its gradients."""
    steps, n = 6, 3
    compute = (lambda w, k: 0.002 * ((w + k) % 3)) if paradigm == "bsp" else (lambda w, k: 0.01 if w == 1 else 0.0)
    job = Job(paradigm, n, steps, staleness=1, rounds=paradigm == "bsp", momentum=0.9, on_device=True)
    start = job.master.copy()
    job.run(compute=compute)
    assert job.server.gradients_applied == n * steps
    if paradigm == "bsp":
        host = Job(paradigm, n, steps, rounds=True, momentum=0.9)
        host.run(compute=compute)
        expected = host.master
    else:
        expected = start.copy()
        replay = ShardOptimizer(torch.from_numpy(expected), builtin_optimizer("sgd", lr=LR, momentum=0.9),
                                lambda v: 1.0)
        updates = [dict(zip(UPDATE.names, row)) for row in job.rows.tables["servers/updates"]]
        assert [u["version"] for u in updates] == list(range(n * steps))  # one gradient per update, in order
        for u in updates:
            replay.step([torch.from_numpy(job.pushed[u["worker"] - 1, u["worker_clock"]])], [1.0],
                        version=u["version"], factor=1.0)
    assert np.abs(job.master - start).max() > 1e-3, "nothing trained: the comparison would be empty"
    assert np.array_equal(job.master, expected), np.abs(job.master - expected).max()
    assert job.master.ctypes.data != job.server.home.tensor.data_ptr()  # the device path ran: a copy apart
