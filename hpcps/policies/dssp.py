"""DSSP: stale synchronous parallel with a threshold chosen at run time.

Zhao et al., "Dynamic Stale Synchronous Parallel Distributed Training for
Deep Learning", ICDCS 2019. Every gradient is applied on arrival (as in
SSP). Each worker ``p`` has a clock-gap bound ``b_p`` in ``[s_lo, s_hi]``,
starting at ``s_lo``; ``p`` may start its next iteration while its clock is
at most ``b_p`` ahead of the slowest active worker.

When a push of ``p`` lands beyond its bound (gap ``g > b_p``: the fast
worker *reaches* its bound), the synchronization controller predicts the
next push times of ``p`` (``T_f + iΔ_f``) and of the slowest worker
(``T_s + jΔ_s``) from each one's last push time and last iteration interval,
and picks the number of further iterations

    r* = argmin_{i in [0, s_hi - g + 1]}  min_{j >= 1} |T_f + iΔ_f - (T_s + jΔ_s)|

that lines a push of ``p`` up best with one of the slow worker's; the bound
becomes ``b_p = g - 1 + r*``. When ``p`` then has to wait, the aligned push
of the slow worker lowers the gap by one and releases it almost at once. At
the first crossing (``g = s_lo + 1``) this is ``b_p = s_lo + r*`` with
``r*`` in ``[0, s_hi - s_lo]``. A push within ``s_lo`` resets the bound to
``s_lo``. Consequences, tested: no worker starts an iteration more than
``s_hi`` clocks ahead of the slowest, every recorded threshold lies in
``[s_lo, s_hi]``, and with ``s_hi == s_lo`` the policy is exactly SSP. Without
two pushes of each worker there is no interval to predict from and ``r* = 0``.
"""

from __future__ import annotations

from hpcps.policies.registry import register
from hpcps.policies.sync import SSP


def extra_iterations(t_fast: float, d_fast: float, t_slow: float, d_slow: float, r_max: int) -> int:
    """The controller's ``r*`` (see module docstring); the smallest ``i`` wins ties."""
    best_i, best = 0, float("inf")
    for i in range(r_max + 1):
        x = t_fast + i * d_fast - t_slow
        j = max(1, round(x / d_slow))
        distance = abs(x - j * d_slow)
        if distance < best - 1e-12:
            best_i, best = i, distance
    return best_i


@register
class DSSP(SSP):
    name = "dssp"
    summary = "dynamic SSP: the clock-gap bound moves in [--staleness, --staleness-max] by predicted push times"
    reads = frozenset({"staleness", "staleness_max"})

    def __init__(self, n_workers: int, *, staleness: int = 0, staleness_max: int | None = None) -> None:
        super().__init__(n_workers, staleness=staleness, staleness_max=staleness_max)
        if self.staleness_max < self.staleness:
            raise ValueError("staleness_max must be >= staleness")
        self.last_push: list[float | None] = [None] * n_workers
        self.interval: list[float | None] = [None] * n_workers
        self.bound = [staleness] * n_workers
        #: each worker's last controller decision, (time, worker, clock gap, r*, new bound), or None (one per
        #: worker, not a history: a run of 100k pushes past the bound holds no more than one of 10); the
        #: bounds in force are in the run file (servers/updates.threshold)
        self.last_decision: list[tuple[float, int, int, int, int] | None] = [None] * n_workers

    def threshold(self, worker: int) -> int:
        return self.bound[worker]

    def state_dict(self) -> dict:
        """SSP's clocks, each worker's bound and last iteration interval (push times are on the old
        run's clock: a resumed run measures them afresh)."""
        return {**super().state_dict(), "bound": list(self.bound), "interval": list(self.interval)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for worker, (bound, interval) in enumerate(zip(state.get("bound", ()), state.get("interval", ()))):
            if worker < self.n_workers:
                self.bound[worker] = min(max(int(bound), self.staleness), self.staleness_max)
                self.interval[worker] = interval

    def _tie_break(self, worker: int) -> float:
        return self.last_push[worker] or 0.0

    def on_join(self, worker: int, now: float):
        """The newcomer's pace is its own: the dead worker's push times and bound are forgotten (the controller
        predicts from push intervals, and the newcomer's first is measured from its first push)."""
        self.last_push[worker] = self.interval[worker] = self.last_decision[worker] = None
        self.bound[worker] = self.staleness
        return super().on_join(worker, now)

    def on_push(self, worker: int, clock: int, version: int, now: float):
        if self.last_push[worker] is not None:
            self.interval[worker] = now - self.last_push[worker]
        self.last_push[worker] = now
        self._set_clock(worker, clock)
        gap = clock - self.slowest_clock()
        if gap <= self.staleness:
            self.bound[worker] = self.staleness
        elif gap > self.bound[worker]:
            r = self._controller(worker, r_max=self.staleness_max - gap + 1)
            self.bound[worker] = min(max(gap - 1 + r, self.staleness), self.staleness_max)
            self.last_decision[worker] = (now, worker, gap, r, self.bound[worker])
        return super().on_push(worker, clock, version, now)

    def _controller(self, fast: int, r_max: int) -> int:
        slow = self.slowest()  # the smallest clock; on ties the one that pushed longest ago
        d_fast, d_slow, t_slow = self.interval[fast], self.interval[slow], self.last_push[slow]
        if r_max <= 0 or d_fast is None or d_slow is None or d_slow <= 0 or t_slow is None:
            return 0
        return extra_iterations(self.last_push[fast], d_fast, t_slow, d_slow, r_max)
