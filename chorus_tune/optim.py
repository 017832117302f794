"""Stacked optimizers: one update over (K, ...) tensors, hyperparameters per member.

Stock ``torch.optim`` cannot do this: it rejects a tensor learning rate ("Tensor
lr must be 1-element") and Adam keeps one step count for the whole tensor. Here
every hyperparameter is a ``(K,)`` tensor and every member has its own step
count, and the update of an inactive member is discarded with ``torch.where``
(not multiplied by zero: a NaN member times zero is still NaN), so a retired or
empty slot stays bit-for-bit frozen (docs/design.md D6).

The module is split the way ``torch.optim`` splits ``adam.py``:

* **Update functions** (:func:`stacked_sgd`, :func:`stacked_adam`,
  :func:`stacked_adamw`): the arithmetic alone, on lists of stacked
  parameters, gradients and state tensors, with per-member ``(K,)``
  hyperparameters. They follow torch's single-tensor ``SGD``/``Adam``/``AdamW``
  step for step; ``reference.py`` trains with those stock optimizers and the
  tests hold the two to float tolerance.
* **The family registry** (:data:`FAMILIES`): one :class:`OptimizerFamily` per
  optimizer, naming its hyperparameters with their defaults, its state, its
  update function and the stock optimizer the reference uses. Adding a family
  is one entry and one update function.
* :class:`StackedOptimizer`: the slots and the state (which member holds which
  hyperparameters, step counts, snapshots, compaction), calling its family's
  update function once per fused step.

Learning-rate schedules live in :mod:`chorus_tune.schedules` (re-exported here).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch

from .rows import RowCopies, copy_rows, put_rows
from .schedules import SCHEDULES, as_number, non_negative, schedule_from_config, scheduled_lr
from .widths import Shape, corner, pad_into

__all__ = [
    "FAMILIES", "HYPERPARAMETER_DEFAULTS", "OPTIMIZERS", "SCHEDULES", "OptimizerFamily", "OptimizerSnapshot",
    "StackedOptimizer",
    "build_torch_optimizer", "clip_grad_norms", "max_grad_norm_from_config",
    "hyperparameters", "optimizer_family", "scheduled_lr", "stacked_adam",
    "stacked_adamw", "stacked_sgd",
]

Tensor = torch.Tensor


# ----- the update arithmetic -----------------------------------------------------------------------
# Each function updates its stacked tensors in place and is called under
# torch.no_grad() (StackedOptimizer.step does). ``active`` is the (K,) bool mask
# of the members that step; ``all_active`` says every member does, which lets
# the update run in place with no masking. The ``any_*``/``all_*`` switches say
# which terms some member needs, so the common cases skip whole tensor passes
# (measured: masking and unused terms were 60% of a fused step); they are
# computed once per change of hyperparameters, not per step (no device sync).

def _per_member(values: Tensor, like: Tensor) -> Tensor:
    return values.view(values.shape[0], *([1] * (like.dim() - 1)))


def _commit(target: Tensor, new: Tensor, live: Tensor, all_active: bool) -> None:
    # torch.where, not a multiplication by the mask: NaN * 0 is still NaN.
    target.copy_(new if all_active else torch.where(live, new, target))


def clip_grad_norms(grads: list[Tensor], max_norm: Tensor, clipped: Tensor) -> None:
    """``torch.nn.utils.clip_grad_norm_`` of each member's gradients, in place.

    Each member's total 2-norm is taken over all of its gradients (``grads``
    are stacked ``(K, ...)``); a member whose norm exceeds its ``max_norm``
    has its gradients scaled by ``max_norm / (norm + 1e-6)``, exactly torch's
    rule and epsilon. ``clipped`` ``(K,)`` says which members clip at all: the
    others are multiplied by exactly 1 (bit-for-bit unchanged, even with an
    infinite or NaN norm, where torch's formula would give NaN).
    """
    if not grads:
        return
    # Per parameter, then over parameters: the order torch.nn.utils.clip_grad_norm_ sums in.
    per_param = [g.abs() if g.dim() == 1 else torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(per_param), dim=0)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    coef = torch.where(clipped, coef, torch.ones_like(coef))
    for g in grads:
        g.mul_(_per_member(coef, g))


def stacked_sgd(
    params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], *,
    lr: Tensor, weight_decay: Tensor, momentum: Tensor, dampening: Tensor, nesterov: Tensor,
    one_minus_dampening: Tensor, active: Tensor, has_buffer: Tensor, all_active: bool, all_have_buffer: bool,
    any_weight_decay: bool, any_momentum: bool, any_dampening: bool, any_nesterov: bool, all_nesterov: bool,
) -> None:
    """One ``torch.optim.SGD`` step of every active member.

    ``grads`` are updated in place (they are the step's own). ``has_buffer``
    says which members have a momentum buffer already: torch starts a member's
    buffer as a copy of its first gradient, not as a decayed zero.
    ``all_have_buffer`` says every member has one. A member whose momentum is 0
    must have dampening 0 (torch ignores dampening then, and the shared formula
    gives ``0 * buf + 1 * d_p == d_p`` exactly).
    """
    neg_lr = -lr
    for i, p in enumerate(params):
        def b(v: Tensor, p: Tensor = p) -> Tensor:
            return _per_member(v, p)
        d_p = grads[i].addcmul_(p, b(weight_decay)) if any_weight_decay else grads[i]
        if any_momentum:
            buf = momentum_buffers[i]
            step_in = d_p * b(one_minus_dampening) if any_dampening else d_p
            if all_active and all_have_buffer:
                new_buf = buf.mul_(b(momentum)).add_(step_in)
            else:
                decayed = buf * b(momentum) + step_in
                new_buf = torch.where(b(has_buffer), decayed, d_p)
                _commit(buf, new_buf, b(active), all_active)
            if all_nesterov:
                d_p = d_p.addcmul_(new_buf, b(momentum))
            elif any_nesterov:
                d_p = torch.where(b(nesterov != 0), d_p + b(momentum) * new_buf, new_buf)
            else:
                d_p = new_buf
        if all_active:
            p.addcmul_(d_p, b(neg_lr))
        else:
            _commit(p, p + d_p * b(neg_lr), b(active), all_active)


def stacked_adam(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], *,
    steps: Tensor, lr: Tensor, weight_decay: Tensor, beta1: Tensor, beta2: Tensor, eps: Tensor,
    one_minus_beta1: Tensor, one_minus_beta2: Tensor, beta1_float64: Tensor, beta2_float64: Tensor,
    active: Tensor, all_active: bool, any_weight_decay: bool, decoupled_weight_decay: bool = False,
) -> None:
    """One ``torch.optim.Adam`` step (``AdamW`` with ``decoupled_weight_decay``)
    of every active member. ``steps`` are the members' step counts, this step
    included. ``one_minus_beta*`` and ``beta*_float64`` are the family's
    derived values (``_ADAM_DERIVED``: computed as torch does, in float64)."""
    # Bias corrections in float64 from the betas as configured, as torch.optim
    # computes them in Python floats (not from the float32 betas: 0.999 in
    # float32 is 0.99900001, and 1 - beta2 then 1.3e-5 off).
    steps64 = steps.double()
    bias1 = (1 - beta1_float64 ** steps64).to(lr.dtype)
    bias2_sqrt = (1 - beta2_float64 ** steps64).sqrt().to(lr.dtype)
    if not all_active:  # members that have never stepped would divide by zero
        bias1 = torch.where(active, bias1, torch.ones_like(bias1))
        bias2_sqrt = torch.where(active, bias2_sqrt, torch.ones_like(bias2_sqrt))
    neg_step_size = -lr / bias1
    for i, p in enumerate(params):
        def b(v: Tensor, p: Tensor = p) -> Tensor:
            return _per_member(v, p)
        grad, exp_avg, exp_avg_sq = grads[i], exp_avgs[i], exp_avg_sqs[i]
        if all_active:
            # In place: the out-of-place form below was ~15 full passes per
            # parameter, 55% of a K=64 step (measured against chorus-torch).
            if any_weight_decay:
                if decoupled_weight_decay:
                    p.mul_(b(1 - lr * weight_decay))
                else:
                    grad = grad.addcmul_(p, b(weight_decay))
            exp_avg.lerp_(grad, b(one_minus_beta1))
            exp_avg_sq.mul_(b(beta2)).addcmul_(grad * b(one_minus_beta2), grad)
            denom = exp_avg_sq.sqrt().div_(b(bias2_sqrt)).add_(b(eps))
            p.addcdiv_(exp_avg * b(neg_step_size), denom)
            continue
        live = b(active)
        param = p
        if any_weight_decay:
            if decoupled_weight_decay:
                param = p * b(1 - lr * weight_decay)
            else:
                grad = grad + b(weight_decay) * p
        new_avg = exp_avg.lerp(grad, b(one_minus_beta1).expand_as(grad))
        new_sq = exp_avg_sq * b(beta2) + b(one_minus_beta2) * grad * grad
        denom = new_sq.sqrt() / b(bias2_sqrt) + b(eps)
        _commit(exp_avg, new_avg, live, all_active)
        _commit(exp_avg_sq, new_sq, live, all_active)
        _commit(p, param + b(neg_step_size) * new_avg / denom, live, all_active)


def stacked_adamw(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                  exp_avg_sqs: list[Tensor], **kwargs: Any) -> None:
    """One ``torch.optim.AdamW`` step: :func:`stacked_adam` with decoupled weight decay."""
    stacked_adam(params, grads, exp_avgs, exp_avg_sqs, decoupled_weight_decay=True, **kwargs)


# ----- the families --------------------------------------------------------------------------------

def _no_check(hp: dict) -> None:
    return None


@dataclass(frozen=True)
class OptimizerFamily:
    """Everything chorus_tune knows about one optimizer family, in one place.

    - ``defaults``: every hyperparameter a config may set for this family
      (``lr`` included), with its default;
    - ``switches``: those that are on/off flags, not non-negative numbers;
    - ``state_names``: the per-parameter state tensors, each shaped like the
      parameter;
    - ``update``: the update function :meth:`StackedOptimizer.step` calls;
    - ``build_torch``: the stock ``torch.optim`` optimizer for one member (the
      reference's);
    - ``needed_terms``: from the ``(K,)`` hyperparameter tensors, which terms
      some member needs (the update's ``any_*``/``all_*`` switches);
    - ``check``: the family's own rules on filled-in hyperparameters (raises
      ``ValueError``);
    - ``member_values``: the per-member values the update reads, from filled-in
      hyperparameters (default: each tensor hyperparameter as a float);
    - ``lazy_state``: the state starts as a copy of a member's first gradient,
      not as zeros (SGD's momentum buffer), so the optimizer tracks which
      members have it and hands that to the update (``has_buffer``,
      ``all_have_buffer``);
    - ``reads_steps``: the update reads the members' step counts (``steps``,
      for Adam's bias corrections);
    - ``derived``: per-member values the update reads beside the
      hyperparameters, computed from them in Python floats as ``torch.optim``
      computes them (Adam's ``1 - beta2``: in float32 arithmetic it is 1.3e-5
      off torch's, and so was every ``exp_avg_sq``); those named in
      ``float64_values`` are held in float64 (Adam's betas for the bias
      corrections), the others in the parameters' float32.

    A family pickles as its name: it is the registry's entry on the other side.
    """

    name: str
    defaults: Mapping[str, Any]
    state_names: tuple[str, ...]
    update: Callable[..., None]
    build_torch: Callable[[Iterable, dict], torch.optim.Optimizer]
    needed_terms: Callable[[Mapping[str, Tensor]], dict[str, bool]]
    check: Callable[[dict], None] = _no_check
    member_values: Callable[[dict], dict[str, float]] | None = None
    switches: tuple[str, ...] = ()
    lazy_state: bool = False
    reads_steps: bool = False
    derived: Mapping[str, Callable[[dict], float]] = field(default_factory=dict)
    float64_values: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "derived", MappingProxyType(dict(self.derived)))

    def __reduce__(self) -> tuple:
        return optimizer_family, (self.name,)

    @property
    def tensor_hyperparameters(self) -> tuple[str, ...]:
        """The hyperparameters held as ``(K,)`` tensors: all but ``lr``, which
        the schedule gives per step."""
        return tuple(name for name in self.defaults if name != "lr")

    @property
    def member_value_names(self) -> tuple[str, ...]:
        """Every ``(K,)`` tensor the optimizer holds per member: the tensor
        hyperparameters, then the derived values."""
        return (*self.tensor_hyperparameters, *self.derived)

    def values_for(self, hp: dict) -> dict[str, float]:
        """The member's value of each of :attr:`member_value_names`, from its
        filled-in hyperparameters."""
        if self.member_values is not None:
            values = self.member_values(hp)
        else:
            values = {name: float(hp[name]) for name in self.tensor_hyperparameters}
        return {**values, **{name: float(fn(values)) for name, fn in self.derived.items()}}


def _sgd_check(hp: dict) -> None:
    if hp["nesterov"] and (hp["momentum"] <= 0 or hp["dampening"] != 0):
        raise ValueError("nesterov momentum requires momentum > 0 and dampening = 0")


def _sgd_member_values(hp: dict) -> dict[str, float]:
    values = {name: float(hp[name]) for name in ("momentum", "dampening", "nesterov", "weight_decay")}
    if hp["momentum"] == 0:
        # torch ignores dampening without momentum; with it zeroed the shared
        # momentum formula gives 0 * buf + 1 * d_p == d_p exactly for this member.
        values["dampening"] = 0.0
    return values


def _sgd_needed_terms(hp: Mapping[str, Tensor]) -> dict[str, bool]:
    return {
        "any_weight_decay": bool((hp["weight_decay"] != 0).any()),
        "any_momentum": bool((hp["momentum"] != 0).any()),
        "any_dampening": bool((hp["dampening"] != 0).any()),
        "any_nesterov": bool((hp["nesterov"] != 0).any()),
        "all_nesterov": bool((hp["nesterov"] != 0).all()),
    }


def _sgd_torch(params: Iterable, hp: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"], dampening=hp["dampening"],
                           nesterov=bool(hp["nesterov"]), weight_decay=hp["weight_decay"])


def _adam_check(hp: dict) -> None:
    if not (hp["beta1"] < 1 and hp["beta2"] < 1):
        raise ValueError(f"betas must be below 1; got ({hp['beta1']}, {hp['beta2']})")


def _adam_needed_terms(hp: Mapping[str, Tensor]) -> dict[str, bool]:
    return {"any_weight_decay": bool((hp["weight_decay"] != 0).any())}


def _adam_torch(cls: type) -> Callable[[Iterable, dict], torch.optim.Optimizer]:
    def build(params: Iterable, hp: dict) -> torch.optim.Optimizer:
        return cls(params, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                   weight_decay=hp["weight_decay"])
    return build


_ADAM_DEFAULTS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
# What torch.optim.Adam computes from the betas in Python floats (see OptimizerFamily.derived).
_ADAM_DERIVED = {"one_minus_beta1": lambda v: 1 - v["beta1"], "one_minus_beta2": lambda v: 1 - v["beta2"],
                 "beta1_float64": lambda v: v["beta1"], "beta2_float64": lambda v: v["beta2"]}
_ADAM_FLOAT64 = ("beta1_float64", "beta2_float64")

FAMILIES: Mapping[str, OptimizerFamily] = MappingProxyType({
    family.name: family for family in (
        OptimizerFamily(
            name="sgd",
            defaults={"lr": 0.01, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
            switches=("nesterov",),
            state_names=("momentum_buffer",),
            lazy_state=True,
            check=_sgd_check,
            member_values=_sgd_member_values,
            # torch.optim.SGD scales the gradient by 1 - dampening, a Python float.
            derived={"one_minus_dampening": lambda v: 1 - v["dampening"]},
            needed_terms=_sgd_needed_terms,
            update=stacked_sgd,
            build_torch=_sgd_torch,
        ),
        OptimizerFamily(
            name="adam",
            defaults={**_ADAM_DEFAULTS, "weight_decay": 0.0},
            state_names=("exp_avg", "exp_avg_sq"),
            check=_adam_check,
            needed_terms=_adam_needed_terms,
            reads_steps=True,
            derived=_ADAM_DERIVED,
            float64_values=_ADAM_FLOAT64,
            update=stacked_adam,
            build_torch=_adam_torch(torch.optim.Adam),
        ),
        OptimizerFamily(
            name="adamw",
            defaults={**_ADAM_DEFAULTS, "weight_decay": 0.01},
            state_names=("exp_avg", "exp_avg_sq"),
            check=_adam_check,
            needed_terms=_adam_needed_terms,
            reads_steps=True,
            derived=_ADAM_DERIVED,
            float64_values=_ADAM_FLOAT64,
            update=stacked_adamw,
            build_torch=_adam_torch(torch.optim.AdamW),
        ),
    )
})

# Views of the registry, under the names other modules import.
OPTIMIZERS: tuple[str, ...] = tuple(FAMILIES)
HYPERPARAMETER_DEFAULTS: dict[str, dict[str, Any]] = {name: dict(f.defaults) for name, f in FAMILIES.items()}


def optimizer_family(name: str) -> OptimizerFamily:
    """The registry entry of ``name``, or a ``ValueError`` naming the families."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {name!r}") from None


def hyperparameters(family: str, config: dict) -> dict[str, Any]:
    """The optimizer hyperparameters a config asks for, defaults filled in and
    checked, plus its learning-rate ``schedule``."""
    spec = optimizer_family(family)
    hp = {name: config.get(name, default) for name, default in spec.defaults.items()}
    for name, default in spec.defaults.items():
        if name not in spec.switches:  # numpy and 0-d tensor numbers taken as floats; bools refused
            hp[name] = non_negative(config, name, default)
    spec.check(hp)
    hp["schedule"] = schedule_from_config(config)
    hp["max_grad_norm"] = max_grad_norm_from_config(config)
    return hp


def max_grad_norm_from_config(config: dict) -> float | None:
    """The config's ``max_grad_norm`` (``None``, or absent: no clipping), checked.

    Any optimizer family: the member's gradients are clipped to that total
    2-norm before its update, as ``torch.nn.utils.clip_grad_norm_`` does.
    """
    value = config.get("max_grad_norm")
    if value is None:
        return None
    number = as_number(value)  # numpy and 0-d tensor numbers too
    if number is None or math.isnan(number) or number < 0:
        raise ValueError(f"max_grad_norm must be a non-negative number, or None for no clipping; got {value!r}")
    return number


def build_torch_optimizer(family: str, params, hp: dict[str, Any]) -> torch.optim.Optimizer:
    """The stock ``torch.optim`` optimizer for one member (the reference's)."""
    return optimizer_family(family).build_torch(params, hp)


# ----- slots and state -----------------------------------------------------------------------------

@dataclass
class OptimizerSnapshot:
    """What :meth:`StackedOptimizer.snapshot` saved: the rows of every state
    tensor, and which of those rows had no momentum buffer yet."""

    rows: RowCopies
    without_buffer: set[int]


class StackedOptimizer:
    """One optimizer family over stacked ``(capacity, ...)`` parameters.

    ``set_member`` loads one slot's hyperparameters (and optionally its saved
    state); ``step`` updates every active slot with its own learning rate, by
    the family's update function.
    """

    def __init__(self, family: str, params: dict[str, Tensor]):
        self.family = family
        self.spec = optimizer_family(family)
        self.params = params
        first = next(iter(params.values()))
        capacity, device = first.shape[0], first.device
        self.hp = {name: torch.zeros(capacity, device=device,
                                     dtype=torch.float64 if name in self.spec.float64_values else None)
                   for name in self.spec.member_value_names}
        self.steps = torch.zeros(capacity, device=device)
        # Each member's max_grad_norm; inf: it does not clip (config key, any family).
        self.max_grad_norm = torch.full((capacity,), math.inf, device=device)
        self._clipped: Tensor | None = None  # cached by _clipping: which members clip
        self._clips: bool | None = None  # cached by _clipping: whether any does
        # Families with lazy state (SGD creates its momentum buffer on a member's
        # first step, a copy of the gradient): track which members have it.
        self.has_buffer = torch.zeros(capacity, dtype=torch.bool, device=device)
        self._without_buffer: set[int] = set(range(capacity))  # host-side mirror: no GPU sync per step
        # Caches of what each step hands the update function, so a step costs no
        # more host work than the arithmetic: rebuilt after any change below.
        self._terms: dict[str, bool] | None = None
        self._inputs: dict[str, Any] | None = None
        self._gathered: tuple | None = None
        self.state = {
            name: {s: torch.zeros_like(p) for s in self.spec.state_names} for name, p in params.items()
        }

    def set_member(self, slot: int, hp: dict[str, Any], saved: dict[str, Any] | None = None) -> None:
        for name, value in self.spec.values_for(hp).items():
            self.hp[name][slot] = value
        max_norm = hp.get("max_grad_norm")
        self.max_grad_norm[slot] = math.inf if max_norm is None else max_norm
        self._hyperparameters_changed()
        if saved is None:
            self.steps[slot] = 0
            self.has_buffer[slot] = False
            self._without_buffer.add(slot)
            for per_param in self.state.values():
                for tensor in per_param.values():
                    tensor[slot].zero_()
            return
        self.steps[slot] = float(saved["step"])
        has_buffer = bool(saved.get("has_buffer", False))
        self.has_buffer[slot] = has_buffer
        if has_buffer:
            self._without_buffer.discard(slot)
        else:
            self._without_buffer.add(slot)
        for name, per_param in self.state.items():
            for state_name, tensor in per_param.items():
                # A narrower member's state fills the corner of a padded row (chorus_tune/widths.py).
                pad_into(tensor[slot], saved["tensors"][name][state_name].to(tensor.device))

    def member_state(self, slot: int, shapes: Mapping[str, Shape] | None = None) -> dict[str, Any]:
        """``slot``'s optimizer state; ``shapes``: the member's own parameter
        shapes, where the stack is padded (its state is given back at those)."""
        def own(name: str, t: Tensor) -> Tensor:
            row = t[slot].detach()
            if shapes is not None and tuple(row.shape) != tuple(shapes[name]):
                row = row[corner(tuple(shapes[name]))]
            return row.cpu().clone()

        return {
            "family": self.family,
            "step": int(self.steps[slot].item()),
            "has_buffer": bool(self.has_buffer[slot].item()),
            "tensors": {
                name: {s: own(name, t) for s, t in per_param.items()}
                for name, per_param in self.state.items()
            },
        }

    def grow(self) -> None:
        """Widen the state to the parameters' shapes after the stack grew
        (``MemberStack.grow``): each member's state in the leading corner."""
        for name, per_param in self.state.items():
            shape = tuple(self.params[name].shape)
            for state_name, t in per_param.items():
                if tuple(t.shape) != shape:
                    new = torch.zeros(shape, dtype=t.dtype, device=t.device)
                    new[(slice(None), *corner(tuple(t.shape[1:])))] = t
                    per_param[state_name] = new
        self._gathered = None

    def tensors(self) -> list[Tensor]:
        """Every tensor of optimizer state, hyperparameters included."""
        out = [self.steps, self.has_buffer, self.max_grad_norm, *self.hp.values()]
        for per_param in self.state.values():
            out.extend(per_param.values())
        return out

    def snapshot(self, rows: list[int] | None = None, to_host: bool = False) -> OptimizerSnapshot:
        """Copies of every member's optimizer state (of ``rows`` only, if
        given), for :meth:`restore`. ``to_host``: see :func:`chorus_tune.rows.copy_rows`."""
        without = set(self._without_buffer)
        return OptimizerSnapshot(copy_rows(self.tensors(), rows, to_host),
                                 without if rows is None else without.intersection(rows))

    def restore(self, snapshot: OptimizerSnapshot) -> None:
        """Put back what :meth:`snapshot` copied (only its rows; the others keep their state)."""
        put_rows(self.tensors(), snapshot.rows)
        # The host-side mirror of "no momentum buffer yet" must follow the rows put back.
        if snapshot.rows.rows is None:
            self._without_buffer = set(snapshot.without_buffer)
        else:
            self._without_buffer.difference_update(snapshot.rows.rows)
            self._without_buffer.update(snapshot.without_buffer)
        self._hyperparameters_changed()  # they were restored too

    def select(self, rows: list[int], params: dict[str, Tensor]) -> None:
        """Keep only ``rows`` of every member-indexed tensor (compaction), renumbered from 0."""
        index = torch.tensor(rows, device=self.steps.device)
        self.params = params
        self.steps = self.steps[index].clone()
        self.has_buffer = self.has_buffer[index].clone()
        self.max_grad_norm = self.max_grad_norm[index].clone()
        self.hp = {n: t[index].clone() for n, t in self.hp.items()}
        self.state = {n: {s: t[index].clone() for s, t in pp.items()} for n, pp in self.state.items()}
        self._without_buffer = {new for new, old in enumerate(rows) if old in self._without_buffer}
        self._hyperparameters_changed()
        self._gathered = None

    def gathered(self, rows: list[int], params: dict[str, Tensor]) -> "StackedOptimizer":
        """An optimizer over copies of ``rows`` only, for ``params`` (a
        :meth:`MemberStack.gathered` stack of the same rows). This one is not
        touched; :meth:`put_back` copies the trained rows home."""
        view = copy.copy(self)
        view.select(rows, params)  # select rebinds every per-row attribute of the copy
        return view

    def put_back(self, rows: list[int], view: "StackedOptimizer") -> None:
        """Copy the state ``view`` (from :meth:`gathered` with ``rows``) trained
        back into ``rows``: step counts, momentum-buffer flags and state tensors.
        Hyperparameters do not change in training and are not copied."""
        index = torch.tensor(rows, device=self.steps.device)
        self.steps.index_copy_(0, index, view.steps)
        self.has_buffer.index_copy_(0, index, view.has_buffer)
        for name, per_param in self.state.items():
            for state_name, tensor in per_param.items():
                tensor.index_copy_(0, index, view.state[name][state_name])
        without = {rows[new] for new in view._without_buffer}
        self._without_buffer.difference_update(rows)
        self._without_buffer.update(without)

    def _hyperparameters_changed(self) -> None:
        self._terms = self._inputs = None
        self._clipped = self._clips = None

    def _clipping(self) -> Tensor | None:
        """Which members clip their gradients (``(K,)`` bool), or ``None`` when
        none does: then the step skips clipping altogether (cached until a
        member's hyperparameters change, so no device sync per step)."""
        if self._clips is None:
            self._clipped = torch.isfinite(self.max_grad_norm)
            self._clips = bool(self._clipped.any())
        return self._clipped if self._clips else None

    def needed_terms(self) -> dict[str, bool]:
        """Which terms some member needs (cached until a member's hyperparameters change)."""
        if self._terms is None:
            self._terms = self.spec.needed_terms(self.hp)
        return self._terms

    def _update_inputs(self) -> dict[str, Any]:
        # The update function's keyword inputs that hold between changes: the
        # (K,) hyperparameters, the needed terms, and the family's extras.
        if self._inputs is None:
            inputs = dict(self.hp, **self.needed_terms())
            if self.spec.reads_steps:
                inputs["steps"] = self.steps
            if self.spec.lazy_state:
                inputs["has_buffer"] = self.has_buffer
            self._inputs = inputs
        return self._inputs

    def _with_grads(self) -> tuple[list[Tensor], list[list[Tensor]]]:
        # The parameters that have a gradient this step, and their state tensors
        # as one list per state name (the update functions' arguments).
        names = tuple(name for name, p in self.params.items() if p.grad is not None)
        if self._gathered is None or self._gathered[0] != names:
            params = [self.params[name] for name in names]
            state = [[self.state[name][s] for name in names] for s in self.spec.state_names]
            self._gathered = (names, params, state)
        return self._gathered[1], self._gathered[2]

    @torch.no_grad()
    def step(self, lr: Tensor, active: Tensor, active_slots: list[int]) -> None:
        """One update of the members in ``active_slots`` (``active`` is the same as a mask)."""
        all_active = len(active_slots) == len(self.steps)
        if all_active:
            self.steps.add_(1)
        else:
            self.steps.add_(active.to(self.steps.dtype))
        spec = self.spec
        params, state = self._with_grads()
        grads = [p.grad for p in params]
        clipped = self._clipping()
        if clipped is not None:  # before the update reads them (SGD adds weight decay into them in place)
            clip_grad_norms(grads, self.max_grad_norm, clipped)
        extra = {"all_have_buffer": not self._without_buffer} if spec.lazy_state else {}
        spec.update(params, grads, *state, lr=lr, active=active, all_active=all_active,
                    **self._update_inputs(), **extra)
        if spec.lazy_state:
            self.has_buffer |= active
            self._without_buffer.difference_update(active_slots)
