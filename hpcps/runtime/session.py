"""The step API: one rank's part of a run, driven by a training loop (the user's, or hpcps's own).

On a worker rank a :class:`Session` turns the loop's ``backward(); step()``
into the paradigm's protocol: :meth:`Session.step` takes the gradient that
backward left in the model's ``.grad`` (a view of the flat buffer, see
:mod:`hpcps.training.flat`), pushes it, waits as the paradigm says (BSP's round,
SSP's and DSSP's bound, eager's decoupled pull, hsp's turn and extras,
grouped's group round) and leaves the model holding the parameters the next
step computes on. Between two calls the loop may do anything torch allows:
several backward passes (they accumulate: gradient accumulation), clipping,
``GradScaler`` (through :attr:`Session.optimizer`), evaluation, logging.

On a server rank there is nothing to drive: :func:`hpcps.init` serves until
every worker has left and hands back a finished Session (``is_worker``
False, :attr:`Session.result` on rank 0).

hpcps's built-in loop (:meth:`Session.train_on`, behind ``hpcps.train`` and
``hpcps train``) is a client of this API like any other: one loop, not two.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
from mpi4py import MPI

from hpcps.data.batches import BatchSource, to_device
from hpcps.runtime.checkpoints.files import LoopState, read_loop_state, restore_int_buffers
from hpcps.cluster.emulation import EmulatedCompute, emulated_compute_time
from hpcps.runtime import assembly
from hpcps.runtime.collectives import WorkerCollectives
from hpcps.runtime.checkpoints.loop import LoopCheckpoints
from hpcps.runtime.inner import InnerRounds
from hpcps.runtime.losses import LossCapture
from hpcps.options.effects import own_loop
from hpcps.transport.compress import all_finite
from hpcps.transport.poll import Backoff, StallWatch, wait_until
from hpcps.training.hyper import EditTracker, servers_template, template
from hpcps.training.local import LocalSteps
from hpcps.training.optim import builtin_optimizer
from hpcps.training.optstate import cut, from_torch, join, to_torch
from hpcps.runtime.optstate import ask, hand

if TYPE_CHECKING:
    from hpcps.runtime.run import Run

log = logging.getLogger("hpcps")


class _LoopCalls:
    """What a worker's loop tells the run besides its steps (a mixin of :class:`Session`, whose attributes it
    reads): its own numbers (:meth:`log`), its evaluation (:meth:`evaluated`), an early stop (:meth:`stop`),
    and the workers' collectives (:meth:`mean`, :meth:`workers_barrier`)."""

    def stop(self, reason: str = "") -> None:
        """End the run for every worker (early stopping): each shard's stop flag goes up, and every
        worker's :attr:`running` turns False once its current step is done (under a paradigm of rounds, bsp's,
        at the close of the round under way: every worker ends at the same round), as after a signal. The run
        is recorded as stopped by the loop (``stopped_by`` ``loop``, or ``loop: <reason>``) and writes a
        checkpoint to resume from, as a signal's stop does."""
        if self.is_worker:
            signals = self.run.state.signals
            signals.acted = signals.acted or ("loop: " + reason if reason else "loop")
            self.worker.window.request_stop()

    @property
    def stopped(self) -> bool:
        """True once somebody stopped the run (a signal, :meth:`stop`, a target) before its steps were done: a
        loop that validates at an epoch's end tells a stop mid-epoch from its last step."""
        return self.is_worker and bool(self.worker.stop)

    def log(self, **scalars: float) -> None:
        """The loop's own numbers for this step (``ps.log(val_loss=1.7)``): rows of ``/workers/scalars``
        (this rank, the step, the run's clock, name, value) in the run's metrics file."""
        if not self.is_worker:
            return
        t, step = self.run.clock(), self.iteration
        for name, value in scalars.items():
            self.run.state.recorder.add("workers/scalars", (self.rank, step, t, name.encode()[:32], float(value)))

    def evaluated(self, **metrics: float) -> None:
        """The loop's own validation, recorded as the run's evaluation (``ps.evaluated(loss=2.1,
        accuracy=0.64, perplexity=8.2)``): worker 0's call is a row of ``/eval`` (``loss``, ``accuracy``)
        and of ``/eval_metrics`` (any other name) at the run's clock and the version the model holds, as
        ``hpcps.train``'s evaluation on the servers writes them, so the summary's final loss and accuracy,
        ``time_to_target_s`` and ``hpcps report`` use them. Another worker's call records nothing (give
        every worker the same values with :meth:`mean`, or evaluate on worker 0 alone). With
        ``target="accuracy>=0.9"`` (or any metric given here), reaching it stops every worker after its
        step under way, as hpcps.train's target does."""
        if not self.is_worker or self.worker_index != 0:
            return
        self._evaluated = True
        t, version = self.run.clock(), self.version
        values = {name: float(value.detach() if torch.is_tensor(value) else value) for name, value in metrics.items()}
        row = (t, version, values.get("loss", math.nan), values.get("accuracy", math.nan))
        self.run.state.recorder.add("eval", row)
        for name, value in values.items():
            if name not in ("loss", "accuracy"):
                self.run.state.recorder.add("eval_metrics", (t, version, name.encode()[:32], value))
        target = self.run.plan.cfg.stop_target
        if target is not None and not self._target_reached and target.reached(values.get(target.name, math.nan)):
            self._target_reached = True
            log.info("target %s reached at t=%.2fs (%s %.4f): stopping", target, t, target.name, values[target.name])
            self.worker.window.request_stop()

    def mean(self, value):
        """Collective over the workers: ``value`` (a number, a tensor or an array, the same shape on
        every worker) averaged over them, of the same kind (a tensor on its device): ``hvd.allreduce``
        of a validation metric. Every worker must call it at the same point of its loop; while it
        waits, this worker's transfers keep moving. Under run-through (ULFM) after a worker died: over
        the living."""
        if not self.is_worker:
            raise RuntimeError("ps.mean: call it on the worker ranks (every worker, at the same point)")
        return self.collectives.mean(value, "every worker's ps.mean (each calls it at the same point of its loop, "
                                            "while ps.running)")

    def workers_barrier(self) -> None:
        """Collective over the workers (the living, after a death under run-through): return once every
        worker has called it."""
        self.collectives.run(lambda comm: comm.Ibarrier(),
                             "every worker at ps.optimizer.load_state_dict (each calls it, between the same steps)")


class Session(_LoopCalls):
    """One rank's part of a run; see the module docstring.

    A Session is used once: on a worker, ``while ps.running: ...; ps.step()``
    and then :meth:`close` (collective: every rank's session must close,
    servers' sessions come closed). In a ``with`` block a failure on this
    rank ends the job on every rank (``MPI_Abort``) instead of leaving the
    others waiting.
    """

    def __init__(self, run: "Run", *, abort_on_error: bool = True, overlap_pull: bool = False) -> None:
        self.run = run
        self.abort_on_error = abort_on_error
        #: with ``--partition-mb``: let the next step's pull land while the loop runs on, each layer's part
        #: waited for by its forward pre-hook (the overlap partitions exist for), instead of the whole pull
        #: settled before :meth:`step` returns. Then what the loop reads of the parameters between ``step()``
        #: and its next forward may be a mix of two versions, unless it calls :meth:`settle` first.
        self.overlap_pull = overlap_pull
        self.result = None  # rank 0: the RunResult once closed
        self.closed = False
        self.state: dict[str, Any] = {}  # the user's own checkpoint fields (worker 0's are saved)
        layout, rank = run.plan.layout, run.state.topo.rank
        self.is_worker = run.state.index is not None  # a worker, or a spare in a dead worker's place
        self.rank = rank
        self.n_workers = layout.n_workers
        self.worker_index = run.state.index
        self.model = run.state.model
        self.path = run.state.path  # the run file (HDF5), which rank 0 writes
        self._optimizer = None
        self._resumed_groups: list | None = None  # ps.optimizer's hyperparameters as a checkpointed loop left them
        #: where the model lives (``cuda:<i>`` on a GPU worker): the loop puts its batches there
        self.device = run.state.flat.device if self.is_worker else torch.device("cpu")
        if not self.is_worker:
            return
        cfg = run.plan.cfg
        self.flat = run.state.flat
        self.clip_norm = cfg.clip_norm
        loop = read_loop_state(cfg.resume) if run.plan.ckpt is not None else LoopState()
        self.state = loop.fields
        self._resumed_groups = loop.param_groups
        restore_int_buffers(self.model, loop.int_buffers)
        self._opens_with = "compute"  # the phase a step's time begins in: the user's code until ps.step
        self.worker, self._transfers = assembly.make_worker(run.plan, run.state)
        #: under --local-steps: the worker's inner optimizer and its rounds (hpcps.training.local)
        self.local: LocalSteps | None = None
        if cfg.inner_steps is not None:
            self.local = LocalSteps(self.model, self.flat, builtin_optimizer(
                cfg.inner_optimizer, lr=cfg.inner_lr, momentum=cfg.inner_momentum,
                weight_decay=cfg.inner_weight_decay, fused=cfg.fused), every=cfg.inner_steps, steps=run.plan.steps)
            self.inner = InnerRounds(self.local, run, self.worker_index, rank)
            self.inner.resume()
        self._waited0 = 0.0
        #: the workers alone, for :meth:`mean` and the collectives of ``ps.optimizer`` (a duplicate: the
        #: loop's traffic never meets hpcps's). A spare in a dead worker's place has none to share: its
        #: role's communicator holds the other spares, idle, and a duplicate of it would wait for them (the
        #: loops that use these collectives, your own and --local-steps-by-speed, take no spares)
        self.collectives = WorkerCollectives(
            (MPI.COMM_SELF if run.state.placed_at is not None else run.state.topo.role_comm).Dup(), self._wait,
            dead=run.state.dead, run_comm=run.state.topo.comm, rank=rank)
        self._target_reached = self._evaluated = False
        #: the loss of a step the loop steps without naming it (optimizer.step(), scaler.step(optimizer))
        self.losses = LossCapture(warn=self.worker_index == 0).open()
        pushes = self.worker.backward_pushes
        #: the emulated compute (hpcps.cluster.emulation), after the worker's own hooks and before the backward
        #: pushes' (put on at the first push): a layer's parameters come before its compute, compute before send
        self.compute = EmulatedCompute(
            self.model, cfg, emulated_compute_time(cfg, rank, layout, self.worker_index), rank, clock=run.clock,
            poke=self.worker.poke, timeline=self.worker.tl, pushes_in_backward=pushes is not None,
            spent=lambda: time.perf_counter() - self.t0 - self.worker.pass_waited,
            armed=lambda: pushes is not None and pushes.armed)
        # worker 0's loop belongs to bsp's checkpoints, at a round's close (hpcps.runtime.checkpoints.loop)
        at_publish = run.plan.paradigm.checkpoints_at_publish()
        self.loop_checkpoints = LoopCheckpoints(
            self.model, run.state.ckpt_dir, cfg.checkpoint_every if at_publish and self.worker_index == 0 else None,
            self.loop_state, saved_at=int(run.plan.ckpt.version) if run.plan.ckpt is not None else None)
        self.worker.begin()
        self.open = False
        self._open()
        if self._resumed_groups is not None:
            _ = self.optimizer  # the checkpointed loop's hyperparameters leave with the first push

    # -- what the loop reads ------------------------------------------------
    @property
    def running(self) -> bool:
        """True while another step is due: ``steps`` not reached, nobody stopped the run (a signal,
        ``target_accuracy``). A loop that runs on after False only gets False from :meth:`step`."""
        return self.is_worker and self.open

    @property
    def iteration(self) -> int:
        """The step being computed (0 first; where a resumed run continues). Under ``--local-steps H`` it
        counts inner steps (the batches), H to a round."""
        if not self.is_worker:
            return 0
        if self.local is None:
            return self.worker.step
        return self.worker.step * self.local.every + self.local.taken

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer | None:
        """Under ``--local-steps``: the worker's own inner optimizer (``--inner-optimizer``), a plain torch
        optimizer over the model's parameters, stepped by each ``ps.step()``; a ``torch.optim.lr_scheduler``
        on it schedules the inner rate. Its state is the worker's and is checkpointed with the run. None
        without local steps (:attr:`optimizer` is the servers', the outer one)."""
        return self.local.optimizer if self.is_worker and self.local is not None else None

    @property
    def version(self) -> int:
        """The global version (updates applied, lowest over the shards) the current step computes on."""
        return int(self.worker.versions.min()) if self.is_worker else 0

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The servers' optimizer as the loop sees it: their param groups and hyperparameters, which the
        loop may edit by hand or through any ``torch.optim.lr_scheduler`` (each edit travels with the next
        push: :mod:`hpcps.training.hyper`); ``GradScaler`` (``scaler.unscale_(ps.optimizer)``,
        ``scaler.step(ps.optimizer)``: its ``step`` is this session's :meth:`step`, skipped when the
        scaler found Inf or NaN); ``zero_grad``."""
        if self._optimizer is None:
            self._optimizer = StepOptimizer(self)
        return self._optimizer

    # -- the step -------------------------------------------------------------
    def step(self, loss: torch.Tensor | float | None = None, *, skip: bool = False) -> bool:
        """Push the gradient of this step (what backward accumulated in ``.grad`` since the last
        step), wait as the paradigm says, and bring in the parameters of the next; return
        :attr:`running`. ``loss`` goes to the iteration's row; without it, the sum of the scalars
        backward ran from since the last step (:mod:`hpcps.runtime.losses`); ``skip`` pushes the
        step as skipped: it counts in its round (nobody waits for it) and is never applied.
        Under ``--local-steps H`` it steps the worker's :attr:`inner_optimizer` instead (not for a
        ``skip``ped step), and every H-th call pushes the round's pseudo-gradient and waits as the
        paradigm says (:mod:`hpcps.training.local`); the round's row records the mean of the losses."""
        if not self.running:
            return False
        self.loop_checkpoints.save_due()
        if self._optimizer is not None:  # this is ps.optimizer's step: torch's schedulers check that it ran
            self._optimizer._opt_called = True
        self.flat.adopt_grads()
        # a partitioned pull's waits in the pass are not compute
        t0 = self.t0 + self.worker.pass_waited - self._waited0
        self.compute.end_pass(self.flat, t0, self.clip_norm)
        value = self.losses.value(loss)
        compute_s = time.perf_counter() - t0
        if self.local is not None:
            if not skip and not all_finite(self.flat.grads_t[:self.flat.n_params]):
                skip = self.inner.nonfinite_step(self.iteration)
            self.local.inner_step(skip)
            self.inner.record(compute_s, value)
            over = self.local.round_over(self.worker.step)
            if self.worker.pending:  # --overlap-steps: the outer step the round's first steps hide
                if over or self.local.taken >= self.run.plan.cfg.overlap_steps:
                    self._take_round()
                else:
                    self.worker.poke()  # (its pull begins as soon as it may)
            if not over:
                self._begin_pass()  # the round's next inner step: nothing goes to the servers
                return True
            if self.run.plan.cfg.local_steps_by_speed and self.worker.step == self.worker.start_step:
                self.inner.share_by_speed(self.collectives)
            self.local.pseudo_gradient()
            if self.worker.defer_pull:
                self.local.mark_pushed()
            self.inner.write(self.worker.clock_count + 1)  # on disk before a checkpoint can count this round
            (value, compute_s), skip = self.inner.close_round(), False
        self.worker.close_step(value, compute_s, skip=skip)
        self._open()
        return self.open

    def settle(self) -> None:
        """Wait until the whole pull the current step computes on has landed in the model. Only needed with
        ``overlap_pull=True`` under ``--partition-mb``, before the loop reads the parameters (an EMA, a
        ``state_dict()``, a weight norm) between :meth:`step` and its next forward pass; otherwise
        :meth:`step` has done it. The wait counts as the step's pull time."""
        if self.is_worker:
            self.worker._settle_pull()

    def _wait(self, test: Callable[[], bool], what: str) -> None:
        """Poll ``test`` for a collective of the workers or a shard's answer, this worker's transfers moving
        between polls, under the run's stall watch (a warning every ``stall_warn`` seconds, a TimeoutError
        past ``stall_abort``, none if it is 0) naming ``what`` it waits for."""
        cfg = self.run.plan.cfg
        watch = StallWatch(warn=cfg.stall_warn, abort=cfg.stall_limit, log=log, error=TimeoutError,
                           describe=lambda: f"worker rank {self.rank} waiting for {what}")
        wait_until(lambda: self.worker.poke() or test(), Backoff(), watch)

    def _open(self) -> None:
        self.open = self.worker.open_step()
        if not self.open and self.worker.pending:
            self._take_round()  # the last round's outer step: the model ends on the servers' parameters
        else:
            self._note_version()  # (a take notes the version it brings)
        if not self.open:
            return
        if self.local is not None:
            if self.worker.pending:  # --overlap-steps: from the parameters just pushed, the pull to come
                self.local.begin_round(pulled=False)
            else:
                self.settle()  # a round starts from the whole pull: the parameters its pseudo-gradient is against
                self.local.begin_round()
        self._begin_pass()

    def _note_version(self) -> None:
        """The version the loop computes on now came in (bsp pulls at the end of every step: the final one too)."""
        self.loop_checkpoints.note_version(self.version)

    def _take_round(self) -> None:
        """``--overlap-steps``: the outer step of the round last pushed, which this round's first steps hid:
        its grant (where the paradigm waits) and its pull, then the rebase onto it
        (:meth:`hpcps.training.local.LocalSteps.rebase`)."""
        self.local.rebase(self.worker.take_round(self.worker.row if self.open else None), moved=self.open)
        self._note_version()

    def _begin_pass(self) -> None:
        """Before a step's computation: zero the gradients, note the buffers, start its clock."""
        self.flat.begin_pass()  # zero the gradients, note the buffers (after open_step's pull)
        self.compute.begin_pass()
        self.t0 = time.perf_counter()
        self._waited0 = self.worker.pass_waited if self.local is not None else 0.0
        self.worker.tl.enter(self._opens_with)
        if not self.overlap_pull:
            self.settle()  # (its wait is the step's pull time, not the loop's compute: step() takes it off)

    def loop_state(self) -> LoopState:
        """What a checkpoint keeps of this worker's loop: ``ps.state``, ``ps.optimizer``'s hyperparameters,
        the model's integer buffers."""
        groups = template(self._optimizer.param_groups) if self._optimizer is not None else None
        ints = {name: b.detach().cpu().clone() for name, b in self.model.named_buffers() if not b.is_floating_point()}
        return LoopState(self.state, groups, ints)

    # -- the built-in loop ------------------------------------------------------
    def train_on(self, batches: BatchSource, loss: Callable[[torch.nn.Module, Any], torch.Tensor]) -> None:
        """hpcps's own loop: batch ``k`` of ``batches`` for step ``k``, ``loss(model, batch)``, backward, step."""
        if not self.is_worker:
            return
        self._opens_with = "data"  # a step begins by reading its batch
        self.overlap_pull = True  # this loop reads no parameter between steps: each layer waits for its own
        tl = self.worker.tl
        if self.open:
            tl.relabel("data")  # the first step, opened already
        while self.running:
            tl.enter("data")
            batch = to_device(batches.batch(self.iteration), self.flat.device)
            tl.enter("compute")
            value = loss(self.model, batch)
            if self.compute.push_may_begin():  # one backward per step here: its push may begin now
                self.worker.before_backward()
            value.backward()
            self.step(value)

    # -- the end ----------------------------------------------------------------
    def close(self):
        """Collective: leave, and end the run with every other rank; return the
        :class:`~hpcps.runtime.run.RunResult` on rank 0 (None elsewhere). Idempotent."""
        if self.closed:
            return self.result
        self.closed = True
        if self.is_worker:
            self.loop_checkpoints.save_due()
            if self.local is not None and self.worker.stop:  # a stop's checkpoint resumes at this round
                self.inner.save(self.worker.clock_count)
            # (hpcps's own loop evaluates on the servers: the warning is for a loop of the user's)
            if (self.worker_index == 0 and self.run.plan.cfg.stop_target is not None and not self._evaluated
                    and own_loop(self.run.plan.cfg)):
                log.warning("target %s had no effect: in your own loop, the run's evaluation is what it gives "
                            "ps.evaluated(...), and it never called it", self.run.plan.cfg.stop_target)
            overran = self.compute.overruns.warning(self.rank)
            if overran:
                log.warning(overran)
            try:
                self.worker.finish()
            finally:
                self._remove_hooks()
                self.run.state.final_clock = assembly.free_worker(self.worker, self._transfers)
                self.collectives.free()
            self.result = self.run.end(loop=self.loop_state() if self.worker_index == 0 else None)
            self.run.__exit__(None, None, None)
        return self.result

    def _remove_hooks(self) -> None:
        """The model leaves the run as it came: without the emulation's hooks."""
        self.loop_checkpoints.remove()
        self.compute.remove()
        self.losses.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        if self.is_worker:
            self._remove_hooks()
            self.worker.close()
        if self.abort_on_error and not isinstance(exc, (KeyboardInterrupt,)):
            from hpcps.runtime.agree import end_job

            end_job(self.run.state.topo.comm, exc)


class StepOptimizer(torch.optim.Optimizer):
    """The optimizer of :attr:`Session.optimizer`: the model's trainable parameters in the servers'
    param groups, with the hyperparameters the servers' optimizer has (an edit reaches them with the
    next push), and no update rule of its own (the servers have it). ``step()`` is the session's step; ``GradScaler``
    calls it whatever it found (``_step_supports_amp_scaling``), with ``found_inf`` and
    ``grad_scale`` set, so a step the scaler skips is pushed as skipped and gradients it did not
    unscale are unscaled here. ``zero_grad`` zeroes the flat buffer in place."""

    _step_supports_amp_scaling = True

    def __init__(self, session: Session) -> None:
        run = session.run
        hyper, name = servers_template(run.plan.workload.optimizer_factory(run.plan.cfg), run.plan.groups,
                                       run.state.flat.n_params)
        named = dict(run.state.model.named_parameters())
        super().__init__([{"params": [named[n] for n, _, _ in group.ranges], **values}
                          for group, values in zip(run.plan.groups, hyper)], dict(hyper[0]))
        self.session = session
        # grouped: a worker's push goes to its group server, which sums its group's round for the central
        # shards; an edit cannot travel with one worker's gradient there
        self.grouped = run.state.topo.group != MPI.COMM_NULL
        self.tracker = EditTracker(hyper, lambda message: log.warning("%s", message), name)
        for group, values in zip(self.param_groups, session._resumed_groups or []):
            group.update(values)  # a resumed loop's rates: sent with the first push, as an edit
        self._grouped_told = False
        if session.is_worker:
            session.worker.hyper_edits = self._edits

    def _edits(self) -> list[dict] | None:
        """The param groups' hyperparameters if the loop changed them since the last push (the worker sends
        them to the shards ahead of this push), else None."""
        edits = self.tracker.edits(self.param_groups)
        if edits is not None and self.grouped:
            if not self._grouped_told:
                self._grouped_told = True
                log.warning("ps.optimizer: under the grouped paradigm the loop's edits of its param groups "
                            "do not reach the central shards, which apply --lr and its schedule (said once)")
            return None
        return edits

    @torch.no_grad()
    def step(self, closure=None, loss: torch.Tensor | float | None = None):
        """The session's :meth:`Session.step`, as torch and ``GradScaler`` call an optimizer's.

        ``closure()`` (if given) computes the loss, which the step records; else ``loss``
        (``scaler.step(ps.optimizer, loss=loss)`` passes it through) goes to the iteration's row; else the
        row takes the sum of the scalars ``backward()`` ran from since the last step, less a GradScaler's
        scale (:mod:`hpcps.runtime.losses`): ``optimizer.step()`` and ``scaler.step(optimizer)`` as a DDP
        script has them record their loss. A step the scaler found Inf or NaN in is pushed as skipped;
        gradients it did not unscale are unscaled here. Returns the loss (as given or computed)."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        skip = found_inf is not None and bool(found_inf.item())
        scale = getattr(self, "grad_scale", None)
        if scale is not None and not skip:  # the scaler did not unscale_ first: the gradients are scaled
            self.session.flat.adopt_grads()
            self.session.flat.grads_t[:self.session.flat.n_params].mul_(1.0 / float(scale))
        self.session.step(loss, skip=skip)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        self.session.flat.adopt_grads()
        self.session.flat.zero_grad()

    def _layout(self) -> tuple[list[tuple[int, int]], list[torch.Size]]:
        """Each parameter's place in the flat vector and its shape, numbered as torch numbers them in a state dict."""
        ranges = [(a, b) for group in self.session.run.plan.groups for _, a, b in group.ranges]
        shapes = [p.shape for group in self.param_groups for p in group["params"]]
        return ranges, shapes

    def _must_be_worker(self, what: str) -> None:
        if not self.session.is_worker or self.session.closed:
            raise RuntimeError(f"ps.optimizer.{what}: call it on a worker rank, before ps.close() "
                               "(the server shards answer while the run is on)")

    def state_dict(self) -> dict:
        """The servers' optimizer state, gathered from every shard, in torch's layout for the model's
        parameters (momentum buffers, Adam's moments and step, shaped as the parameters; param groups with
        the hyperparameters as this loop set them): what a torch optimizer over the model would save.
        Each shard answers with the state of the version it holds when asked; under bsp, the version this
        worker's last ``ps.step()`` brought in. ``torch.save`` it, or :meth:`load_state_dict` it into
        a run on any shard count, or into a plain torch optimizer over the same model."""
        self._must_be_worker("state_dict()")
        run = self.session.run
        parts = ask(run.state.topo.ps, run.plan.shards, self.session._wait)
        ranges, shapes = self._layout()
        groups = torch.optim.Optimizer.state_dict(self)["param_groups"]  # torch's numbering and the hyperparameters
        return to_torch(join(parts, run.plan.slices.put, run.state.flat.size), ranges, shapes, groups)

    def load_state_dict(self, state_dict: dict) -> None:
        """Collective over the workers (call it on every worker, between steps): the param groups'
        hyperparameters become this loop's (they reach the shards with the next push) and worker 0 hands
        the per-parameter state to the shards, each taking its slice; every worker returns once they all
        hold it. ``state_dict`` is :meth:`state_dict`'s, from any shard count, or a plain torch
        optimizer's over the same model and groups."""
        self._must_be_worker("load_state_dict()")
        session, run = self.session, self.session.run
        super().load_state_dict(state_dict)  # torch checks the groups and casts the state onto the parameters
        params = [p for group in self.param_groups for p in group["params"]]
        ranges, _ = self._layout()
        flat = from_torch({i: self.state[p] for i, p in enumerate(params) if p in self.state}, ranges,
                          run.state.flat.size)
        self.state.clear()  # the servers hold it; this optimizer keeps none
        if session.worker_index == 0:
            parts = [cut(flat, lambda v, s=s: run.plan.slices.take(s, v)) for s in run.plan.shards]
            hand(run.state.topo.ps, run.plan.shards, parts, session._wait)
        session.workers_barrier()
