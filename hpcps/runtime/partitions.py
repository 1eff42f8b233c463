"""Partitioned, prioritised pulls (``--partition-mb``): the parameters arrive in the order the forward
pass uses them, and each layer starts as soon as its own have arrived.

Without partitions a worker waits for the whole pull before its pass begins, so over a slow link the
first layer waits for the last layer's bytes. P3 (Jayarajan et al., SysML 2019) and ByteScheduler
(Peng et al., SOSP 2019) send the model in partitions, the first layers' first, and start the forward
pass on what has come: the rest of the pull moves while the first layers compute.

* **The plan** (:func:`plan`, pure): the flat vector's ranges in the order a pass wants them, packed
  into partitions of at most ``--partition-mb``: first the model's floating-point buffers (a pass notes
  them before it starts, and BatchNorm writes them in its forward) and the parameters of modules the
  pass did not call (they may be used by some other module's code), then each module's parameters in
  the order the forward pass first calls the modules (registration order until a pass has been seen).
* **The hooks** (:class:`PartitionedPulls`): a forward pre-hook on every module that holds parameters
  waits for the partitions holding them. The pull's versions are read before any partition, so the
  step knows what it computes on at once; the worker settles the rest of the pull before it pushes.

On a CPU worker a pull lands in the model's own memory. On a GPU a pull lands in pinned host memory,
and each partition goes up to the device as soon as it has come (``upload``, an asynchronous copy that
the device's stream orders before the layer's compute). A module whose code reads another module's
parameters before that module is called (rather than through a shared ``Parameter``) would read them
before they arrive: train such a model without ``--partition-mb``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from hpcps.metrics.timeline import NullTimeline

FIRST = "first"  # the plan's key of what a pass wants before it starts


@dataclass(frozen=True)
class Plan:
    """``parts``: each partition's ``(lo, hi)`` ranges of the flat vector, in the order they are pulled;
    ``needs``: the partitions each key (a module) waits for; ``first``: those wanted before the pass."""

    parts: list[list[tuple[int, int]]]
    needs: dict[Hashable, tuple[int, ...]] = field(default_factory=dict)
    first: tuple[int, ...] = ()


def plan(owners: Sequence[tuple[Hashable, Sequence[tuple[int, int]]]], first: Sequence[tuple[int, int]],
         size: int) -> Plan:
    """Pack ``first``'s ranges, then each owner's (in order), into partitions of at most ``size`` elements.

    A range split over two partitions is needed from both; a range listed again (a parameter two modules
    share) is where it was first put. Adjacent ranges within a partition are merged (one copy each)."""
    if size < 1:
        raise ValueError("a partition holds at least one element")
    parts: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    fill = 0
    placed: dict[tuple[int, int], set[int]] = {}
    needs: dict[Hashable, set[int]] = {}

    def add(key: Hashable, lo: int, hi: int) -> None:
        nonlocal current, fill
        if (lo, hi) in placed:
            needs.setdefault(key, set()).update(placed[(lo, hi)])
            return
        into: set[int] = set()
        a = lo
        while a < hi:
            take = min(hi - a, size - fill)
            if current and current[-1][1] == a:
                current[-1] = (current[-1][0], a + take)
            else:
                current.append((a, a + take))
            into.add(len(parts))
            fill, a = fill + take, a + take
            if fill == size:
                parts.append(current)
                current, fill = [], 0
        placed[(lo, hi)] = into
        needs.setdefault(key, set()).update(into)

    for lo, hi in first:
        add(FIRST, lo, hi)
    for key, ranges in owners:
        for lo, hi in ranges:
            add(key, lo, hi)
    if current:
        parts.append(current)
    ordered = {key: tuple(sorted(ks)) for key, ks in needs.items()}
    return Plan(parts, ordered, ordered.get(FIRST, ()))


class PartitionedPulls:
    """A worker's partitioned pulls: the plan for its model, the hooks, the pull in flight.

    ``spans``: ``FlatParameters._spans`` (each parameter's and buffer's offset in the flat vector);
    ``size``: elements per partition; ``timeline``: where waits go (phase ``pull``).
    """

    def __init__(self, model: torch.nn.Module, spans, size: int, *, timeline=None,
                 clock: Callable[[], float] = time.perf_counter,
                 upload: Callable[[list[tuple[int, int]]], None] | None = None) -> None:
        """``upload(ranges)``: bring those ranges of the host parameters to the device, once a partition
        holding them has come (a GPU worker's; None where the pull lands in the model itself)."""
        self.size, self.clock, self.upload = size, clock, upload
        self.uploaded: list[bool] = []  # per partition of the pull in flight: gone up to the device
        self.tl = timeline or NullTimeline()
        self.offsets = {id(p): (off, off + n) for p, _, _, off, n in spans if p is not None}
        self.buffers = [(off, off + n) for p, _, _, off, n in spans if p is None]
        self.modules = [m for m in model.modules() if self._ranges(m)]
        self.plan = self._plan(self.modules, uncalled=[])
        self.seen: list[torch.nn.Module] = []  # the order the passes call the modules in
        self.learned = False  # whether the plan follows a pass's order yet (until then pulls are waited whole)
        self.pull = None
        self.waited = 0.0  # seconds the pass under way waited for partitions
        self.handles = [m.register_forward_pre_hook(self._hook(m)) for m in self.modules]

    def _ranges(self, module: torch.nn.Module) -> list[tuple[int, int]]:
        return [self.offsets[id(p)] for p in module._parameters.values() if p is not None and id(p) in self.offsets]

    def _plan(self, order: list[torch.nn.Module], uncalled: list[torch.nn.Module]) -> Plan:
        first = self.buffers + [r for m in uncalled for r in self._ranges(m)]
        return plan([(id(m), self._ranges(m)) for m in order], first, self.size)

    def _hook(self, module: torch.nn.Module):
        def before_forward(_module, _args) -> None:
            if not self.learned and module not in self.seen:
                self.seen.append(module)
            self.wait_for(id(module))
        return before_forward

    # -- driven by the worker ------------------------------------------------------------------------

    def begin(self, window, out, backoff):
        """Start a pull of ``window`` into ``out`` in this plan's partitions, in its order."""
        return window.begin_pull(out, backoff, parts=self.plan.parts)

    def start(self, pull) -> tuple:
        """The pull the next pass computes on: wait for its versions and for what the pass wants before it
        starts (the buffers); return (versions, stop). Until a pass has shown the forward order, the
        pull is waited for whole."""
        self.waited = 0.0
        versions, stop = pull.versions()
        self.pull = pull
        self.uploaded = [False] * pull.n_parts
        if not self.learned:
            self.settle()
            return versions, stop
        for k in self.plan.first:
            self._wait_part(k)
        return versions, stop

    def _wait_part(self, k: int) -> None:
        """Wait for partition ``k`` of the pull in flight; on a GPU, send it up (once)."""
        self.pull.wait_part(k)
        if self.upload is not None and k < len(self.uploaded) and not self.uploaded[k]:
            self.uploaded[k] = True
            self.upload(self.pull.ranges[k])

    def wait_for(self, key) -> None:
        """Before a module's forward: wait for its partitions (the time goes to ``waited``, and to the
        timeline's ``pull``)."""
        pull = self.pull
        if pull is None:
            return
        needs = [k for k in self.plan.needs.get(key, ()) if k < pull.n_parts and not pull.done[k]]
        if not needs:
            return
        t = self.clock()
        with self.tl.within("pull"):
            for k in needs:
                self._wait_part(k)
        self.waited += self.clock() - t

    def settle(self) -> None:
        """Before the worker pushes (or pulls again): the rest of the pull in flight, unpinned. After the
        first pass, the plan follows the order it called the modules in."""
        if self.pull is not None:
            for k in range(self.pull.n_parts):
                self._wait_part(k)
            self.pull.wait()
            self.pull = None
        if not self.learned and self.seen:
            self.plan = self._plan(self.seen, [m for m in self.modules if m not in self.seen])
            self.learned = True

    def poke(self) -> None:
        """While the worker computes: move the copies in flight (MPI progress)."""
        if self.pull is not None:
            self.pull.test()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
