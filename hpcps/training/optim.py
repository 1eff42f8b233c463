"""Optimizers on the server shards, and learning-rate schedules over the server version.

As MXNet's KVStore with ``update_on_kvstore``: workers push gradients, and
each server shard runs a torch optimizer on its own slice of the flat
parameters, keeping the optimizer state of that slice only. Every rule in
torch.optim is elementwise given its hyper-parameters (SGD with momentum,
weight decay and Nesterov; Adam; AdamW), so S shards stepping their slices
make exactly the update one optimizer would make on the whole vector.

One update of the shard (a closed BSP round, one asynchronous gradient, an
hsp extra, a group's update) is one optimizer step::

    lr    = base_lr x schedule(version) x weight x F
    grad  = sum_i (f_i / (n F)) g_i          F = mean_i f_i

``f_i`` is gradient i's factor: the learning rate its worker asked for (the
staleness-aware rate, ``--lr-staleness``) over ``--lr``; ``weight`` is the
paradigm's factor for the update (hsp's late gradients, a grouped update's
group size). Factors therefore multiply the learning rate, so they act on
Adam too (Adam's step does not change when its gradient is scaled); where
the gradients of one update have different factors, each is weighted by
its factor relative to their mean. With plain SGD this is exactly
``master -= sum_i base_lr x schedule x weight x f_i / n x g_i``.

The shard's slice is stepped in chunks of :data:`APPLY_CHUNK` values (one
``step()`` per chunk, the others' ``.grad`` unset), with an MPI progress
poke between chunks, so a large update never keeps the server outside MPI
for long.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from hpcps.training.momentum import StaleMomentum
from hpcps.training.optstate import from_shard, to_shard

#: float32 values updated between two progress pokes (1 MiB: fits in L2)
APPLY_CHUNK = 1 << 18

#: builds an optimizer over the shard's param groups (torch.optim's dicts of flat float32 chunks, see
#: hpcps.training.paramgroups); a factory that hands them to a torch.optim class as they are keeps the groups
OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
#: learning-rate multiplier as a function of the shard's version (updates applied so far)
Schedule = Callable[[int], float]

SCHEDULES = ("constant", "step", "cosine")


def make_schedule(name: str, *, horizon: int, warmup: int = 0, step_every: int | None = None,
                  gamma: float = 0.1, floor: float = 0.0) -> Schedule:
    """The multiplier of the base learning rate at server version ``v`` (pure).

    ``horizon`` is the number of updates the run will apply (its last
    version). ``warmup`` versions ramp linearly from ``1/warmup`` to 1 first.
    Then ``constant`` stays at 1; ``step`` multiplies by ``gamma`` every
    ``step_every`` versions (default: a third of the horizon); ``cosine``
    decays from 1 to ``floor`` over the versions after the warm-up, as
    ``floor + (1 - floor) 0.5 (1 + cos(pi t))`` with ``t`` the share of them
    done (1 past the horizon): nanoGPT's warm-up, cosine and ``min_lr``.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r} (known: {', '.join(SCHEDULES)})")
    horizon = max(1, horizon)
    every = step_every or max(1, horizon // 3)

    def after_warmup(v: int) -> float:
        if name == "step":
            return gamma ** (v // every)
        if name == "cosine":
            t = min(1.0, (v - warmup) / max(1, horizon - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))
        return 1.0

    def schedule(v: int) -> float:
        if v < warmup:
            return (v + 1) / warmup
        return after_warmup(v)

    return schedule


#: the built-in optimizers take torch's fused kernels where torch has them. Their rounding depends on where
#: an element sits in its tensor: on an AVX-512 CPU (torch 2.13) the fused sgd with momentum, adam and adamw
#: compute a tensor's last elements, short of a whole vector, on a path that rounds otherwise than the vector
#: body (1 ulp, a few elements in ten thousand a step). The shards' cuts fall on a grid that keeps every value
#: on one path on every slicing (:data:`hpcps.cluster.slices.ALIGN`), so bsp ends alike on any shard count
#: and ``--partition-mb``; a plain torch loop over the model's own tensors ends a few ulp apart. False:
#: torch's default kernels (3x slower for adamw here), whose rounding a plain ``torch.optim`` loop shares.
FUSED = True


def warm_optimizers() -> None:
    """Build and drop one torch optimizer: torch imports its compiler (``torch._dynamo``, 1.5-2.5 s on a
    busy node) at the first optimizer a process builds. Called before a run's start, so that import is
    not counted in its clock nor holds up a worker's first steps."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


def builtin_optimizer(name: str, *, lr: float, momentum: float = 0.0, nesterov: bool = False,
                      weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                      eps: float = 1e-8, momentum_period: int = 1, fused: bool | None = None) -> OptimizerFactory:
    """``--optimizer sgd|adam|adamw`` and its options, as a factory of torch optimizers.

    torch's fused implementation where it has one (``fused=True``: one pass over a chunk
    where the default for-loop makes one per operation; Adam's step on the shard went from
    17x to 3.2x the time of a copy of the gradient's bytes, ``tools/bench_shard_apply.py``),
    the default one where it refuses (``fused=None``, unless :data:`FUSED` is off); ``fused=False``: torch's
    default kernels, as a plain ``torch.optim.AdamW(params)`` has them (the user's own loop, to the last
    bit); ``fused=True``: the fused kernel or torch's error. ``momentum_period`` above 1: sgd's Nesterov
    momentum updated once per that many updates (:class:`hpcps.training.delayed.DelayedNesterov`)."""
    if name == "sgd" and momentum_period > 1:
        from hpcps.training.delayed import DelayedNesterov

        return lambda params: DelayedNesterov(list(params), lr=lr, momentum=momentum, period=momentum_period,
                                              weight_decay=weight_decay)
    if name == "sgd":
        cls, options = torch.optim.SGD, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    elif name == "adam":
        cls, options = torch.optim.Adam, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    elif name == "adamw":
        cls, options = torch.optim.AdamW, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown optimizer {name!r} (known: sgd, adam, adamw)")

    def make(params):
        params = list(params)
        if fused is True:
            return cls(params, fused=True, **options)
        if fused is False or not FUSED:
            return cls(params, **options)
        try:
            return cls(params, fused=True, **options)
        except (RuntimeError, TypeError, ValueError):  # no fused kernel for these tensors or this torch
            return cls(params, **options)
    return make


def _cut(spans: list[tuple[int, int]], cuts: Sequence[int]) -> list[tuple[int, int]]:
    """``spans`` cut again wherever one of ``cuts`` falls inside one."""
    out = []
    for lo, hi in spans:
        edges = [lo, *sorted({c for c in cuts if lo < c < hi}), hi]
        out += list(zip(edges[:-1], edges[1:]))
    return out


def update_terms(factors: Sequence[float]) -> tuple[list[float], float]:
    """Per-gradient coefficients of the combined gradient, and the factor ``F`` on the learning rate."""
    mean = sum(factors) / len(factors)
    return [f / (len(factors) * mean) for f in factors], mean


class ShardOptimizer:
    """A torch optimizer over ``params`` (one shard's slice of trainable parameters), stepped in chunks.

    ``groups`` (:func:`hpcps.training.paramgroups.shard_groups`) cut the slice into
    param groups with their own options; default: one group of it all.
    ``make`` receives the groups as torch.optim param groups of chunks (1-D
    float32 views of ``params``, at most ``chunk`` values each, never
    across two groups) and returns the optimizer; the optimizer's own
    learning rates at construction are the base rates that ``schedule`` and
    the per-update factors multiply (as ``initial_lr`` in torch's schedulers).
    """

    def __init__(self, params: torch.Tensor, make: OptimizerFactory, schedule: Schedule, *,
                 chunk: int = APPLY_CHUNK, groups: list | None = None, indices: Sequence[int] | None = None,
                 cuts: Sequence[int] = ()) -> None:
        """``cuts``: places in the slice no chunk crosses besides the groups' ends (a shard that steps its
        slice a piece at a time, :meth:`step_range`, cuts it at its pieces)."""
        n = params.numel()
        self.chunk = chunk
        if groups is None:
            groups = [({}, [(0, n)], [])] if n else []
        #: each of this shard's groups' index among the run's groups (a shard may hold some groups only)
        self.indices = list(indices) if indices is not None else list(range(len(groups)))
        param_groups = []
        self.spans: list[tuple[int, int]] = []  # each chunk's place in the slice, group by group
        #: the chunks without ``cuts``: how a checkpoint that does not say how its state was cut has it
        self.uncut_spans: list[tuple[int, int]] = []
        for options, segments, parts in groups:
            uncut = [(lo, min(lo + chunk, b)) for a, b in segments for lo in range(a, b, chunk)]
            spans = _cut(uncut, cuts)
            param_groups.append({"params": [params[lo:hi] for lo, hi in spans],
                                 "names": [name for name, _, _ in parts], "ranges": list(parts), **options})
            self.spans += spans
            self.uncut_spans += uncut
        self.chunks = [c for g in param_groups for c in g["params"]]
        self.schedule = schedule
        self.optimizer = make(param_groups) if self.chunks else None
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(self.optimizer).__name__}, "
                            "not a torch.optim.Optimizer")
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []
        #: the rate the factory gave its optimizer (torch.optim's ``defaults``), the same on every shard
        self.default_lr = float(self.optimizer.defaults["lr"]) if self.optimizer else None
        #: the base rate the run file records an update at: ``default_lr``, or the rate of the run's first
        #: group as the loop last set it (:meth:`set_hyper`)
        self.recorded_lr = self.default_lr
        self._built = ([{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
                       if self.optimizer else [], list(self.base_lrs))  # for reset_hyper
        self._sum: torch.Tensor | None = None  # the combined gradient of multi-gradient updates
        self._set_momenta: list[tuple[dict, float]] = []  # momenta an update's begin() lowered, to restore
        #: the rule that lowers momentum by what staleness adds (:mod:`hpcps.training.momentum`); None: off
        self.stale: StaleMomentum | None = None
        #: the first group's momentum at the last update, as applied (NaN: the optimizer has none), and the
        #: factor the rule multiplied its rate by
        self.momentum, self.rate_factor = math.nan, 1.0

    def reset_hyper(self) -> None:
        """Back to the hyperparameters the optimizer was built with (for a worker whose loop never set any,
        while another's did)."""
        groups, base_lrs = self._built
        for group, values in zip(self.optimizer.param_groups if self.optimizer else [], groups):
            group.update(values)
        self.base_lrs = list(base_lrs)
        self.recorded_lr = self.default_lr

    def set_hyper(self, values: Sequence[dict[str, Any]]) -> None:
        """The hyperparameters of the run's groups as a worker's loop set them (:mod:`hpcps.training.hyper`),
        for the next steps: ``lr`` becomes each group's base rate (the schedule and the factors still
        multiply it), every other key is set on the torch group as it is."""
        if self.optimizer is None:
            return
        for t, group in enumerate(self.optimizer.param_groups):
            for key, value in values[self.indices[t]].items():
                if key == "lr":
                    self.base_lrs[t] = float(value)
                else:
                    group[key] = value
        if values and "lr" in values[0]:
            self.recorded_lr = float(values[0]["lr"])

    def step(self, grads: Sequence[torch.Tensor], coeffs: Sequence[float], *, version: int, factor: float,
             progress: Callable[[], object] = lambda: None, staleness: float = 0.0) -> int:
        """One update from ``sum(c * g)`` at learning-rate multiplier ``schedule(version) x factor``, its
        gradients ``staleness`` versions old (their mean): with :attr:`stale` each group's momentum is
        lowered, and its rate raised, as :class:`~hpcps.training.momentum.StaleMomentum` says, for this
        update only (the group keeps the momentum the user set).

        Returns the number of chunks stepped (= progress calls).
        """
        if self.optimizer is None:
            return 0
        self.begin(version=version, factor=factor, staleness=staleness)
        try:
            return self._step(grads, coeffs, progress)
        finally:
            self.end()

    def begin(self, *, version: int, factor: float, staleness: float = 0.0) -> None:
        """Set the groups' rates (and momenta) for one update, which :meth:`step_range` then applies a piece
        at a time, and :meth:`end` closes (:meth:`step` is the three at once)."""
        if self.optimizer is None:
            return
        scale = self.schedule(version) * factor
        if self.stale is not None:
            self.stale.observe(staleness)
        self._set_momenta = []
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * scale
            momentum = group.get("momentum")
            if self.stale is not None and momentum:
                explicit, rate = self.stale.adjusted(momentum)
                self._set_momenta.append((group, momentum))
                group["momentum"], group["lr"] = explicit, group["lr"] * rate
        first = self.optimizer.param_groups[0]
        self.momentum = float(first["momentum"]) if "momentum" in first else math.nan
        self.rate_factor = first["lr"] / (self.base_lrs[0] * scale) if self.base_lrs[0] * scale else 1.0

    def step_range(self, grad: torch.Tensor, coeff: float, lo: int, hi: int,
                   progress: Callable[[], object] = lambda: None) -> int:
        """Between :meth:`begin` and :meth:`end`: step the chunks in ``[lo, hi)`` of the slice from
        ``coeff * grad`` (``grad`` over the whole slice); ``lo`` and ``hi`` must be chunk edges (``cuts``).
        Each chunk is stepped as :meth:`step` steps it, so an update taken a piece at a time is the
        same to the last bit. Returns the chunks stepped."""
        stepped = 0
        for k, (a, b) in enumerate(self.spans if self.optimizer is not None else ()):
            if a < hi and lo < b:
                if a < lo or b > hi:
                    raise ValueError(f"[{lo}, {hi}) cuts the optimizer's chunk [{a}, {b}): give it as a cut")
                self._step_chunk(k, [grad], [coeff])
                progress()
                stepped += 1
        return stepped

    def end(self) -> None:
        """The update is applied: the groups keep the momentum the user set."""
        for group, momentum in self._set_momenta:
            group["momentum"] = momentum
        self._set_momenta = []

    def _step(self, grads: Sequence[torch.Tensor], coeffs: Sequence[float], progress: Callable[[], object]) -> int:
        for k in range(len(self.chunks)):
            self._step_chunk(k, grads, coeffs)
            progress()
        return len(self.chunks)

    def _step_chunk(self, k: int, grads: Sequence[torch.Tensor], coeffs: Sequence[float]) -> None:
        """Step chunk ``k`` alone (the others' ``.grad`` unset) from ``sum(c * g)`` over its span."""
        chunk, (lo, hi) = self.chunks[k], self.spans[k]
        # step straight from the received gradient (an fp32 one: a 16-bit payload is widened into the sum)
        if len(grads) == 1 and coeffs[0] == 1.0 and grads[0].dtype == torch.float32:
            chunk.grad = grads[0][lo:hi]
        else:
            if self._sum is None:
                self._sum = torch.empty(sum(c.numel() for c in self.chunks), dtype=torch.float32,
                                        device=self.chunks[0].device)
            total = self._sum[lo:hi]
            torch.mul(grads[0][lo:hi], coeffs[0], out=total)
            for g, c in zip(grads[1:], coeffs[1:]):
                total.add_(g[lo:hi], alpha=c)
            chunk.grad = total
        self.optimizer.step()
        chunk.grad = None

    def state_dict(self) -> dict:
        """The optimizer's state dict, its tensors in host memory whatever device the slice is on (a
        checkpoint's and ``ps.optimizer``'s readers take numpy views of them; ``load_state_dict`` puts
        them back on the slice's device, as torch.optim does)."""
        if self.optimizer is None:
            return {}
        state = self.optimizer.state_dict()
        if self.chunks[0].device.type != "cpu":
            state = {**state, "state": {k: {name: v.cpu() if isinstance(v, torch.Tensor) else v
                                             for name, v in entry.items()}
                                         for k, entry in state["state"].items()}}
        return state

    def load_state_dict(self, state: dict, spans: Sequence[tuple[int, int]] | None = None) -> None:
        """torch.optim's ``load_state_dict``, after checking that every tensor of the state is the shape of
        the chunk it belongs to: torch loads a momentum of another length without a word, and the fused
        kernels then read past it (a checkpoint's state cut otherwise than these chunks ended in values
        of 1e15). ``spans``: the chunks the state was cut at, where not these (a checkpoint written by a
        shard that cut its slice otherwise, :attr:`uncut_spans` or finer): it is cut again at these."""
        if self.optimizer is None or not state:
            return
        if spans is not None and [tuple(s) for s in spans] != self.spans:
            length = max(b for _, b in self.spans)
            state = to_shard(from_shard(state, [tuple(s) for s in spans], length), self.spans, self.state_dict())
        for index, entry in state.get("state", {}).items():
            chunk = self.chunks[int(index)] if int(index) < len(self.chunks) else None
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and (
                        chunk is None or value.shape != chunk.shape):
                    raise ValueError(f"optimizer state {name!r} of chunk {index} has shape {tuple(value.shape)}, "
                                     f"the chunk {tuple(chunk.shape) if chunk is not None else 'none'}: "
                                     "the state was cut for other slices")
        self.optimizer.load_state_dict(state)


def describe_optimizer(optimizer: ShardOptimizer, groups: Sequence[Any] = ()) -> dict[str, Any]:
    """What ran, as the run file and checkpoints record it: the torch.optim class and the options it
    was built with (a factory's own, whatever ``--optimizer`` and ``--lr`` said), and the param
    groups' options (:func:`hpcps.training.paramgroups.describe_groups`)."""
    from hpcps.training.paramgroups import describe_groups

    opt = optimizer.optimizer
    if opt is None:
        return {}

    def plain(value: Any) -> Any:
        if isinstance(value, (bool, int, float, str)) or value is None:
            return value
        if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
            return list(value)
        return repr(value)

    return {"class": f"{type(opt).__module__}.{type(opt).__qualname__}",
            "defaults": {k: plain(v) for k, v in sorted(opt.defaults.items())},
            "param_groups": describe_groups(groups)}
