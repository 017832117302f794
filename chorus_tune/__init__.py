"""chorus_tune: many Ray Tune trials trained as one vmap'd bucket on one device.

The core (``Task``, ``Bucket``, ``reference``) needs torch only; the Ray layer
(``ChorusTrainable``, ``ChorusSearch``, ``ChorusASHA``, ``load_model``, ``load_weights``) needs
ray. Every name is imported on first use: ``import chorus_tune`` imports
neither, and a Tune trial actor (which imports ``chorus_tune.tune``) never
loads torch -- measured, that saves each trial process ~2 s of start-up and
~150 MB.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Task": "chorus_tune.task",
    "Bucket": "chorus_tune.bucket",
    "structural_key": "chorus_tune.stack",
    "sharing_key": "chorus_tune.stack",
    "WidthRule": "chorus_tune.width_rule",
    "model_from_state": "chorus_tune.export",
    "ChorusTrainable": "chorus_tune.tune.trial.trainable",
    "load_model": "chorus_tune.tune.trial.checkpoint",
    "load_weights": "chorus_tune.tune.trial.checkpoint",
    "ChorusSearch": "chorus_tune.tune.search.search",
    "ChorusASHA": "chorus_tune.tune.schedulers.asha",
}
_SUBMODULES = ("reference",)

__all__ = [*_EXPORTS, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'chorus_tune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
