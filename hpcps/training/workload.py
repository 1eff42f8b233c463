"""What is trained: the user's model, data, loss, evaluation and server optimizer, as one object.

A :class:`Workload` is what the runtime (:mod:`hpcps.runtime.run`) trains. The
Python API (:func:`hpcps.train`) builds one from the user's objects;
``hpcps train`` builds one from its options (:func:`workload_from_config`),
where ``--model``, ``--dataset`` and ``--loss`` are built-in names or
plug-ins (``pkg.mod:name``, ``path/file.py:name``, see :mod:`hpcps.plugins`).

Which rank runs what: every rank calls the model factory (right after
``torch.manual_seed(seed)``, so initial models agree); the data are loaded
only by workers (their batches) and rank 0 (the held-out set it evaluates
on); the loss runs on workers, the evaluation on rank 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F

from hpcps.data.batches import DataSource, FactoryData, TorchData, is_dataset
from hpcps.options.config import TrainConfig
from hpcps.data.sharding import split_indices
from hpcps.data.datasets import builtin_dataset, is_builtin_name
from hpcps.errors import RunAborted, UserError
from hpcps.training.models import MODELS, torchvision_model
from hpcps.training.optim import OptimizerFactory, Schedule, builtin_optimizer
from hpcps.plugins import call_with_accepted, is_plugin, load_plugin

#: ``(model, batch) -> scalar tensor``
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
#: ``(model, held-out batches) -> {"loss": ..., "accuracy": ..., other named metrics}``
EvalFn = Callable[[torch.nn.Module, Iterable[Any]], Mapping[str, float]]


def cross_entropy(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The default loss: cross-entropy of ``model(x)`` against integer labels ``y`` of an ``(x, y)`` batch."""
    x, y = batch
    return _labelled_cross_entropy(model(x), y)


def _labelled_cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy``, where a label beyond the model's outputs is one line saying so (torch's
    ``IndexError`` named neither the label nor the model's width)."""
    try:
        return F.cross_entropy(out, y)
    except IndexError:
        if y.numel() and out.ndim >= 2 and int(y.max()) >= out.shape[1]:
            raise RunAborted(f"a label of the batch is {int(y.max())}, beyond the model's {out.shape[1]} outputs "
                             f"(labels must be 0 to {out.shape[1] - 1}): the data has more classes than the "
                             f"data set says, or the model was built for fewer") from None
        raise


def mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Mean squared error of ``model(x)`` against float targets ``y`` (shapes must match)."""
    x, y = batch
    return F.mse_loss(model(x), y)


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse}


def default_evaluate(loss: LossFn) -> EvalFn:
    """Evaluation when the user gives none: the mean ``loss`` over the held-out samples, and for
    ``(x, y)`` batches with integer labels the accuracy of ``model(x).argmax(1)`` (else NaN)."""

    def evaluate(model: torch.nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        loss_sum, n, correct, labelled = 0.0, 0, 0, 0
        for batch in batches:
            classify = isinstance(batch, (tuple, list)) and len(batch) == 2 and _labels(batch[1])
            out = model(batch[0]) if classify else None
            value = _labelled_cross_entropy(out, batch[1]) if loss is cross_entropy else loss(model, batch)
            size = len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch)
            loss_sum, n = loss_sum + float(value.detach()) * size, n + size
            if classify and out.ndim == 2:
                correct += int((out.argmax(1) == batch[1]).sum())
                labelled += size
        return {"loss": loss_sum / n if n else math.nan,
                "accuracy": correct / labelled if labelled else math.nan}

    return evaluate


def _labels(y: Any) -> bool:
    return isinstance(y, torch.Tensor) and y.ndim == 1 and not y.is_floating_point()


@dataclass(frozen=True)
class Workload:
    """The user's objects (see the module docstring for which rank runs what).

    ``data`` loads the training and held-out data where they are needed
    (a zero-argument callable, so ranks that need no data load none; None
    under the step API, where the user's loop brings its own).
    ``param_groups`` are the optimizer's groups (:mod:`hpcps.training.paramgroups`).
    ``optimizer`` and ``lr_schedule`` override ``--optimizer`` and
    ``--lr-schedule`` when given. ``prepare``, if given, runs on rank 0
    before any rank loads data (e.g. generating a cache file once).
    """

    model: Callable[..., torch.nn.Module]
    data: Callable[[], DataSource] | None
    loss: LossFn = cross_entropy
    evaluate: EvalFn | None = None
    optimizer: OptimizerFactory | None = None
    lr_schedule: Schedule | None = None
    model_name: str = "model"
    prepare: Callable[[], object] | None = None
    param_groups: Any = None

    def build_model(self, *, seed: int, in_shape: tuple[int, ...] | None, n_classes: int | None,
                    hidden: int | None) -> torch.nn.Module:
        """The model, identical on every rank: the factory runs right after ``torch.manual_seed(seed)``.

        The factory gets the keyword arguments it accepts of ``in_shape``,
        ``n_classes`` (where the data set tells them) and ``hidden`` (where
        the user gave it; else the factory's own default applies). A model the
        caller built (``hpcps.init(model)``, as ``DDP(model)`` takes it) is taken
        as it is, torch's random stream untouched: the run starts from rank 0's
        parameters (:func:`hpcps.runtime.run.open_run` sends them to every rank).
        """
        if self.given_model:
            return self.model
        offered: dict[str, Any] = {} if hidden is None else {"hidden": hidden}
        if in_shape is not None:
            offered["in_shape"] = tuple(in_shape)
        if n_classes is not None:
            offered["n_classes"] = n_classes
        torch.manual_seed(seed)
        try:
            model = call_with_accepted(self.model, **offered)
        except UserError:
            raise
        except TypeError as exc:
            raise UserError(f"--model {self.model_name}: calling it failed: {exc} "
                            f"(offered: {', '.join(offered)})") from None
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"--model {self.model_name}: returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    @property
    def given_model(self) -> bool:
        """Whether the caller gave a model already built, not a factory."""
        return isinstance(self.model, torch.nn.Module)

    def evaluation(self) -> EvalFn:
        return self.evaluate or default_evaluate(self.loss)

    def optimizer_factory(self, cfg: TrainConfig) -> OptimizerFactory:
        return self.optimizer or builtin_optimizer(cfg.optimizer, lr=cfg.lr, momentum=cfg.momentum,
                                                   nesterov=cfg.nesterov, weight_decay=cfg.weight_decay,
                                                   betas=cfg.betas, eps=cfg.eps, momentum_period=cfg.momentum_period,
                                                   fused=cfg.fused)


def data_source(train: Any, test: Any = None, *, test_fraction: float = 0.2, name: str = "dataset") -> DataSource:
    """The user's training data as a :class:`DataSource`.

    ``train`` is a map-style ``Dataset`` (sharded by hpcps), a batch factory
    ``(index, n_workers, seed, epoch) -> iterable of batches``, or a
    ``(train, test)`` pair. ``test`` is a Dataset, a re-iterable of batches
    (a DataLoader), or None: then a Dataset is split as ``test_fraction``
    says (with the same fixed split as the built-in data sets) and a batch
    factory is not evaluated.
    """
    if isinstance(train, tuple) and len(train) == 2 and test is None:
        train, test = train
    if is_dataset(train):
        if test is None:
            train, test = split(train, test_fraction)
        return TorchData(train, test, name=name)
    if callable(train):
        return FactoryData(train, test, name=name)
    raise UserError(f"{name}: expected a torch Dataset, a (train, test) pair or a batch factory, "
                    f"got a {type(train).__name__}")


def split(dataset: Any, test_fraction: float) -> tuple[torch.utils.data.Subset, torch.utils.data.Subset]:
    """Hold out ``test_fraction`` of ``dataset``, always the same samples (a permutation seeded once)."""
    train, test = split_indices(len(dataset), test_fraction)
    return torch.utils.data.Subset(dataset, train.tolist()), torch.utils.data.Subset(dataset, test.tolist())


def data_shape(source: DataSource) -> tuple[tuple[int, ...] | None, int | None]:
    """``(in_shape, n_classes)`` of a data source where they can be told (None where not)."""
    if isinstance(source, TorchData):
        sample = source.train[0]
        x = sample[0] if isinstance(sample, (tuple, list)) else sample
        in_shape = tuple(x.shape) if hasattr(x, "shape") else None
        base = getattr(source.train, "dataset", source.train)  # through a Subset
        classes = getattr(base, "n_classes", None)
        if classes is None and hasattr(base, "classes"):
            classes = len(base.classes)
        return in_shape, classes
    return getattr(source, "in_shape", None), getattr(source, "n_classes", None)


def workload_from_config(cfg: TrainConfig) -> Workload:
    """``hpcps train``'s workload: built-in names or plug-ins for ``--model``, ``--dataset``, ``--loss``."""
    load, prepare = resolve_dataset(cfg.dataset, cfg.test_fraction)
    return Workload(model=resolve_model(cfg.model), data=load, prepare=prepare, loss=resolve_loss(cfg.loss),
                    model_name=cfg.model)


def resolve_model(spec: str) -> Callable[..., torch.nn.Module]:
    """``--model``: a built-in name (:data:`hpcps.training.models.MODELS`), ``torchvision:NAME``, or a plug-in
    model factory."""
    if spec.startswith("torchvision:"):
        return torchvision_model(spec.partition(":")[2])
    return _builtin_or_plugin(spec, "--model", MODELS, "model", "a model factory")


def resolve_loss(spec: str) -> LossFn:
    """``--loss``: a built-in name (:data:`LOSSES`) or a plug-in ``(model, batch) -> loss``."""
    return _builtin_or_plugin(spec, "--loss", LOSSES, "loss", "a loss (model, batch) -> tensor")


def _builtin_or_plugin(spec: str, option: str, builtins: Mapping[str, Callable], noun: str, what: str) -> Callable:
    if not is_plugin(spec):
        if spec in builtins:
            return builtins[spec]
        raise UserError(f"{option}: unknown {noun} {spec!r} (known: {', '.join(sorted(builtins))}; "
                        f"or a plug-in, pkg.mod:name or file.py:name)")
    obj = load_plugin(spec, option)
    if not callable(obj):
        raise UserError(f"{option} {spec}: a {type(obj).__name__} is not callable ({what})")
    return obj


def resolve_dataset(spec: str, test_fraction: float) -> tuple[Callable[[], DataSource], Callable[[], object] | None]:
    """``--dataset``: ``(load, prepare)`` of a built-in name or HDF5 file (:mod:`hpcps.data.datasets`), or of
    a plug-in: a Dataset, a (train, test) pair, or a callable returning either. ``load`` builds the
    data source where it is called; ``prepare`` (or None) runs once, on rank 0, before any load."""
    if is_builtin_name(spec) or not is_plugin(spec):
        return builtin_dataset(spec, test_fraction)
    obj = load_plugin(spec, "--dataset")

    def load() -> DataSource:
        value = obj
        if callable(obj) and not is_dataset(obj):
            try:
                value = obj()
            except UserError:
                raise
            except Exception as exc:
                raise UserError(f"--dataset {spec}: calling it failed: {type(exc).__name__}: {exc}") from None
        if not (is_dataset(value) or (isinstance(value, tuple) and len(value) == 2)):
            raise UserError(f"--dataset {spec}: expected a torch Dataset or a (train, test) pair of them, "
                            f"got a {type(value).__name__}")
        try:
            return data_source(value, test_fraction=test_fraction, name=spec)
        except UserError as exc:
            raise UserError(f"--dataset {spec}: {exc}") from None

    return load, None
