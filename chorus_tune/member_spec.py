"""What one member's config asks for, read once (issue 44: "a config is read once").

A trial's config holds model keys (read by the user's factory) and training
keys (read here): the optimizer family, its hyperparameters with their
defaults, the learning-rate schedule, clipping, label smoothing and the batch
size. ``Bucket`` and ``reference`` both train from a :class:`MemberSpec`,
so a key is read, defaulted and checked in one place, with one error naming
it; the seed rule is ``seeds.chosen_seed`` (torch-free: the Tune layer's
trial actors use it too).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import losses
from .optim import hyperparameters


@dataclass(frozen=True)
class MemberSpec:
    """One member's training settings: its ``config`` (a copy), ``seed``,
    optimizer ``family``, ``hp`` (the family's hyperparameters with their
    defaults, plus ``schedule`` and ``max_grad_norm``), ``label_smoothing``
    and ``batch_size``."""

    config: dict
    seed: int
    family: str
    hp: dict[str, Any]
    label_smoothing: float
    batch_size: int

    @classmethod
    def read(cls, task, config: dict, seed: int) -> "MemberSpec":
        """``config``'s settings for ``task``; a ``ValueError`` naming the bad key."""
        family = task.optimizer_for(config)
        return cls(config=dict(config), seed=seed, family=family, hp=hyperparameters(family, config),
                   label_smoothing=losses.label_smoothing_from_config(task.loss, config),
                   batch_size=task.batch_size_for(config))
