"""A plug-in built on bsp that keeps state of its own: the pushes it decided on (for the checkpoint tests)."""

from hpcps.policies.sync import BSP


class CountingBSP(BSP):
    name = "counting-bsp"
    summary = "bsp that counts the pushes it decided on"

    def __init__(self, n_workers: int, **options) -> None:
        super().__init__(n_workers, **options)
        self.pushes = 0

    def on_push(self, worker, clock, version, now):
        self.pushes += 1
        return super().on_push(worker, clock, version, now)

    def state_dict(self) -> dict:
        return {"pushes": self.pushes}

    def load_state_dict(self, state: dict) -> None:
        self.pushes = int(state.get("pushes", 0))
