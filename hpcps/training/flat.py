"""One flat, contiguous buffer for a model's parameters and one for its gradients.

Every parameter of the model becomes a view into :attr:`FlatParameters.params_t`
and its ``.grad`` a view into :attr:`FlatParameters.grads_t`, so a pull
writes the whole model at once, a push sends backward's output as one block,
and shards are plain contiguous blocks of the vector.

The model's floating-point *buffers* (BatchNorm's running statistics) follow
the parameters in the same vector: ``params_t[n_params:]`` holds them, and
each buffer of the model is a view into it, so a pull brings the servers'
averaged buffers along with the parameters. They have no gradient: a
worker's pass records in ``grads_t[n_params:]`` how its forward changed them
(:meth:`begin_pass`, :meth:`end_pass`), and the servers add the mean of
those changes (see :mod:`hpcps.runtime.server`). Integer buffers (BatchNorm's
``num_batches_tracked``) stay local to each rank.

On a device (``staged``, ``direct``) the model's tensors are not views into
the packed :attr:`params_t` but into :attr:`model_t`, a copy in which each
begins on a 512-byte boundary, as a tensor of its own would (GPU kernels may
assume it). :meth:`upload` and :meth:`upload_ranges` copy on into it, and
:meth:`values` packs its present state back (after an inner optimizer's step).

The *host side* is what MPI reads and writes: :attr:`params` (pulls land
there) and :attr:`push_grads` (pushes leave from there). How it relates to
the model's buffers is the transfer mode (see :mod:`hpcps.cluster.device`):

``shared`` (CPU)
    the host side *is* the model's memory: nothing is copied per step.
``staged`` (GPU, MPI not CUDA-aware)
    pinned host copies: :meth:`upload` after a pull, :meth:`stage_grads`
    before a push.
``direct`` (GPU, CUDA-aware MPI)
    parameters as in ``staged`` (the RMA windows are in host memory); pushes
    leave from GPU memory, so :attr:`push_grads` is the GPU tensor and
    :attr:`grads` is None.

On the CPU, ``staged`` and ``direct`` can be asked for explicitly: they then
copy between two host buffers (``direct`` pushes a torch tensor), which lets
the GPU code paths be tested on machines without a GPU.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from hpcps.cluster.device import Transfer

ALIGN = 128  # float32 values: 512 bytes, where the CUDA caching allocator begins each of its blocks


class FlatParameters:
    """Re-home ``model``'s parameters and gradients into flat float32 buffers on ``device``."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str = "cpu",
                 transfer: Transfer | None = None) -> None:
        self.device = torch.device(device)
        self.transfer: Transfer = transfer or ("shared" if self.device.type == "cpu" else "staged")
        if self.transfer == "shared" and self.device.type != "cpu":
            raise ValueError("transfer 'shared' is for CPU training: GPU memory needs 'staged' or 'direct'")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters")
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("flat buffers hold float32 parameters")
        model.to(self.device)  # buffers too (batch-norm statistics), not only the parameters
        buffers = _float_buffers(model)
        if any(b.dtype != torch.float32 for _, _, b in buffers):
            raise ValueError("flat buffers hold float32 buffers (BatchNorm statistics): use a float32 model")
        self.n_params = sum(p.numel() for p in params)
        self.size = self.n_params + sum(b.numel() for _, _, b in buffers)
        if self.transfer == "shared":  # numpy's memory: MPICH's shared-memory transfers out of torch's ran 3x slower
            self.params, self.grads = np.empty(self.size, np.float32), np.zeros(self.size, np.float32)
            self.params_t, self.grads_t = torch.from_numpy(self.params), torch.from_numpy(self.grads)
        else:
            self.params_t = torch.empty(self.size, dtype=torch.float32, device=self.device)
            self.grads_t = torch.zeros(self.size, dtype=torch.float32, device=self.device)
        tensors = [(p, None, "", p.detach()) for p in params] + [(None, m, name, b.detach()) for m, name, b in buffers]
        # On the CPU the model lives in params_t itself. On a device it lives in a copy of its own whose every
        # tensor begins on a 512-byte boundary, as an allocation of its own would: packed end to end (a
        # 10-class head leaves an odd count of values before the BatchNorm statistics that follow the
        # parameters), a small conv net's forward pass failed on an H200 with "CUDA error: misaligned
        # address", and ran once aligned. params_t stays packed: it is what MPI moves
        padded = self.transfer != "shared"
        starts, at = [], 0
        for *_, t in tensors:
            starts.append(at)
            at += -(-t.numel() // ALIGN) * ALIGN if padded else t.numel()
        self.model_t = torch.zeros(at, dtype=torch.float32, device=self.device) if padded else self.params_t
        offset = 0
        self._grad_views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._spans: list[tuple[torch.nn.Parameter | None, torch.nn.Module | None, str, int, int]] = []
        self._model_views: list[torch.Tensor] = []  # each tensor's flat view in model_t, in the order of _spans
        for (p, module, name, t), start in zip(tensors, starts):
            n = t.numel()
            self._spans.append((p, module, name, offset, n))
            view = self.model_t[start:start + n]
            view.copy_(t.reshape(-1))
            self._model_views.append(view)
            offset += n
        self._point_model()  # before the gradients: a parameter's gradient must be on its device
        for p, _, _, offset, n in self._spans:
            if p is not None:
                p.grad = self.grads_t[offset:offset + n].view_as(p)
                self._grad_views.append((p, p.grad))
        self._packed_views = [self.params_t[o:o + n] for *_, o, n in self._spans] if padded else None
        self._offsets = [o for *_, o, _ in self._spans]  # each tensor's place in params_t
        self._starts = starts  # and in model_t
        self._before: torch.Tensor | None = None  # buffers when the pass began
        if padded:
            torch._foreach_copy_(self._packed_views, self._model_views)
            self.params = self._host_buffer()
            self.params[:] = self.params_t.cpu().numpy()
            self.grads = None if self.transfer == "direct" else self._host_buffer()

    @property
    def spans(self) -> list[tuple[torch.nn.Parameter | None, torch.nn.Module | None, str, int, int]]:
        """Each tensor's ``(parameter, module, name, offset, length)`` in the flat vector, in its order
        (a buffer's parameter is None): what partitions and backward pushes cut by."""
        return self._spans

    @property
    def push_grads(self) -> np.ndarray | torch.Tensor:
        """The buffer a one-slot push sends: host memory, or (``direct``) the model's gradient tensor."""
        return self.grads_t if self.transfer == "direct" else self.grads

    def new_push_buffer(self) -> np.ndarray | torch.Tensor:
        """Another buffer of the kind :attr:`push_grads` is, for pushes from several slots."""
        return torch.empty_like(self.grads_t) if self.transfer == "direct" else self._host_buffer()

    def _host_buffer(self) -> np.ndarray:
        """A flat float32 host array, page-locked when training on a GPU (fast, asynchronous copies)."""
        if self.device.type == "cuda":
            return torch.empty(self.size, dtype=torch.float32, pin_memory=True).numpy()
        return np.empty(self.size, np.float32)

    def adopt_grads(self) -> None:
        """Bring gradients that left the flat buffer back into it: a loop's ``zero_grad()`` (which
        sets ``.grad`` to None by default) makes backward allocate new ones. Each parameter's
        gradient is copied into its view (zeros where it has none) and ``.grad`` points there again."""
        for p, view in self._grad_views:
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
            else:
                continue
            p.grad = view

    def zero_grad(self) -> None:
        """Zero the gradient buffer in place (backward accumulates into the views)."""
        self.grads_t.zero_()

    def begin_pass(self) -> None:
        """Zero the gradients and note the buffers, before a forward pass that may update them."""
        self.zero_grad()
        if self.size > self.n_params:
            self._before = self._buffers_now().clone()

    def end_pass(self, clip_norm: float | None = None) -> None:
        """After backward: record the buffers' change in the gradient vector; clip the gradient.

        ``clip_norm`` scales the parameters' gradient to that global L2 norm
        if it is larger, as ``torch.nn.utils.clip_grad_norm_`` does (the
        buffers' changes are not part of the norm).
        """
        if self._before is not None:
            torch.sub(self._buffers_now(), self._before, out=self.grads_t[self.n_params:])
            self._before = None
        if clip_norm is not None:
            grad = self.grads_t[:self.n_params]
            coef = clip_norm / (float(grad.norm()) + 1e-6)
            if coef < 1.0:
                grad.mul_(coef)

    def _buffers_now(self) -> torch.Tensor:
        """The model's float buffers as they are, packed as in :attr:`params_t` (a view on the CPU)."""
        if self._packed_views is None:
            return self.params_t[self.n_params:]
        return torch.cat(self._model_views[len(self._grad_views):])

    def values(self) -> torch.Tensor:
        """The model's parameters and float buffers as they are now, packed (:attr:`size` values on the
        device): :attr:`params_t`, brought up to date with the model's own copy on a device, where an inner
        optimizer's step or a forward pass changed that copy only."""
        if self._packed_views is not None:
            torch._foreach_copy_(self._packed_views, self._model_views)
        return self.params_t

    def synchronize(self) -> None:
        """Wait for the work queued on the device (a no-op on the CPU): timings and MPI see finished results."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def swap_params(self, new: np.ndarray) -> np.ndarray:
        """Make ``new`` (float32, :attr:`size` values) the host parameters without copying it, and return
        the array it replaces (for the next pull to land in): a pulled snapshot taken over by a pointer
        swap. With ``shared`` transfers it becomes the model's own memory, every parameter and buffer
        re-pointed into it (the same tensor objects: an optimizer's or a hook's references stay good);
        otherwise :meth:`upload` copies it to the device as after any pull."""
        old = self.params
        self.params = new
        if self.transfer == "shared":
            # the model lives in params_t itself on the CPU (model_t is it): every view of it follows
            self.params_t = self.model_t = t = torch.from_numpy(new)
            self._model_views = [t[offset:offset + n] for *_, offset, n in self._spans]
            self._point_model()
        return old

    def _point_model(self) -> None:
        """Every parameter's data and every buffer of the model onto its view in :attr:`model_t` (the same
        tensor objects: an optimizer's or a hook's references stay good)."""
        for (p, module, name, _, _), view in zip(self._spans, self._model_views):
            if p is not None:
                p.data = view.view_as(p)
            else:
                module._buffers[name] = view.view_as(module._buffers[name])

    def upload(self) -> None:
        """The host :attr:`params` changed (a pull): bring the model's parameters up to date."""
        if self.transfer != "shared":
            self.params_t.copy_(torch.from_numpy(self.params))
            with torch.no_grad():
                torch._foreach_copy_(self._model_views, self._packed_views)

    def upload_ranges(self, ranges) -> None:
        """Those ``(lo, hi)`` ranges of the host :attr:`params` changed (a partition of a pull): bring them
        up, asynchronously from pinned memory (the device's stream runs the pass after them; the pass's
        end waits for the device, before the host array is written again)."""
        if self.transfer == "shared":
            return
        host = torch.from_numpy(self.params)
        # through .data: the pass under way has saved parameters for its backward, which share params_t's
        # version counter, and autograd would take a write to any range for a change of theirs. Only ranges
        # of modules whose forward has not yet run come here, as a pull into shared memory writes them
        packed, model = self.params_t, self.model_t.data
        for lo, hi in ranges:
            packed[lo:hi].copy_(host[lo:hi], non_blocking=True)
            # then into the model's tensors that the range covers (after the copy above, on the same stream)
            first = bisect.bisect_right(self._offsets, lo) - 1
            for i in range(max(first, 0), len(self._spans)):
                *_, offset, n = self._spans[i]
                if offset >= hi:
                    break
                a, b = max(lo, offset), min(hi, offset + n)
                if a < b:
                    start = self._starts[i]
                    model[start + a - offset:start + b - offset].copy_(packed[a:b])

    def stage_grads(self, out: np.ndarray | torch.Tensor | None = None) -> None:
        """Make the last backward's gradient readable by MPI in ``out`` (default :attr:`push_grads`).

        Returns once the data is there: MPI reads the buffer outside any CUDA stream.
        """
        out = self.push_grads if out is None else out
        if isinstance(out, np.ndarray):
            if self.transfer != "shared":
                torch.from_numpy(out).copy_(self.grads_t)  # device to host copies block until done
            elif out is not self.grads:
                np.copyto(out, self.grads)
        elif out is not self.grads_t:
            out.copy_(self.grads_t)
        self.synchronize()


def _float_buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(module, name, tensor) of every floating-point buffer, each tensor once, in ``model.buffers()`` order."""
    seen, out = set(), []
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point() and id(b) not in seen:
                seen.add(id(b))
                out.append((module, name, b))
    return out
