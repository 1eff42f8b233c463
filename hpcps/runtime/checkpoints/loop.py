"""Worker 0's part of bsp's periodic checkpoints: its loop's state (``ps.state``, ``ps.optimizer``'s
hyperparameters, the model's integer buffers) beside the servers' checkpoint of each version it checkpoints.

bsp checkpoints at a round's close, where every worker waits for its grant, so the shards and worker 0's loop
are at one version (:meth:`hpcps.policies.base.Policy.checkpoints_at_publish`); the other paradigms' periodic
checkpoints are cuts taken while the workers go on (:mod:`hpcps.runtime.checkpoints.cut`), without a loop part. A
checkpoint counts as complete only with its loop part (:func:`hpcps.runtime.checkpoints.files.missing_parts`).
"""

from __future__ import annotations

from typing import Callable

import torch

from hpcps.runtime.checkpoints.files import LoopState, checkpoint_path, write_user_state


class LoopCheckpoints:
    """Every ``every`` versions (None: never), the loop's ``state()`` into the checkpoint of that version in
    ``ckpt_dir``, written when the loop has made its decisions on it: at its first training pass on that
    version (a forward pre-hook on ``model``), or at its next ``step()`` or ``close()`` if that comes first.
    ``saved_at``: the version whose loop part is written already (a resumed run's checkpoint's)."""

    def __init__(self, model: torch.nn.Module, ckpt_dir: str, every: int | None, state: Callable[[], LoopState],
                 saved_at: int | None = None) -> None:
        self.ckpt_dir, self.every, self.state, self.saved_at = ckpt_dir, every, state, saved_at
        #: a checkpointed version whose loop state is written at the loop's next training pass (:meth:`save_due`)
        self.due: int | None = None
        self.hook = model.register_forward_pre_hook(self._before_forward) if every else None

    def note_version(self, version: int) -> None:
        """The version the loop computes on now came in: where it is a checkpoint's, the loop's part is due."""
        if self.every and version and version % self.every == 0 and version != self.saved_at:
            self.due = version  # this version's checkpoint is the servers'; the loop's part waits for the loop

    def _before_forward(self, module: torch.nn.Module, args) -> None:
        """Worker 0's first training pass (gradients on, train mode) on a checkpointed version: its loop's
        decisions since the step that brought the version in (an epoch's end: a new rate, a counter, the
        best loss so far) are made; they go into the checkpoint now."""
        if self.due is not None and torch.is_grad_enabled() and module.training:
            self.save_due()

    def save_due(self) -> None:
        """Write the loop's state beside the checkpoint of the version it now computes on: as it is when the
        loop begins its first training pass on that version, or calls ``step()`` or ``close()`` first (where a
        run resumed from that checkpoint starts)."""
        if self.due is None:
            return
        # written whatever it holds: the checkpoint counts as complete only with it (its loop_part)
        write_user_state(checkpoint_path(self.ckpt_dir, self.due), self.state())
        self.saved_at, self.due = self.due, None

    def remove(self) -> None:
        """The model leaves the run without the hook."""
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
