"""Stacked optimizers: one update over (K, ...) tensors, hyperparameters per member.

Stock ``torch.optim`` cannot do this: it rejects a tensor learning rate ("Tensor
lr must be 1-element") and Adam keeps one step count for the whole tensor. Here
every hyperparameter is a ``(K,)`` tensor and every member has its own step
count, and the update of an inactive member is discarded with ``torch.where``
(not multiplied by zero: a NaN member times zero is still NaN), so a retired or
empty slot stays bit-for-bit frozen.

The arithmetic follows ``torch.optim.SGD``/``Adam``/``AdamW`` (single-tensor
implementations) step for step; ``reference.py`` uses those stock optimizers
and the tests hold the two to float tolerance.
"""
from __future__ import annotations

import math
from typing import Any

import torch

HYPERPARAMETER_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.01, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
    "adam": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01},
}

SCHEDULES = ("constant", "cosine", "step")


def hyperparameters(family: str, config: dict) -> dict[str, Any]:
    """The optimizer hyperparameters a config asks for, defaults filled in and checked."""
    hp = {name: config.get(name, default) for name, default in HYPERPARAMETER_DEFAULTS[family].items()}
    for name, value in hp.items():
        if name != "nesterov" and not (isinstance(value, (int, float)) and value >= 0):
            raise ValueError(f"{name} must be a non-negative number; got {value!r}")
    if family == "sgd" and hp["nesterov"] and (hp["momentum"] <= 0 or hp["dampening"] != 0):
        raise ValueError("nesterov momentum requires momentum > 0 and dampening = 0")
    if family != "sgd" and not (hp["beta1"] < 1 and hp["beta2"] < 1):
        raise ValueError(f"betas must be below 1; got ({hp['beta1']}, {hp['beta2']})")
    hp["schedule"] = _schedule(config)
    return hp


def _schedule(config: dict) -> dict[str, Any]:
    kind = config.get("lr_schedule", "constant")
    if kind not in SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {SCHEDULES}; got {kind!r}")
    schedule = {"kind": kind, "warmup_steps": int(config.get("warmup_steps", 0))}
    if kind == "cosine":
        if "t_max" not in config:
            raise ValueError("lr_schedule='cosine' needs t_max (the number of optimizer steps to anneal over)")
        schedule.update(t_max=int(config["t_max"]), lr_min=float(config.get("lr_min", 0.0)))
    elif kind == "step":
        if "step_size" not in config:
            raise ValueError("lr_schedule='step' needs step_size (optimizer steps between decays)")
        schedule.update(step_size=int(config["step_size"]), gamma=float(config.get("gamma", 0.1)))
    return schedule


def scheduled_lr(base_lr: float, schedule: dict[str, Any], step: int) -> float:
    """Learning rate for the optimizer step with 0-based index ``step``."""
    kind = schedule["kind"]
    if kind == "cosine":
        t = min(step, schedule["t_max"])
        lr_min = schedule["lr_min"]
        lr = lr_min + (base_lr - lr_min) * (1 + math.cos(math.pi * t / schedule["t_max"])) / 2
    elif kind == "step":
        lr = base_lr * schedule["gamma"] ** (step // schedule["step_size"])
    else:
        lr = base_lr
    warmup = schedule["warmup_steps"]
    if warmup > 0 and step < warmup:
        lr *= (step + 1) / warmup
    return lr


def _per_member(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.view(values.shape[0], *([1] * (like.dim() - 1)))


class StackedOptimizer:
    """SGD, Adam or AdamW over stacked ``(capacity, ...)`` parameters.

    ``set_member`` loads one slot's hyperparameters (and optionally its saved
    state); ``step`` updates every active slot with its own learning rate.
    """

    _HP_NAMES = {
        "sgd": ("weight_decay", "momentum", "dampening", "nesterov"),
        "adam": ("weight_decay", "beta1", "beta2", "eps"),
        "adamw": ("weight_decay", "beta1", "beta2", "eps"),
    }
    _STATE_NAMES = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq")}

    def __init__(self, family: str, params: dict[str, torch.Tensor]):
        self.family = family
        self.params = params
        first = next(iter(params.values()))
        capacity, device = first.shape[0], first.device
        self.hp = {name: torch.zeros(capacity, device=device) for name in self._HP_NAMES[family]}
        self.steps = torch.zeros(capacity, device=device)
        # SGD creates its momentum buffer on a member's first step (a copy of the
        # gradient, not a decayed zero): track which members have one.
        self.has_buffer = torch.zeros(capacity, dtype=torch.bool, device=device)
        self._without_buffer: set[int] = set(range(capacity))  # host-side mirror: no GPU sync per step
        self._flags: dict[str, bool] | None = None
        self.state = {
            name: {s: torch.zeros_like(p) for s in self._STATE_NAMES[family]} for name, p in params.items()
        }

    def set_member(self, slot: int, hp: dict[str, Any], saved: dict[str, Any] | None = None) -> None:
        for name in self._HP_NAMES[self.family]:
            self.hp[name][slot] = float(hp[name])
        if self.family == "sgd" and hp["momentum"] == 0:
            # torch ignores dampening without momentum; with it zeroed the shared
            # momentum formula gives 0 * buf + 1 * d_p == d_p exactly for this member.
            self.hp["dampening"][slot] = 0.0
        self._flags = None
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
                tensor[slot].copy_(saved["tensors"][name][state_name])

    def member_state(self, slot: int) -> dict[str, Any]:
        return {
            "family": self.family,
            "step": int(self.steps[slot].item()),
            "has_buffer": bool(self.has_buffer[slot].item()),
            "tensors": {
                name: {s: t[slot].detach().cpu().clone() for s, t in per_param.items()}
                for name, per_param in self.state.items()
            },
        }

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of optimizer state, hyperparameters included."""
        out = [self.steps, self.has_buffer, *self.hp.values()]
        for per_param in self.state.values():
            out.extend(per_param.values())
        return out

    def snapshot(self) -> tuple[list[torch.Tensor], set[int]]:
        return [t.clone() for t in self.tensors()], set(self._without_buffer)

    def restore(self, snapshot: tuple[list[torch.Tensor], set[int]]) -> None:
        saved, without_buffer = snapshot
        for t, value in zip(self.tensors(), saved):
            t.copy_(value)
        self._without_buffer = set(without_buffer)

    def select(self, rows: list[int], params: dict[str, torch.Tensor]) -> None:
        """Keep only ``rows`` of every member-indexed tensor (compaction), renumbered from 0."""
        index = torch.tensor(rows, device=self.steps.device)
        self.params = params
        self.steps = self.steps[index].clone()
        self.has_buffer = self.has_buffer[index].clone()
        self.hp = {n: t[index].clone() for n, t in self.hp.items()}
        self.state = {n: {s: t[index].clone() for s, t in pp.items()} for n, pp in self.state.items()}
        self._without_buffer = {new for new, old in enumerate(rows) if old in self._without_buffer}
        self._flags = None

    def _hp_flags(self) -> dict[str, bool]:
        # Which terms any member needs, so the common cases skip whole tensor
        # passes (measured: masking and unused terms were 60% of a fused step).
        if self._flags is None:
            hp = self.hp
            flags = {"any_wd": bool((hp["weight_decay"] != 0).any())}
            if self.family == "sgd":
                flags.update(
                    any_momentum=bool((hp["momentum"] != 0).any()),
                    any_dampening=bool((hp["dampening"] != 0).any()),
                    any_nesterov=bool((hp["nesterov"] != 0).any()),
                    all_nesterov=bool((hp["nesterov"] != 0).all()),
                )
            self._flags = flags
        return self._flags

    @torch.no_grad()
    def step(self, lr: torch.Tensor, active: torch.Tensor, active_slots: list[int]) -> None:
        """One update of the members in ``active_slots`` (``active`` is the same as a mask)."""
        all_active = len(active_slots) == len(self.steps)
        if all_active:
            self.steps.add_(1)
        else:
            self.steps.add_(active.to(self.steps.dtype))
        if self.family == "sgd":
            self._sgd(lr, active, all_active)
            self.has_buffer |= active
            self._without_buffer.difference_update(active_slots)
        else:
            self._adam(lr, active, all_active)

    @staticmethod
    def _commit(target: torch.Tensor, new: torch.Tensor, live: torch.Tensor, all_active: bool) -> None:
        # torch.where, not a multiplication by the mask: NaN * 0 is still NaN.
        target.copy_(new if all_active else torch.where(live, new, target))

    def _sgd(self, lr: torch.Tensor, active: torch.Tensor, all_active: bool) -> None:
        flags = self._hp_flags()
        wd, momentum, dampening = self.hp["weight_decay"], self.hp["momentum"], self.hp["dampening"]
        neg_lr = -lr
        for name, p in self.params.items():
            if p.grad is None:
                continue
            def b(v: torch.Tensor) -> torch.Tensor:
                return _per_member(v, p)
            # The gradient is ours (set to None before every step): update it in place.
            d_p = p.grad.addcmul_(p, b(wd)) if flags["any_wd"] else p.grad
            if flags["any_momentum"]:
                buf = self.state[name]["momentum_buffer"]
                step_in = d_p * b(1 - dampening) if flags["any_dampening"] else d_p
                if all_active and not self._without_buffer:
                    new_buf = buf.mul_(b(momentum)).add_(step_in)
                else:
                    # torch starts a member's buffer as a copy of its first gradient.
                    decayed = buf * b(momentum) + step_in
                    new_buf = torch.where(b(self.has_buffer), decayed, d_p)
                    self._commit(buf, new_buf, b(active), all_active)
                if flags["all_nesterov"]:
                    d_p = d_p.addcmul_(new_buf, b(momentum))
                elif flags["any_nesterov"]:
                    d_p = torch.where(b(self.hp["nesterov"] != 0), d_p + b(momentum) * new_buf, new_buf)
                else:
                    d_p = new_buf
            if all_active:
                p.addcmul_(d_p, b(neg_lr))
            else:
                self._commit(p, p + d_p * b(neg_lr), b(active), all_active)

    def _adam(self, lr: torch.Tensor, active: torch.Tensor, all_active: bool) -> None:
        flags = self._hp_flags()
        wd, beta1, beta2, eps = (self.hp[n] for n in ("weight_decay", "beta1", "beta2", "eps"))
        # Bias corrections in float64, as torch.optim computes them in Python floats.
        steps = self.steps.double()
        bias1 = (1 - beta1.double() ** steps).to(lr.dtype)
        bias2_sqrt = (1 - beta2.double() ** steps).sqrt().to(lr.dtype)
        if not all_active:  # members that have never stepped would divide by zero
            bias1 = torch.where(active, bias1, torch.ones_like(bias1))
            bias2_sqrt = torch.where(active, bias2_sqrt, torch.ones_like(bias2_sqrt))
        neg_step_size = -lr / bias1
        decoupled = self.family == "adamw"
        for name, p in self.params.items():
            if p.grad is None:
                continue
            def b(v: torch.Tensor) -> torch.Tensor:
                return _per_member(v, p)
            grad = p.grad
            exp_avg, exp_avg_sq = self.state[name]["exp_avg"], self.state[name]["exp_avg_sq"]
            if all_active:
                # In place: the out-of-place form below was ~15 full passes per
                # parameter, 55% of a K=64 step (measured against chorus-torch).
                if flags["any_wd"]:
                    if decoupled:
                        p.mul_(b(1 - lr * wd))
                    else:
                        grad = grad.addcmul_(p, b(wd))
                exp_avg.lerp_(grad, b(1 - beta1))
                exp_avg_sq.mul_(b(beta2)).addcmul_(grad * b(1 - beta2), grad)
                denom = exp_avg_sq.sqrt().div_(b(bias2_sqrt)).add_(b(eps))
                p.addcdiv_(exp_avg * b(neg_step_size), denom)
                continue
            live = b(active)
            param = p
            if flags["any_wd"]:
                if decoupled:
                    param = p * b(1 - lr * wd)
                else:
                    grad = grad + b(wd) * p
            new_avg = exp_avg.lerp(grad, b(1 - beta1).expand_as(grad))
            new_sq = exp_avg_sq * b(beta2) + b(1 - beta2) * grad * grad
            denom = new_sq.sqrt() / b(bias2_sqrt) + b(eps)
            self._commit(exp_avg, new_avg, live, all_active)
            self._commit(exp_avg_sq, new_sq, live, all_active)
            self._commit(p, param + b(neg_step_size) * new_avg / denom, live, all_active)


def build_torch_optimizer(family: str, params, hp: dict[str, Any]) -> torch.optim.Optimizer:
    """The stock ``torch.optim`` optimizer for one member (the reference's)."""
    if family == "sgd":
        return torch.optim.SGD(
            params, lr=hp["lr"], momentum=hp["momentum"], dampening=hp["dampening"],
            nesterov=bool(hp["nesterov"]), weight_decay=hp["weight_decay"],
        )
    cls = torch.optim.Adam if family == "adam" else torch.optim.AdamW
    return cls(params, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"], weight_decay=hp["weight_decay"])
