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
from typing import Any

SCHEDULES = ("constant", "cosine", "step")


def schedule_from_config(config: dict) -> dict[str, Any]:
    """The schedule a config asks for, defaults filled in and checked."""
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
