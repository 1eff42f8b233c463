"""One flat, contiguous buffer for a model's parameters and one for its gradients.

Every parameter of the model becomes a view into :attr:`FlatParameters.params`
and its ``.grad`` a view into :attr:`FlatParameters.grads`, so a pull writes
straight into the model, a push sends straight from backward's output, and
shards are plain contiguous blocks of the vector. Nothing is copied per step.
"""

from __future__ import annotations

import numpy as np
import torch


class FlatParameters:
    """Re-home ``model``'s parameters and gradients into flat float32 buffers."""

    def __init__(self, model: torch.nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters")
        if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
            raise ValueError("flat buffers hold float32 CPU parameters")
        self.size = sum(p.numel() for p in params)
        self.params = np.empty(self.size, np.float32)
        self.grads = np.zeros(self.size, np.float32)
        flat_p = torch.from_numpy(self.params)
        flat_g = torch.from_numpy(self.grads)
        offset = 0
        for p in params:
            n = p.numel()
            flat_p[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = flat_p[offset:offset + n].view_as(p)
            p.grad = flat_g[offset:offset + n].view_as(p)
            offset += n

    def zero_grad(self) -> None:
        """Zero the gradient buffer in place (backward accumulates into the views)."""
        self.grads.fill(0.0)
