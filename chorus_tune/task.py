"""What a sweep trains: model factory, data, loss, optimizer and batching."""
from __future__ import annotations

import difflib
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Union

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from .config_keys import is_tune_key
from .losses import IGNORE_INDEX, LossFn, resolve_loss
from .optim import FAMILIES, OPTIMIZERS  # OPTIMIZERS (the families' names) is imported from here too
from .precision import autocast, check_precision
from .schedules import SCHEDULE_KEYS, as_count
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
            if _is_integer(target):
                _check_no_negative_labels(target, name)
    if isinstance(train, TensorSplit) and isinstance(val, TensorSplit):
        for what, t, v in zip(("inputs", "targets"), train.tensors, val.tensors):
            if t.shape[1:] != v.shape[1:]:
                raise ValueError(f"Task.data: the val split's {what} have shape {tuple(v.shape[1:])} per row but "
                                 f"the train split's {tuple(t.shape[1:])}: pass both splits with the same "
                                 "per-row shape")


def _check_no_negative_labels(target: torch.Tensor, name: str) -> None:
    """Class indices are never negative, but for torch's ``ignore_index``
    (-100). The vmap form of cross entropy gathers a class by index, so a -1
    would have trained as class 0 there, silently, where torch refuses it."""
    bad = (target < 0) & (target != IGNORE_INDEX)
    if bool(bad.any()):
        row = int(bad.flatten().nonzero()[0])
        raise ValueError(f"Task.data: the {name} split has the negative label {int(target.flatten()[row])} "
                         f"(at row {row}): cross_entropy needs class indices in [0, C), or {IGNORE_INDEX} "
                         "(its ignore_index) for a row that should count for nothing")


def _first_rows(split: "TensorSplit | Dataset", n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(split, TensorSplit):
        return split.tensors[0][:n], split.tensors[1][:n]
    from torch.utils.data import DataLoader

    return next(iter(DataLoader(split, batch_size=n, shuffle=False)))


def _describe(tensor: torch.Tensor) -> str:
    return f"shape {tuple(tensor.shape)}, {tensor.dtype}"


class _ReadRecorder(dict):
    """A config that records which keys its reader reads: the model factory
    is called with one, so that a key nothing reads can be named. A reader
    that iterates over it or copies it counts as reading every key."""

    def __init__(self, config: dict):
        super().__init__(config)
        self.read: set = set()

    def _all(self) -> None:
        self.read.update(dict.keys(self))

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def pop(self, key, *default):
        self.read.add(key)
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self.read.add(key)
        return super().setdefault(key, default)

    def __iter__(self):
        self._all()
        return super().__iter__()

    def keys(self):
        self._all()
        return super().keys()

    def items(self):
        self._all()
        return super().items()

    def values(self):
        self._all()
        return super().values()

    def copy(self) -> dict:
        self._all()
        return dict(super().items())


def core_config_keys(config: dict, optimizer: str) -> set[str]:
    """The config keys chorus_tune itself reads for a member of ``optimizer``
    with this config's schedule (a key of another family or schedule is not
    read: ``momentum`` under Adam, ``t_max`` without ``lr_schedule='cosine'``)."""
    keys = {"seed", "optimizer", "batch_size", "label_smoothing", "max_grad_norm", "lr_schedule", "warmup_steps"}
    keys.update(FAMILIES[optimizer].defaults if optimizer in FAMILIES else ())
    keys.update(SCHEDULE_KEYS.get(config.get("lr_schedule", "constant"), ()))
    return keys


def _short(value: Any) -> str:
    text = repr(value).splitlines()[0]
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


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
    # Config keys already warned about as read by nothing (once per key), and
    # the modules the factory has returned (one returned twice is a cache).
    _warned_keys: set = field(default_factory=set, init=False, repr=False, compare=False)
    _built: Any = field(default=None, init=False, repr=False, compare=False)
    _row: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.model, nn.Module) or not callable(self.model):
            raise TypeError(f"Task.model must be a factory, a callable config -> nn.Module (e.g. "
                            f"model=lambda config: MyNet(config['width'])), called once per member so each "
                            f"gets its own weights from its seed; got {_short(self.model)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {self.optimizer!r}")
        self.batch_size = as_count(self.batch_size, "Task batch_size", 1)
        self.eval_batch_size = as_count(self.eval_batch_size, "Task eval_batch_size (rows per evaluation batch)", 1)
        if self.iteration_steps is not None:
            self.iteration_steps = as_count(self.iteration_steps, "Task iteration_steps (or None: one epoch)", 1)
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
        state["_built"] = None  # a WeakSet does not pickle; each copy keeps its own
        state["_row"] = None
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
        if "batch_size" not in config:
            return self.batch_size
        return as_count(config["batch_size"], "config key 'batch_size'", 1)

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

    def input_row(self) -> torch.Tensor:
        """The first training input row (a copy, on the CPU): what a padded
        stack's multiply-adds are priced with (``widths.Profile``). Where the
        data is not loaded here, it is loaded for this and not kept: the pool
        and the driver ask only to price padding, and hold no data otherwise."""
        if self._row is None:
            if self._loaded is not None:
                train = self._loaded[0]
            else:
                data = self.data() if callable(self.data) else self.data
                if not isinstance(data, (tuple, list)) or len(data) != 2:
                    raise ValueError("Task.data must be (train, val) or a callable returning it")
                train = _as_split(data[0], "train")
            row = train.tensors[0][0] if isinstance(train, TensorSplit) else torch.as_tensor(train[0][0])
            # A copy: a view would keep the whole split's storage alive.
            self._row = row.detach().to("cpu").clone()
        return self._row

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
        recorder = _ReadRecorder(config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = self.model(recorder)
        if not isinstance(module, nn.Module):
            raise TypeError(f"Task.model must return an nn.Module; got {type(module).__name__}")
        self._refuse_a_cached_module(module)
        self._warn_unread_keys(config, recorder.read)
        return module

    def _refuse_a_cached_module(self, module: nn.Module) -> None:
        if self._built is None:
            self._built = weakref.WeakSet()
        if module in self._built:
            raise ValueError(f"Task.model returned a {type(module).__name__} it had returned before: every "
                             "member would start from that one module's weights, whatever its seed. The "
                             "factory must build a new module on every call (no cache)")
        self._built.add(module)

    def _warn_unread_keys(self, config: dict, factory_reads: set) -> None:
        """Warn, once per key, of a config key that neither the model factory
        nor chorus_tune reads: most often a misspelling (``learning_rate`` for
        ``lr``), which would train silently with the default instead."""
        core = core_config_keys(config, config.get("optimizer", self.optimizer))
        for key in config:
            if key in factory_reads or key in core or key in self._warned_keys:
                continue
            if is_tune_key(key):  # Tune's own (__trial_index__, ...)
                continue
            self._warned_keys.add(key)
            close = difflib.get_close_matches(str(key), sorted(core), n=3, cutoff=0.5)
            hint = f" Did you mean {' or '.join(repr(k) for k in close)}?" if close else ""
            warnings.warn(f"config key {key!r} (= {config[key]!r}) is read by nothing: not by the model "
                          f"factory, nor by chorus_tune (which reads {', '.join(sorted(core))}); it changes "
                          f"nothing in training.{hint}", UserWarning, stacklevel=3)

    def check_model(self, module: nn.Module) -> None:
        """Refuse, naming the bad value and what to pass instead, a model or
        data that would fail deep inside the first fused step or evaluation,
        or train silently wrong: a model without parameters, inputs of
        another float dtype than the model's, a forward that fails on the
        first training rows (the wrong feature width), targets that do not
        fit the model's output (a ``(N, 1)`` label tensor, a label >= the
        class count, soft labels of another width), and a ``loss=`` callable
        that does not return one loss per sample. One forward of two rows, in
        eval mode without gradients: the module is left as it was."""
        params = list(module.parameters())
        if not params:
            raise ValueError(f"Task.model built a {type(module).__name__} with no parameters: there is nothing "
                             "to train. Return a module with at least one parameter")
        train, val = self.load_data()
        x, y = _first_rows(train, 2)
        floating = next((p for p in params if p.is_floating_point()), None)
        if x.is_floating_point() and floating is not None and x.dtype != floating.dtype:
            raise TypeError(f"Task.data: the train split's inputs are {x.dtype} but the model's parameters "
                            f"are {floating.dtype}: pass the inputs as {floating.dtype} (X.float() for "
                            "float32; numpy arrays default to float64), or build the model in that dtype")
        output = self._first_output(module, x, floating.device if floating is not None else x.device)
        y = y.to(output.device)
        if self.loss == "cross_entropy":
            self._check_class_targets(output, y, train, val)
        losses_ = self.loss_fn(output, y)
        if not callable(self.loss):
            return
        if tuple(losses_.shape) != (x.shape[0],):
            raise ValueError(f"Task loss {getattr(self.loss, '__name__', self.loss)!r} returned shape "
                             f"{tuple(losses_.shape)} for a batch of {x.shape[0]} rows; it must return one loss "
                             f"per sample, shape ({x.shape[0]},) (reduction='none', or .mean(dim=1) over "
                             "the other dims): chorus_tune takes each member's mean itself")

    def check_capacity(self, capacity: int, module: nn.Module, config: dict, device: torch.device | str) -> None:
        """Refuse a bucket of ``capacity`` slots of this model that cannot fit
        in ``device``'s memory (``memory.check_capacity_fits``)."""
        from .memory import check_capacity_fits

        tensors = [*module.parameters()]
        states = len(FAMILIES[self.optimizer_for(config)].state_names)
        member = sum(t.numel() * t.element_size() for t in tensors) * (2 + states)  # itself, gradient, state
        member += sum(b.numel() * b.element_size() for b in module.buffers())
        train, _ = self.load_data()
        if isinstance(train, TensorSplit):  # a step's batch, gathered for every row, and its index row
            row = sum(t[0].numel() * t.element_size() for t in train.tensors) + 8
            member += row * self.batch_size_for(config)
        check_capacity_fits(capacity, member, torch.device(device))

    @torch.no_grad()
    def _first_output(self, module: nn.Module, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        modes = [(m, m.training) for m in module.modules()]
        module.eval()  # no BatchNorm statistics move, no dropout draws
        try:
            with torch.random.fork_rng(devices=[]), autocast(self.precision, device):
                return module(x.to(device)).float()
        except Exception as exc:
            from .memory import is_out_of_memory

            if is_out_of_memory(exc):
                raise
            raise ValueError(f"Task.model's forward failed on the first {x.shape[0]} rows of the train split "
                             f"(inputs of {_describe(x)}): {type(exc).__name__}: {exc}. Check that the "
                             "inputs' per-row shape (the feature width) and dtype are what the model "
                             "takes") from exc
        finally:
            for m, training in modes:
                m.training = training

    def _check_class_targets(self, output: torch.Tensor, y: torch.Tensor, train, val) -> None:
        classes = int(output.shape[1 if output.dim() > 1 else 0])
        per_row = tuple(output.shape[1:])
        if y.is_floating_point():
            if tuple(y.shape[1:]) != per_row:
                raise ValueError(f"Task.data: the train split's class-probability targets have shape "
                                 f"{tuple(y.shape[1:])} per row, but the model outputs {per_row} per row: "
                                 f"pass soft labels of shape (N, {classes}), or class indices of shape (N,)")
            return
        expected = (y.shape[0], *output.shape[2:])
        if tuple(y.shape) != expected:
            fix = " (y.squeeze(1), or y.reshape(-1))" if y.dim() == 2 and y.shape[1] == 1 else ""
            raise ValueError(f"Task.data: the train split's targets have shape {tuple(y.shape[1:])} per row; "
                             f"cross_entropy against the model's output of {per_row} per row takes class indices "
                             f"of shape {tuple(expected[1:])} per row{fix}, or class probabilities of shape "
                             f"{per_row} per row")
        for name, split in (("train", train), ("val", val)):
            target = split.tensors[1] if isinstance(split, TensorSplit) else _first_rows(split, 64)[1]
            over = target >= classes
            if bool(over.any()):
                row = int(over.flatten().nonzero()[0])
                raise ValueError(f"Task.data: the {name} split has label {int(target.flatten()[row])} (at row "
                                 f"{row}), but the model outputs {classes} classes: labels must be in "
                                 f"[0, {classes}) (or {IGNORE_INDEX} to ignore a row); give the model "
                                 "as many outputs as there are classes")

    def structural_key(self, config: dict) -> StructuralKey:
        from .stack import structural_key

        return structural_key(self, config)
