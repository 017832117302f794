"""Per-sample losses, written so that they vmap over members unchanged."""
from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="none")


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # A (B,) target against a (B, 1) output would broadcast to (B, B) and train on
    # nonsense without an error: match the shapes first.
    if target.shape != output.shape and target.numel() == output.numel():
        target = target.reshape(output.shape)
    per_element = (output - target.to(output.dtype)) ** 2
    return per_element.reshape(per_element.shape[0], -1).mean(dim=1)


NAMED_LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse}


def resolve_loss(loss: Union[str, LossFn]) -> LossFn:
    if callable(loss):
        return loss
    try:
        return NAMED_LOSSES[loss]
    except KeyError:
        raise ValueError(f"loss must be one of {sorted(NAMED_LOSSES)} or a callable; got {loss!r}") from None


def accuracy_count(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=-1) == target).sum()
