"""What a sweep trains: model factory, data, loss, optimizer and batching."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Union

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from .losses import LossFn, resolve_loss
from .optim import OPTIMIZERS  # noqa: F401  (the families' names, from optim.FAMILIES; imported from here too)
from .precision import check_precision
from .task_metrics import Metric, check_metrics

if TYPE_CHECKING:  # stack.py imports this module
    from .stack import StructuralKey

Split = Union[tuple, TensorDataset, Dataset]
ModelFactory = Callable[[dict], nn.Module]


@dataclass(frozen=True)
class TensorSplit:
    """One split held as tensors: every member draws its own batches from it."""

    tensors: tuple[torch.Tensor, ...]

    def __len__(self) -> int:
        return int(self.tensors[0].shape[0])

    def to(self, device: torch.device | str) -> "TensorSplit":
        return TensorSplit(tuple(t.to(device) for t in self.tensors))


def _as_split(split: Split, name: str) -> TensorSplit | Dataset:
    if isinstance(split, TensorDataset):
        return TensorSplit(tuple(split.tensors))
    if isinstance(split, (tuple, list)):
        tensors = tuple(torch.as_tensor(np.asarray(t)) if not torch.is_tensor(t) else t for t in split)
        if len(tensors) != 2:
            raise ValueError(f"{name} split must be (inputs, targets); got {len(tensors)} arrays")
        if tensors[0].shape[0] != tensors[1].shape[0]:
            raise ValueError(
                f"{name} split: inputs have {tensors[0].shape[0]} rows but targets {tensors[1].shape[0]}"
            )
        return TensorSplit(tensors)
    if isinstance(split, Dataset):
        return split
    raise TypeError(
        f"{name} split must be a tuple (X, y) of tensors/arrays, a TensorDataset or a Dataset; "
        f"got {type(split).__name__}"
    )


def check_splits(train: TensorSplit | Dataset, val: TensorSplit | Dataset, loss: Any) -> None:
    """Refuse, with a message that says what to change, splits that would fail
    deep inside training or evaluation: an empty split (evaluation divided a
    sum of nothing by zero rows: ``TypeError: unsupported operand type(s) for
    /: 'NoneType' and 'int'``), and targets of a dtype the named loss cannot
    take (``cross_entropy`` needs integer class indices; torch's own error
    names neither the split nor the fix). A callable loss is the user's: its
    targets are not checked. A ``Dataset`` without ``len`` is not checked."""
    for name, split in (("train", train), ("val", val)):
        try:
            rows = len(split)
        except TypeError:
            continue
        if rows == 0:
            raise ValueError(f"Task.data: the {name} split is empty (0 samples); "
                             f"a sweep needs samples to {'train on' if name == 'train' else 'evaluate on'}")
        if loss == "cross_entropy" and isinstance(split, TensorSplit):
            target = split.tensors[1]
            if target.dtype == torch.bool or (target.ndim == 1 and not _is_integer(target)):
                raise TypeError(f"Task.data: the {name} split's targets are {target.dtype}, but loss "
                                "'cross_entropy' needs integer class indices: pass y as int64 (y.long()), "
                                "or use loss='mse' for regression targets")


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex())


@dataclass
class Task:
    """What a sweep trains, shared by every trial of it.

    ``model`` builds one ``nn.Module`` from a trial's config. ``data`` is
    ``(train, val)`` or a zero-argument callable returning it; each split is a
    tuple ``(X, y)`` of tensors or arrays or a ``TensorDataset`` (every member
    then draws its own seeded batch order) or any other ``Dataset`` (one loader
    per bucket: every member sees the same batch, in an order seeded by
    ``data_seed``). ``loss`` is ``"cross_entropy"`` (targets as class indices,
    or as class probabilities shaped like the output: soft labels, whose
    accuracy counts the argmax of each target), ``"mse"`` or a callable
    ``(output, target) -> per-sample losses``. ``optimizer`` is ``"sgd"``,
    ``"adam"`` or ``"adamw"``; a config may override it and ``batch_size``
    with keys of those names. ``iteration_steps=None`` makes one iteration one
    epoch (``len(train) // batch_size`` steps: the partial last batch is
    dropped so that every member's batch has the same shape).

    ``precision`` is ``"fp32"`` or ``"bf16"`` (the forward pass and loss under
    bfloat16 autocast, in the fused step, in evaluation and in the reference;
    parameters, optimizer state and BatchNorm statistics stay float32).
    ``compile=True`` lets a bucket's route probe try ``torch.compile`` of the
    fused step, checked against the per-member loop like any route
    (docs/design.md D8).

    ``metrics``: ``{name: fn(outputs, targets) -> float}`` (or torchmetrics-style
    objects with ``reset``/``update``/``compute``), computed for every member at
    every evaluation on its outputs for the whole validation split, and
    reported under ``name`` (``chorus_tune/task_metrics.py``).
    """

    model: ModelFactory
    data: Any
    loss: Union[str, LossFn] = "cross_entropy"
    optimizer: str = "sgd"
    batch_size: int = 64
    iteration_steps: int | None = None
    eval_batch_size: int = 1024
    data_seed: int = 0
    precision: str = "fp32"
    compile: bool = False
    metrics: dict[str, Metric] | None = None
    _loaded: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {self.optimizer!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive; got {self.batch_size}")
        if self.iteration_steps is not None and self.iteration_steps < 1:
            raise ValueError(f"iteration_steps must be positive or None; got {self.iteration_steps}")
        resolve_loss(self.loss)  # fail at construction on an unknown loss name
        check_precision(self.precision)
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be True or False; got {self.compile!r}")
        self.metrics = check_metrics(self.metrics) or None

    def __getstate__(self) -> dict:
        # Loaded data is a cache: it travels once through the object store as the
        # task's own `data`, never a second time as this copy.
        state = dict(self.__dict__)
        state["_loaded"] = None
        return state

    @property
    def loss_fn(self) -> LossFn:
        return resolve_loss(self.loss)

    @property
    def is_classification(self) -> bool:
        return self.loss == "cross_entropy"

    def optimizer_for(self, config: dict) -> str:
        name = config.get("optimizer", self.optimizer)
        if name not in OPTIMIZERS:
            raise ValueError(f"config optimizer must be one of {OPTIMIZERS}; got {name!r}")
        return name

    def batch_size_for(self, config: dict) -> int:
        return int(config.get("batch_size", self.batch_size))

    def load_data(self) -> tuple[TensorSplit | Dataset, TensorSplit | Dataset]:
        """The (train, val) splits, normalised and cached."""
        if self._loaded is None:
            data = self.data() if callable(self.data) else self.data
            if not isinstance(data, (tuple, list)) or len(data) != 2:
                raise ValueError("Task.data must be (train, val) or a callable returning it")
            loaded = (_as_split(data[0], "train"), _as_split(data[1], "val"))
            check_splits(*loaded, self.loss)
            self._loaded = loaded
        return self._loaded

    def steps_per_iteration(self, config: dict) -> int:
        if self.iteration_steps is not None:
            return self.iteration_steps
        train, _ = self.load_data()
        batch = self.batch_size_for(config)
        steps = len(train) // batch
        if steps < 1:
            raise ValueError(f"training split has {len(train)} samples, fewer than one batch of {batch}")
        return steps

    def build_model(self, config: dict, seed: int) -> nn.Module:
        """The member's initial model: ``torch.manual_seed(seed); model(config)``.

        The caller's global RNG state is left as it was.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = self.model(config)
        if not isinstance(module, nn.Module):
            raise TypeError(f"Task.model must return an nn.Module; got {type(module).__name__}")
        return module

    def structural_key(self, config: dict) -> StructuralKey:
        from .stack import structural_key

        return structural_key(self, config)
