"""The Python API: train your own model, data, loss and optimizer with hpcps.

A script calls :func:`train` on every rank and is launched like
``hpcps train`` (``mpiexec -n 5 python train.py``, ``srun python train.py``)::

    import hpcps
    result = hpcps.train(model=make_net, data=train_set, test_data=test_set,
                         optimizer="adamw", lr=1e-3, lr_schedule="cosine", paradigm="dssp", steps=300)
    if result is not None:  # rank 0
        print(result.summary["final_accuracy"], result.saved)

``hpcps train`` is a client of the same runtime (:func:`hpcps.run.run_training`):
the options are the same, under the same names (``batch_size`` for
``--batch-size``), validated by the same config model.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable

import torch

from hpcps.optim import OptimizerFactory, Schedule
from hpcps.run import RunResult
from hpcps.workload import EvalFn, LossFn, Workload, data_source, resolve_dataset, resolve_loss, resolve_model


def train(model: Callable[..., torch.nn.Module] | str, data: Any = "digits", *,
          test_data: torch.utils.data.Dataset | Iterable[Any] | None = None,
          loss: LossFn | str | None = None, evaluate: EvalFn | None = None,
          optimizer: OptimizerFactory | str | None = None, lr_schedule: Schedule | str | None = None,
          config: str | None = None, comm=None, exit_on_error: bool = True, **options: Any) -> RunResult | None:
    """Collective over ``comm`` (default ``COMM_WORLD``): train, and return the result on rank 0
    (:class:`~hpcps.run.RunResult`: metrics path, summary, trained model and its ``state_dict``);
    None on every other rank.

    ``model``
        a factory returning a ``torch.nn.Module``, called on every rank right
        after ``torch.manual_seed(seed)`` (with ``in_shape``, ``n_classes``
        and ``hidden`` where it accepts them and the data tell them); or a
        built-in name or plug-in path, as ``--model`` takes.
    ``data``
        training data, loaded by workers only: a map-style ``Dataset``
        (hpcps shards it among the workers as ``DistributedSampler`` would,
        a new permutation every epoch); a batch factory
        ``(index, n_workers, seed, epoch) -> iterable of batches``; a
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
        ``weight_decay``, ``betas``, ...), or a factory ``params -> torch.optim.Optimizer``
        run on every server shard over its slice (1-D float32 tensors).
    ``lr_schedule``
        ``"constant"``, ``"step"``, ``"cosine"`` (with ``warmup_steps``), or
        ``version -> multiplier`` of the optimizer's learning rate, the
        version being the number of updates the shard has applied.
    ``config``
        a TOML file of options; keyword ``options`` override it.
    ``options``
        every ``hpcps train`` option: ``paradigm``, ``steps``, ``lr``,
        ``batch_size``, ``servers``, ``slowdown``, ``out``, ``save``, ...
    ``exit_on_error``
        bad input ends every rank with one ``hpcps: error:`` line and exit
        status 2, any other failure ends the job (``MPI_Abort``) naming the
        rank; False raises instead (a failure on one rank may then leave
        the others waiting: for tests and interactive use).
    """
    from mpi4py import MPI

    from hpcps.agree import agree, run_or_end
    from hpcps.config import make_config
    from hpcps.run import run_training

    comm = MPI.COMM_WORLD if comm is None else comm
    flags = dict(options)
    for key, value in (("model", model), ("dataset", data), ("loss", loss), ("optimizer", optimizer),
                       ("lr_schedule", lr_schedule)):
        if isinstance(value, str):  # a name or plug-in path: as the command line takes it
            flags[key] = value
    for key, value in (("model", model), ("dataset", data), ("loss", loss)):
        if value is not None and not isinstance(value, str):
            flags[key] = _describe(value)  # how the run's config records the user's object

    def workload(cfg) -> Workload:
        """The user's objects, names and plug-ins resolved (on every rank: plug-ins may fail anywhere)."""
        load, prepare = resolve_dataset(data, cfg.test_fraction) if isinstance(data, str) else (
            lambda: data_source(data, test_data, test_fraction=cfg.test_fraction, name=cfg.dataset), None)
        return Workload(
            model=resolve_model(model) if isinstance(model, str) else model, data=load, prepare=prepare,
            loss=resolve_loss(cfg.loss) if loss is None or isinstance(loss, str) else loss, evaluate=evaluate,
            optimizer=None if optimizer is None or isinstance(optimizer, str) else optimizer,
            lr_schedule=None if lr_schedule is None or isinstance(lr_schedule, str) else lr_schedule,
            model_name=cfg.model)

    def run() -> RunResult | None:
        cfg = agree(comm, lambda: make_config(flags, config_file=config))
        return run_training(cfg, comm, agree(comm, lambda: workload(cfg)))

    if not exit_on_error:
        return run()
    result, status = run_or_end(comm, run)
    if status:
        sys.exit(status)
    return result


def _describe(obj: Any) -> str:
    """How an object the user gave is recorded in the run's config (``module:qualname``, or its type)."""
    name = getattr(obj, "__qualname__", None)
    if name is not None and callable(obj):
        return f"{getattr(obj, '__module__', '?')}:{name}"
    return f"<{type(obj).__name__}>"


__all__ = ["train", "RunResult"]
