"""Learning-rate schedules, per member and per optimizer step (docs/design.md D6).

A config picks one with ``lr_schedule``: ``"constant"`` (default), ``"cosine"``
(``t_max``, ``lr_min``) or ``"step"`` (``step_size``, ``gamma``), all counted in
optimizer steps, plus ``warmup_steps`` of linear warm-up on top of any of
them. :func:`schedule_from_config` reads and checks those keys once, when a
member joins; :func:`scheduled_lr` is then a pure function of the base rate and
the step. The bucket builds a ``(steps, K)`` table of rates per iteration from
it, and ``reference.py`` sets the stock optimizer's rate from it each step, so
the fused and unfused runs read the same numbers.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Any

SCHEDULES = ("constant", "cosine", "step")
# The config keys each schedule reads (besides ``lr_schedule`` and ``warmup_steps``).
SCHEDULE_KEYS = {"constant": (), "cosine": ("t_max", "lr_min"), "step": ("step_size", "gamma")}


def as_number(value: Any) -> float | None:
    """``value`` as a float if it is a real number: Python's, numpy's
    (``np.float32(0.1)``) or a 0-d tensor or array (``torch.tensor(0.1)``);
    ``None`` for anything else, a bool included (``lr=True`` is a mistake,
    not 1.0)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "shape", None) == () and hasattr(value, "item"):
        item = value.item()
        if isinstance(item, numbers.Real) and not isinstance(item, bool):
            return float(item)
    return None


def as_count(value: Any, what: str, minimum: int) -> int:
    """``value`` as an integer of at least ``minimum``, or a ``ValueError``
    naming ``what``. Integers of any kind are taken, and floats with an
    integral value (``tune.quniform`` gives ``30.0``); a fraction is refused,
    not truncated (``16.7`` would silently train as ``16``), and so is a bool."""
    number = None
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            real = as_number(value)
            if real is not None and real.is_integer():
                number = int(real)
    if number is None or number < minimum:
        bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{what} must be {bound}; got {value!r}")
    return number


def non_negative(config: dict, key: str, default: float) -> float:
    """The config's ``key`` as a finite non-negative float (``default`` when absent)."""
    value = config.get(key, default)
    number = as_number(value)
    if number is None or not 0 <= number < math.inf:
        raise ValueError(f"{key} must be a finite non-negative number (default {default}); got {value!r}")
    return number


def schedule_from_config(config: dict) -> dict[str, Any]:
    """The schedule a config asks for, defaults filled in and checked: a
    length of 0 would divide by zero at every iteration of the bucket (every
    member's, not only this one's), and a negative ``gamma`` or ``lr_min``
    would give a negative learning rate."""
    kind = config.get("lr_schedule", "constant")
    if kind not in SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {SCHEDULES}; got {kind!r}")
    warmup = as_count(config.get("warmup_steps", 0), "warmup_steps (optimizer steps of linear warm-up)", 0)
    schedule = {"kind": kind, "warmup_steps": warmup}
    if kind == "cosine":
        if "t_max" not in config:
            raise ValueError("lr_schedule='cosine' needs t_max (the number of optimizer steps to anneal over)")
        schedule.update(t_max=as_count(config["t_max"], "t_max (optimizer steps to anneal over)", 1),
                        lr_min=non_negative(config, "lr_min", 0.0))
    elif kind == "step":
        if "step_size" not in config:
            raise ValueError("lr_schedule='step' needs step_size (optimizer steps between decays)")
        schedule.update(step_size=as_count(config["step_size"], "step_size (optimizer steps between decays)", 1),
                        gamma=non_negative(config, "gamma", 0.1))
    return schedule


def scheduled_lr(base_lr: float, schedule: dict[str, Any], step: int) -> float:
    """Learning rate for the optimizer step with 0-based index ``step``."""
    kind = schedule["kind"]
    if kind == "cosine":
        t = min(step, schedule["t_max"])
        lr_min = schedule["lr_min"]
        lr = lr_min + (base_lr - lr_min) * (1 + math.cos(math.pi * t / schedule["t_max"])) / 2
    elif kind == "step":
        try:
            lr = base_lr * schedule["gamma"] ** (step // schedule["step_size"])
        except OverflowError:  # gamma > 1 for long enough: inf, as repeated multiplication gives, not a raise
            lr = math.inf
    else:
        lr = base_lr
    warmup = schedule["warmup_steps"]
    if warmup > 0 and step < warmup:
        lr *= (step + 1) / warmup
    return lr
