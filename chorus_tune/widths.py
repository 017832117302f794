"""Members of other layer widths in one stack: the padded structure (docs/design.md D9).

Members whose models differ only in the feature sizes of ``nn.Linear``,
``nn.Conv1d``/``nn.Conv2d`` (``groups=1``), ``nn.BatchNorm1d``/``nn.BatchNorm2d``
and ``nn.Embedding`` may share one stack. Each member is built at its own
width with its own seed (its initial values are its own model's), then
embedded in the stack's widest shape: its tensors fill the leading corner of
each padded tensor, zeros elsewhere (:func:`corner`).

Why that is exact: a padded unit's incoming weights and bias are zero, and
every weight that reads a padded unit (the next layer's columns for it) is
zero. A padded unit's *value* may still be nonzero (``sigmoid(0) = 0.5``, a
BatchNorm without affine), but it only ever meets zero weights, so it adds
exact zeros to the member's own units. Its gradient would not be zero (the
next layer's padded columns get ``dL/dz * 0.5``), so the stack zeroes every
padded entry's gradient before the update, and re-zeroes padded parameters and
buffers after it: they stay exactly zero whatever the optimizer's arithmetic
(weight decay, momentum, Adam's moments), and a member's own state is read
back unpadded. Padding at the *end* of each dimension is what keeps a
``Conv2d -> flatten -> Linear`` exact: the channels are flatten's outer
dimension, so padded channels are a contiguous tail of the flattened vector,
the tail the next Linear's padded input columns cover.

What this module cannot see (a reshape that interleaves a padded dimension,
``F.layer_norm`` over one in a forward, an output of another width) is the
padding check's to catch: the bucket runs a member's padded forward and
gradient against its own model before it takes it (``Bucket.add``).
"""
from __future__ import annotations

import copy
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from .width_rule import widest  # noqa: F401 (the widest shapes: here for the stack's callers)

Shape = tuple[int, ...]
# In a padded-family key, a dimension that padding may widen.
WIDTH = -1


@dataclass(frozen=True)
class Paddable:
    """A module type whose feature sizes may differ between members of one stack:
    its width ``settings`` (attribute names) and, per tensor, the dimensions
    that are widths (the others, such as a kernel's, must be equal)."""

    settings: tuple[str, ...]
    dims: dict[str, tuple[int, ...]]


_LINEAR = Paddable(("in_features", "out_features"), {"weight": (0, 1), "bias": (0,)})
_CONV = Paddable(("in_channels", "out_channels"), {"weight": (0, 1), "bias": (0,)})
_NORM = Paddable(("num_features",), {"weight": (0,), "bias": (0,), "running_mean": (0,), "running_var": (0,),
                                     "num_batches_tracked": ()})
_EMBEDDING = Paddable(("num_embeddings", "embedding_dim"), {"weight": (0, 1)})

# Exact types only: a subclass may have a forward of its own.
PADDABLE: dict[type, Paddable] = {
    nn.Linear: _LINEAR, nn.Conv1d: _CONV, nn.Conv2d: _CONV,
    nn.BatchNorm1d: _NORM, nn.BatchNorm2d: _NORM, nn.Embedding: _EMBEDDING,
}
_BY_NAME = {f"{t.__module__}.{t.__qualname__}": p for t, p in PADDABLE.items()}


def _paddable(kind: str, settings: dict[str, str]) -> Paddable | None:
    spec = _BY_NAME.get(kind)
    if spec is _CONV and settings.get("groups", "1") != "1":
        return None  # grouped channels would interleave their padding
    return spec


def describe_paddable() -> str:
    """The module types whose widths pad, in words."""
    return "nn.Linear, nn.Conv1d/2d (groups=1), nn.BatchNorm1d/2d and nn.Embedding"


# ----- the padded family: who may share a padded stack ------------------------------------------
def width_dims(key) -> dict[str, tuple[int, ...]]:
    """``{tensor name: its width dimensions}`` for every parameter and buffer of
    a paddable module in ``key`` (a ``stack.StructuralKey``)."""
    modules = {path: (kind, dict(settings)) for path, kind, settings in key.configuration}
    out = {}
    for name, _, _ in (*key.parameters, *key.buffers):
        path, _, leaf = name.rpartition(".")
        kind, settings = modules.get(path, ("", {}))
        spec = _paddable(kind, settings)
        if spec is not None and leaf in spec.dims:
            out[name] = spec.dims[leaf]
    return out


def padding_family(key):
    """``key`` with every width a paddable module may differ in left out: members
    whose families are equal may share one padded stack (their key's shapes
    pad to the family's widest). The widths' settings and a paddable module's
    ``extra_repr`` (which shows only its settings and whether it has a bias,
    which its parameters' names show) leave the configuration; every other
    setting and dimension stays."""
    dims = width_dims(key)

    def free(entries):
        return tuple((n, tuple(WIDTH if i in dims.get(n, ()) else s for i, s in enumerate(shape)), dtype)
                     for n, shape, dtype in entries)

    configuration = []
    for path, kind, settings in key.configuration:
        spec = _paddable(kind, dict(settings))
        if spec is not None:
            settings = tuple((n, v) for n, v in settings if n not in spec.settings and n != "extra_repr")
        configuration.append((path, kind, settings))
    return key._replace(parameters=free(key.parameters), buffers=free(key.buffers),
                        configuration=tuple(configuration))


def shapes_of(key) -> dict[str, Shape]:
    """``{tensor name: shape}`` of every parameter and buffer in ``key``."""
    return {n: tuple(s) for n, s, _ in (*key.parameters, *key.buffers)}


def corner(shape: Shape) -> tuple[slice, ...]:
    """The index of a member's own tensor of ``shape`` inside its padded one."""
    return tuple(slice(0, s) for s in shape)


def pad_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target`` (padded) := ``source`` in its corner, zeros elsewhere."""
    if tuple(target.shape) == tuple(source.shape):
        target.copy_(source)
        return
    target.zero_()
    target[corner(tuple(source.shape))].copy_(source)


def pad_mask(padded: Shape, own: Shape, device: torch.device) -> torch.Tensor:
    """``True`` on the entries of a tensor of ``padded`` shape that a member of
    ``own`` shape does not have."""
    mask = torch.ones(padded, dtype=torch.bool, device=device)
    mask[corner(own)] = False
    return mask


# ----- the template at the widest shape ---------------------------------------------------------
def widen(module: nn.Module, shapes: dict[str, Shape]) -> nn.Module:
    """A copy of ``module`` on the ``meta`` device whose paddable submodules have
    the tensors (and width settings) of ``shapes``: the vmap routes' template
    for a padded stack. Only the shapes matter: ``functional_call`` hands it
    the stacked tensors."""
    out = copy.deepcopy(module).to("meta")
    for path, sub in out.named_modules():
        spec = PADDABLE.get(type(sub))
        if spec is None or (isinstance(sub, (nn.Conv1d, nn.Conv2d)) and sub.groups != 1):
            continue
        for leaf in spec.dims:
            name = f"{path}.{leaf}" if path else leaf
            tensor = getattr(sub, leaf, None)
            if tensor is None or name not in shapes or tuple(tensor.shape) == shapes[name]:
                continue
            wide = torch.empty(shapes[name], dtype=tensor.dtype, device="meta")
            if isinstance(tensor, nn.Parameter):
                setattr(sub, leaf, nn.Parameter(wide, requires_grad=tensor.requires_grad))
            else:
                sub.register_buffer(leaf, wide, persistent=leaf in sub.state_dict())
        _set_width_settings(sub)
    return out


def _set_width_settings(sub: nn.Module) -> None:
    # The settings follow the tensors (extra_repr, and a forward that reads them).
    if isinstance(sub, nn.Linear):
        sub.out_features, sub.in_features = sub.weight.shape
    elif isinstance(sub, (nn.Conv1d, nn.Conv2d)):
        sub.out_channels, sub.in_channels = sub.weight.shape[:2]
    elif isinstance(sub, (nn.BatchNorm1d, nn.BatchNorm2d)):
        tensor = sub.weight if sub.weight is not None else sub.running_mean
        if tensor is not None:
            sub.num_features = tensor.shape[0]
    elif isinstance(sub, nn.Embedding):
        sub.num_embeddings, sub.embedding_dim = sub.weight.shape


# ----- what a member pays for its padding -------------------------------------------------------
@dataclass(frozen=True)
class Cost:
    """A model's size at some shapes: ``params`` (parameters), and ``macs``, the
    estimated multiply-adds per sample of its Linear, Conv and Embedding
    layers (``None`` where the model's forward could not be profiled)."""

    params: int
    macs: float | None

    @property
    def measure(self) -> float:
        """What a padding's price compares: ``macs`` where known, else ``params``."""
        return self.macs if self.macs is not None else float(self.params)


class Profile:
    """Where each Linear/Conv/Embedding of a model computes: output positions
    per sample (1 for a Linear on ``(N, F)``, ``H*W`` for a Conv2d), taken once
    from a forward of the model on the ``meta`` device (no memory, no
    arithmetic). Positions do not depend on widths, so one profile prices a
    member at its own shapes and at the padded ones."""

    def __init__(self, skeleton: nn.Module, row: torch.Tensor):
        # The model copied to ``meta`` at once (a copy taken later may meet the
        # batched tensors a running step swaps into the template), its forward
        # run only when a price is first asked for: torch's meta kernels import
        # sympy (0.47 CPU-s), which a bucket whose members all share one width
        # never needs.
        self._skeleton: nn.Module | None = skeleton
        self._row = torch.empty(row.shape, dtype=row.dtype, device="meta")
        self._positions: dict[str, tuple[float, bool]] | None = None
        self._lock = threading.Lock()  # describe() may ask beside the training thread

    @classmethod
    def of(cls, module: nn.Module, row: torch.Tensor) -> "Profile":
        """The profile of ``module`` on a batch of two rows like ``row``: the
        module is copied now, and its forward runs when a price is first asked."""
        return cls(copy.deepcopy(module).to("meta"), row)

    @property
    def positions(self) -> dict[str, tuple[float, bool]] | None:
        """{module path: (output positions per sample, whether it is an embedding
        lookup)}; ``None`` where the forward cannot run on ``meta``."""
        with self._lock:
            if self._skeleton is not None:
                self._positions = _positions(self._skeleton, self._row)
                self._skeleton = None
            return self._positions

    def cost(self, shapes: dict[str, Shape], parameters: Iterable[str]) -> Cost:
        """The cost of a model with tensors of ``shapes`` (``parameters``: the
        names that are parameters, not buffers)."""
        params = sum(math.prod(shapes[n]) for n in parameters)
        if self.positions is None:
            return Cost(params, None)
        macs = 0.0
        for path, (where, lookup) in self.positions.items():
            weight = shapes.get(f"{path}.weight" if path else "weight")
            if weight is not None:
                # A lookup reads one row of embedding_dim; a Linear or Conv multiplies its whole weight.
                macs += where * (weight[1] if lookup else math.prod(weight))
        return Cost(params, macs)


def _positions(skeleton: nn.Module, row: torch.Tensor) -> dict[str, tuple[float, bool]] | None:
    positions: dict[str, tuple[float, bool]] = {}
    hooks = []
    for path, sub in skeleton.named_modules():
        if isinstance(sub, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)):
            def record(m, args, out, path=path):
                lookup = isinstance(m, nn.Embedding)
                width = m.weight.shape[1] if lookup else m.weight.shape[0]
                positions[path] = (out.numel() / (2 * width), lookup)
            hooks.append(sub.register_forward_hook(record))
    try:
        with torch.no_grad():
            skeleton.eval()(row.expand(2, *row.shape))
    except Exception:  # noqa: BLE001 - data-dependent code: priced by its parameters alone
        return None
    finally:
        for h in hooks:
            h.remove()
    return positions


# ----- the sharing rule's price, where there is no bucket (chorus_tune/width_rule.py) ------------
def parameter_cost(key) -> Callable[[dict[str, Shape]], float]:
    """A price of ``key``'s structure at any shapes: its parameter count (where
    no input row can be had to profile with)."""
    names = [n for n, _, _ in key.parameters]

    def cost(shapes: dict[str, Shape]) -> float:
        return float(sum(math.prod(shapes[n]) for n in names))

    return cost


class PaddingPrices:
    """How the pool and the driver, which hold no bucket, price a padded
    family's members: by multiply-adds per sample, as a bucket prices them (a
    :class:`Profile` of the family's model on ``meta`` with one input row of
    the task's data), else by parameters.

    Why not parameters alone: where the swept layers are a small part of the
    work, parameters overprice padding. The PyTorch tutorial's CNN (``l1``,
    ``l2`` from 4 to 256) pads from (4, 4) to (256, 256) at 38x its
    parameters but 1.28x its multiply-adds: priced by parameters, 64 of its
    trials fell into 12 structures; by multiply-adds, into its 4 batch sizes.

    ``row_of`` gives the input row (``Task.input_row``, which may load the
    data once); it is asked at most once, and only when some family first
    shows a second set of widths (``WidthGroups`` prices nothing before). A
    family is priced one way throughout: by parameters where the row cannot
    be had or its model's forward cannot run on ``meta``."""

    def __init__(self, row_of: Callable[[], torch.Tensor]):
        self._row_of = row_of
        self._row: torch.Tensor | None = None
        self._asked = False
        self._profiles: dict = {}  # family -> its Profile, or None: priced by parameters

    def cost(self, family, key, build: Callable[[], nn.Module]) -> Callable[[dict[str, Shape]], float]:
        """The price of ``key``'s members at any shapes (``family``: its padded
        family; ``build``: its model, on ``meta``, built only if a price is asked)."""
        names = [n for n, _, _ in key.parameters]
        by_parameters = parameter_cost(key)

        def cost(shapes: dict[str, Shape]) -> float:
            profile = self._profile(family, build)
            return by_parameters(shapes) if profile is None else profile.cost(shapes, names).macs

        return cost

    def _profile(self, family, build: Callable[[], nn.Module]) -> Profile | None:
        if family not in self._profiles:
            profile, row = None, self._input_row()
            if row is not None:
                try:
                    profile = Profile.of(build(), row)
                    if profile.positions is None:
                        profile = None
                except Exception:  # noqa: BLE001 - a price only: the member's own build reports its errors
                    profile = None
            self._profiles[family] = profile
        return self._profiles[family]

    def _input_row(self) -> torch.Tensor | None:
        if not self._asked:
            self._asked = True
            try:
                self._row = self._row_of()
            except Exception:  # noqa: BLE001 - bad data fails the members' buckets, with its own error
                self._row = None
        return self._row
