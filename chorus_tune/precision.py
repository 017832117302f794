"""The arithmetic a task trains in: ``"fp32"``, or ``"bf16"`` autocast.

Under ``"bf16"`` the forward pass and the loss run under ``torch.autocast``
(bfloat16 for matmuls and convolutions, float32 where autocast keeps it);
parameters, gradients, optimizer state and BatchNorm statistics stay float32.
The fused bucket and ``reference.py`` enter the same context, so the
reference is still the yardstick (docs/design.md D6, "What equivalent means").
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

PRECISIONS = ("fp32", "bf16")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    return precision


def autocast(precision: str, device: torch.device | str) -> ContextManager:
    """The context a forward pass runs in for ``precision`` on ``device``."""
    if check_precision(precision) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
