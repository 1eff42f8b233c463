"""The Python API: train your own model, data, loss and optimizer with hpcps.

A script calls :func:`train` on every rank and is launched like
``hpcps train`` (``mpiexec -n 5 python train.py``, ``srun python train.py``)::

    import hpcps
    result = hpcps.train(model=make_net, data=train_set, test_data=test_set,
                         optimizer="adamw", lr=1e-3, lr_schedule="cosine", paradigm="dssp", steps=300)
    if result is not None:  # rank 0
        print(result.summary["final_accuracy"], result.saved)

A script with a training loop of its own keeps it: :func:`init` starts the
run and returns a :class:`~hpcps.runtime.session.Session` whose ``step()`` follows
the loop's ``backward()`` (the step API).

``hpcps train`` is a client of the same runtime (:func:`hpcps.runtime.run.run_training`):
the options are the same, under the same names (``batch_size`` for
``--batch-size``), validated by the same config model.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from hpcps.cluster.layout import Role
from hpcps.options.effects import OWN_LOOP
from hpcps.data.batches import is_dataset
from hpcps.options.config import make_config
from hpcps.errors import UserError
from hpcps.training.optim import OptimizerFactory, Schedule
from hpcps.training.paramgroups import GroupsSpec, decay_groups
from hpcps.runtime.run import RunResult
from hpcps.runtime.session import Session
from hpcps.training.workload import EvalFn, LossFn, Workload, data_source, resolve_dataset, resolve_loss, resolve_model


def _no_respawn(cfg) -> None:
    """``respawn=True`` is the command's: a process spawned in a dead worker's place runs ``hpcps train``'s
    own entry (:mod:`hpcps.runtime.newcomer`), which cannot build the model or data your script passes."""
    if cfg.respawn:
        raise UserError("respawn=True: a process spawned in a dead worker's place runs hpcps train's own entry, "
                        "which cannot rebuild what your script passes; use hpcps train --respawn, or "
                        "spare_workers=K (spares launched with the job)")


def train(model: Callable[..., torch.nn.Module] | torch.nn.Module | str, data: Any = "digits", *,
          test_data: torch.utils.data.Dataset | Iterable[Any] | None = None,
          loss: LossFn | str | None = None, evaluate: EvalFn | None = None,
          optimizer: OptimizerFactory | str | None = None, lr_schedule: Schedule | str | None = None,
          param_groups: GroupsSpec | None = None,
          config: str | None = None, comm=None, exit_on_error: bool = True, **options: Any) -> RunResult | None:
    """Collective over ``comm`` (default ``COMM_WORLD``): train, and return the result on rank 0
    (:class:`~hpcps.runtime.run.RunResult`: metrics path, summary, trained model and its ``state_dict``);
    None on every other rank.

    ``model``
        a factory returning a ``torch.nn.Module``, called on every rank right
        after ``torch.manual_seed(seed)`` (or the model itself, built by the script: the
        run starts from rank 0's parameters) (with ``in_shape``, ``n_classes``
        and ``hidden`` where it accepts them and the data tell them); or a
        built-in name or plug-in path, as ``--model`` takes. Afterwards
        worker ``i`` reseeds torch with ``seed + 1 + i`` (plus 1000003 x the
        step a resumed run starts at): every worker draws its own dropout
        masks and random batches.
    ``data``
        training data, loaded by workers only: a map-style ``Dataset``
        (hpcps shards it among the workers as ``DistributedSampler`` would,
        a new permutation every epoch); a batch factory
        ``(index, n_workers, seed, epoch) -> iterable of batches`` (which
        makes its own batches: ``batch_size`` is refused with one); a
        ``(train, test)`` pair; or a name, HDF5 file or plug-in, as ``--dataset``.
    ``test_data``
        held-out data, evaluated by rank 0: a Dataset or a re-iterable of
        batches. Without it a Dataset is split as ``test_fraction`` says,
        and a batch factory is not evaluated.
    ``loss``
        ``(model, batch) -> scalar tensor``; default cross-entropy on
        ``(x, y)`` batches.
    ``evaluate``
        ``(model, held-out batches) -> {name: value}``, called in eval mode
        under ``no_grad``; ``loss`` and ``accuracy`` go to ``/eval``, other
        names to ``/eval_metrics``. Default: the mean loss, and accuracy for
        integer labels.
    ``optimizer``
        ``"sgd"``, ``"adam"``, ``"adamw"`` (configured by ``lr``, ``momentum``,
        ``weight_decay``, ``betas``, ...), or a factory ``param_groups ->
        torch.optim.Optimizer`` run on every server shard over its slice
        (torch.optim param groups of 1-D float32 tensors; see :mod:`hpcps.training.paramgroups`).
    ``lr_schedule``
        ``"constant"``, ``"step"``, ``"cosine"`` (with ``warmup_steps``, ``min_lr``), or
        ``version -> multiplier`` of the optimizer's learning rate, the
        version being the number of updates the shard has applied.
    ``param_groups``
        the optimizer's parameter groups as torch.optim takes them (``params``:
        the model's tensors or their names, and each group's options), or a
        function of the model returning them (:func:`hpcps.decay_groups`: decay
        on tensors of two or more dimensions only).
    ``config``
        a TOML file of options; keyword ``options`` override it.
    ``options``
        every ``hpcps train`` option: ``paradigm``, ``steps``, ``lr``,
        ``batch_size``, ``servers``, ``slowdown``, ``out``, ``save``, ...
        ``paradigm`` also takes your own :class:`hpcps.Policy` subclass
        itself, and ``paradigm_option`` its options as a dict.
    ``exit_on_error``
        bad input ends every rank with one ``hpcps: error:`` line and exit
        status 2, any other failure ends the job (``MPI_Abort``) naming the
        rank; False raises instead (a failure on one rank may then leave
        the others waiting: for tests and interactive use).
    """
    from mpi4py import MPI

    from hpcps.runtime.agree import agree
    from hpcps.runtime.run import run_training
    from hpcps.runtime.tune import run_chosen

    comm = MPI.COMM_WORLD if comm is None else comm
    _check_launch(comm, exit_on_error)
    flags = _flags(options, model=model, dataset=data, loss=loss, optimizer=optimizer, lr_schedule=lr_schedule)

    def workload(cfg) -> Workload:
        """The user's objects, names and plug-ins resolved (on every rank: plug-ins may fail anywhere)."""
        if is_batch_factory(data) and "batch_size" in options:
            raise UserError("batch_size: a batch factory makes its own batches; drop batch_size")
        load, prepare = resolve_dataset(data, cfg.test_fraction) if isinstance(data, str) else (
            lambda: data_source(data, test_data, test_fraction=cfg.test_fraction, name=cfg.dataset), None)
        return Workload(
            model=resolve_model(model) if isinstance(model, str) else model, data=load, prepare=prepare,
            loss=resolve_loss(cfg.loss) if loss is None or isinstance(loss, str) else loss, evaluate=evaluate,
            optimizer=_object(optimizer), lr_schedule=_object(lr_schedule), model_name=cfg.model,
            param_groups=param_groups)

    def run() -> RunResult | None:
        cfg = agree(comm, lambda: make_config(flags, config_file=config, python=True))
        agree(comm, lambda: _no_respawn(cfg))
        work = agree(comm, lambda: workload(cfg))

        def trial(option, comm, leg=None):  # (--paradigm auto's: a model the script built is trained in place,
            # so a copy)
            given = dataclasses.replace(work, model=copy.deepcopy(work.model)) if work.given_model else work
            return run_training(option, comm, given, leg=leg)

        return run_chosen(cfg, comm, lambda c, comm, leg=None: run_training(c, comm, work, leg=leg), trial)[1]

    return _collectively(comm, run, exit_on_error)


def init(model: Callable[..., torch.nn.Module] | torch.nn.Module | str, *, optimizer: OptimizerFactory | str | None = None,
         lr_schedule: Schedule | str | None = None, param_groups: GroupsSpec | None = None,
         config: str | None = None, comm=None, exit_on_error: bool = True, overlap_pull: bool = False,
         reseed: bool = True, start_iteration: int = 0, **options: Any) -> Session:
    """Collective over ``comm``: start a run whose workers run the caller's own training loop (the
    step API); return this rank's :class:`~hpcps.runtime.session.Session`::

        ps = hpcps.init(make_model, optimizer="adamw", lr=6e-4, paradigm="ssp", steps=max_iters)
        with ps:
            while ps.running:                     # False once the run is over
                for _ in range(accumulation):
                    loss = ps.model(x, y) / accumulation
                    loss.backward()
                ps.step(loss)                     # push, wait as the paradigm says, pull
        # only workers get here: a server rank's process ended in init, once it had served

    **On a server rank** ``init`` serves until every worker has closed its session, and then
    ends the process (status 0, or 3 where the run diverged), as a launcher's server process
    would: every line of the script after ``init`` runs on the workers alone, as under DDP
    every line runs on a trainer. With ``exit_on_error=False`` (tests, interactive use: hpcps
    ends no process) it returns a closed session instead (``ps.is_worker`` False; rank 0's
    ``ps.result`` the run's :class:`~hpcps.runtime.run.RunResult`). On a worker rank the model
    (``ps.model``) holds the parameters of the first step; ``ps.path`` is the run file.

    ``model``, ``optimizer``, ``lr_schedule``, ``param_groups``, ``config``, ``comm``
    and ``exit_on_error`` are as :func:`train` takes them; ``model`` may also be the model the
    script built itself, as ``DDP(model)`` takes it: hpcps then draws nothing from torch's random
    stream to build it, and the run starts from rank 0's parameters (every rank's are replaced
    by them, as DDP broadcasts rank 0's). An uncaught exception
    anywhere in the script (inside ``with ps:`` or not) ends the job on every
    rank with one line naming the rank, as under ``python -m mpi4py``; with
    ``exit_on_error`` (the default) so does a worker's script that ends with
    its session open mid-run, and one whose loop ran out closes it at exit
    (:mod:`hpcps.runtime.guard`); ``options`` are
    :func:`train`'s, less the data's (the loop brings its own batches):
    ``steps`` is required (the most steps a worker takes: schedules and the
    progress line count on it; the loop may stop sooner), a number or a
    function of the worker count (``steps=lambda n_workers: epochs * math.ceil(
    len(data) / (n_workers * batch))``), for a loop whose steps follow from its
    share of the data.

    ``overlap_pull``
        with ``partition_mb``: ``ps.step()`` returns once the next step's
        versions and first partitions are in, and each layer's parameters
        land as the next forward pass reaches it (the overlap partitions
        exist for). The loop must then call ``ps.settle()`` before it reads
        the parameters outside a forward pass (an EMA, a ``state_dict()``,
        a weight norm), or it may read a mix of two versions. By default
        ``ps.step()`` settles the whole pull before it returns.

    ``reseed``
        by default worker ``i`` reseeds torch with ``seed + 1 + i`` once the model is built, so no two
        workers draw the same batches or dropout masks. ``reseed=False`` keeps the stream the script's own
        seeding gives (the model still built after ``torch.manual_seed(seed)``): with one worker and the
        original's seed, the run draws what the single-process script draws. Where every worker's stream
        is then at the same state, rank 0 says so: they would draw the same random batches.

    ``start_iteration``
        for a loop that resumes from a checkpoint of its own (nanoGPT's ``iter_num``, with the model's and
        ``ps.optimizer``'s state loaded by the script): the iteration it resumes at. ``ps.iteration`` starts
        there and ``steps`` stays the run's total; the shards start at the version an uninterrupted run
        would be at (k under bsp, k x workers where each gradient is an update), so the schedule, the eval
        rows and the run file's versions go on from there. The earlier run's file at ``out`` is kept under
        another name, as for every run (a run file is never overwritten). Not with ``resume=`` (hpcps's own
        checkpoints know where they were) nor under ``local_steps``.
    """
    from mpi4py import MPI

    from hpcps.runtime.agree import agree
    from hpcps.runtime.run import open_run

    comm = MPI.COMM_WORLD if comm is None else comm
    _check_launch(comm, exit_on_error)
    flags = _flags(options, model=model, optimizer=optimizer, lr_schedule=lr_schedule)
    flags.setdefault("dataset", OWN_LOOP)

    def check(cfg) -> Workload:
        if cfg.steps is None:
            raise UserError("steps: hpcps.init needs the most steps a worker will take (schedules and "
                            "progress count on it; the loop may stop sooner)")
        for name in ("batch_size", "epochs", "test_fraction", "eval_batch_size"):
            if name in options:
                raise UserError(f"{name}: the loop brings its own batches under hpcps.init; drop {name}")
        return Workload(model=resolve_model(model) if isinstance(model, str) else model, data=None,
                        optimizer=_object(optimizer), lr_schedule=_object(lr_schedule), model_name=cfg.model,
                        param_groups=param_groups)

    steps_of = flags.pop("steps") if callable(flags.get("steps")) else None

    def start() -> Session:
        if steps_of is not None:  # the steps of the worker count, which the layout knows before anything starts
            from hpcps.cluster.placement import node_ids
            from hpcps.options.planning import plan

            nodes = node_ids(comm)

            def count() -> int:
                layout = plan(make_config({**flags, "steps": 1}, config_file=config, python=True), comm.size, nodes)
                steps = steps_of(layout.n_workers)
                if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
                    raise UserError(f"steps: the function of the worker count returned {steps!r} for "
                                    f"{layout.n_workers} workers, not a positive whole number")
                return int(steps)
            flags["steps"] = agree(comm, count)
        cfg = agree(comm, lambda: make_config(flags, config_file=config, python=True))
        run = open_run(cfg, comm, agree(comm, lambda: check(cfg)), reseed=reseed, start_iteration=start_iteration)
        try:
            run.start()
            session = Session(run, abort_on_error=exit_on_error, overlap_pull=overlap_pull)
            if not session.is_worker:
                run.serve()
                session.result = run.end()
                session.closed = True
                run.__exit__(None, None, None)
            return session
        except BaseException:
            run.__exit__(*sys.exc_info())  # no collective frees: the other ranks may not be coming
            raise

    session = _collectively(comm, start, exit_on_error)
    if exit_on_error and not session.is_worker:
        _server_leaves(session)
    if exit_on_error:  # outside `with ps:` too, a rank that dies ends the job (python -m mpi4py's convention)
        from hpcps.runtime.guard import guard

        guard(session, comm)
    return session


def _server_leaves(session: Session) -> None:
    """A server rank's process ends once it has served, as a launcher's server process would: the script's
    lines after :func:`init` are the workers' alone. Status 0, or 3 where the run diverged (``hpcps
    train``'s); ``sys.exit``, so the script's ``finally`` blocks and exit handlers run, and MPI finalises."""
    from hpcps.errors import DIVERGED_STATUS
    from hpcps.transport.failures import end_without_the_dead

    status = DIVERGED_STATUS if session.run.state.stopped_by == "diverged" else 0
    end_without_the_dead(status)
    sys.exit(status)


@dataclass(frozen=True)
class World:
    """This rank's place in the run :func:`init` will start with the same options (:func:`world`).

    ``n_workers``: the workers (what ``dist.get_world_size()`` is to a DDP script); ``role``: ``"worker"``,
    ``"server"``, ``"group"`` (a group server) or ``"spare"``; ``worker_index``: 0..n_workers-1 on a worker,
    None elsewhere (what ``dist.get_rank()`` is); ``rank``/``size``: this process in the job, the job's size;
    ``n_servers``: the central shards.
    """

    n_workers: int
    role: str
    worker_index: int | None
    rank: int
    size: int
    n_servers: int

    @property
    def is_worker(self) -> bool:
        return self.role == "worker"


def world(*, config: str | None = None, comm=None, exit_on_error: bool = True, **options: Any) -> World:
    """Collective over ``comm``, before :func:`init`: the worker count and this rank's role and worker index
    in the layout ``init`` will use with the same options (``servers``, ``groups``, ``spare_workers``,
    ``placement``, ``paradigm``; the others are taken and not needed). For a script that needs them to set
    itself up, as nanoGPT divides its gradient accumulation by the world size and Horovod's examples scale
    the rate by ``hvd.size()``::

        w = hpcps.world(servers=2)
        accumulation = 40 // w.n_workers
        ps = hpcps.init(make_model, servers=2, lr=base_lr * w.n_workers, ...)

    Bad options end every rank with one line, as ``init`` does (``exit_on_error``)."""
    from mpi4py import MPI

    from hpcps.cluster.placement import node_ids, run_order
    from hpcps.options.planning import plan

    comm = MPI.COMM_WORLD if comm is None else comm
    _check_launch(comm, exit_on_error)
    flags = _flags({key: value for key, value in options.items() if key not in ("model", "optimizer", "lr_schedule",
                                                                                "param_groups", "steps")})
    flags.update(steps=1, dataset=OWN_LOOP)

    def where() -> World:
        cfg = make_config(flags, config_file=config, python=True)
        nodes = node_ids(comm)  # (collective: every rank is here)
        layout = plan(cfg, comm.size, nodes)  # servers="auto" settled as init will settle it
        # the run renumbers the ranks so (hpcps.cluster.placement)
        run_rank = run_order(comm, layout.n_servers, cfg.placement, nodes).index(comm.rank)
        role = layout.role(run_rank)
        return World(n_workers=layout.n_workers, role=role.value, rank=comm.rank, size=comm.size,
                     worker_index=layout.worker_index(run_rank) if role is Role.WORKER else None,
                     n_servers=layout.n_servers)

    return _collectively(comm, where, exit_on_error)


def _collectively(comm, step: Callable[[], Any], exit_on_error: bool) -> Any:
    """``step()`` on every rank of ``comm``. With ``exit_on_error``, bad input ends every rank with one
    ``hpcps: error:`` line and exit status 2, and any other failure ends the job naming the rank
    (:func:`hpcps.runtime.agree.run_or_end`); without, the exception propagates."""
    from hpcps.runtime.agree import run_or_end

    if not exit_on_error:
        return step()
    result, status = run_or_end(comm, step)
    if status:
        sys.exit(status)
    return result


def _check_launch(comm, exit_on_error: bool) -> None:
    """A launcher that started several processes of which MPI sees a world of one each (torchrun; srun
    without the MPI's PMI plugin): one line saying how to launch instead, and exit status 2, on every process
    (each is its own world: nobody waits for another). Only for ``COMM_WORLD``."""
    from mpi4py import MPI

    from hpcps.cluster.launcher import check_world, launcher_rank

    if comm != MPI.COMM_WORLD:
        return
    try:
        check_world(comm.size)
    except UserError as exc:
        if not exit_on_error:
            raise
        if launcher_rank() == 0:  # the same line on every process otherwise
            from hpcps.errors import print_error

            print_error(str(exc))
        sys.exit(exc.exit_code)


def _object(value: Any) -> Any:
    """The user's own object (a factory, a schedule), or None where a name (or nothing) was given."""
    return None if value is None or isinstance(value, str) else value


def _flags(options: dict[str, Any], **objects: Any) -> dict[str, Any]:
    """The options as the config takes them: names and plug-in paths as given, the user's objects
    recorded by name (``module:qualname``) where the config has a field for them."""
    flags = dict(options)
    if not isinstance(flags.get("paradigm", ""), str):  # your own Policy subclass, filed as module:qualname
        from hpcps.policies import register_class

        flags["paradigm"] = register_class(flags["paradigm"])
    for key, value in objects.items():
        if isinstance(value, str):  # a name or plug-in path: as the command line takes it
            flags[key] = value
        elif value is not None and key in ("model", "dataset", "loss"):
            flags[key] = _describe(value)  # how the run's config records the user's object
    return flags


def _describe(obj: Any) -> str:
    """How an object the user gave is recorded in the run's config (``module:qualname``, or its type)."""
    name = getattr(obj, "__qualname__", None)
    if name is not None and callable(obj):
        return f"{getattr(obj, '__module__', '?')}:{name}"
    return f"<{type(obj).__name__}>"


def is_batch_factory(data: Any) -> bool:
    """Whether ``data`` is a batch factory (a callable that is no Dataset, name or pair)."""
    return callable(data) and not isinstance(data, (str, tuple, list)) and not is_dataset(data)


__all__ = ["train", "init", "world", "World", "decay_groups", "RunResult", "Session"]
