"""A paradigm written only from docs/paradigms.md ("Write your own paradigm"): asp that drops stale gradients.

Every gradient is decided on arrival: applied if it is at most ``max_stale``
versions behind the shard, dropped otherwise; its worker goes on at once.
"""

from hpcps import Decision, Policy


class DropStale(Policy):
    name = "drop-stale"
    summary = "asp that drops a gradient more than max_stale versions stale"
    worker_blocks = False
    applies_on_arrival = True

    def __init__(self, n_workers, *, max_stale=2):
        super().__init__(n_workers)
        if max_stale < 0:
            raise ValueError(f"max_stale must be 0 or more; got {max_stale}")
        self.max_stale = max_stale
        self.version = 0

    def resume_at(self, version):
        self.version = version

    def threshold(self, worker):
        return self.max_stale

    def on_push(self, worker, clock, version, now):
        if self.version - version > self.max_stale:
            return Decision(drops=(worker,), grants=(worker,))
        self.version += 1
        return Decision(updates=((worker,),), grants=(worker,))
