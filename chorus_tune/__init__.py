"""chorus_tune: many Ray Tune trials trained as one vmap'd bucket on one device.

The core (``Task``, ``Bucket``, ``reference``) needs torch only; the Ray layer
(``ChorusTrainable``, ``ChorusSearch``, ``ChorusASHA``, ``load_model``) is
imported lazily, so ``import chorus_tune`` does not import ray.
"""
from __future__ import annotations

from . import reference
from .bucket import Bucket
from .export import model_from_state
from .stack import structural_key
from .task import Task

__all__ = [
    "Task", "Bucket", "reference", "structural_key", "model_from_state",
    "ChorusTrainable", "ChorusSearch", "ChorusASHA", "load_model",
]
__version__ = "0.1.0"

_RAY_LAYER = {
    "ChorusTrainable": "chorus_tune.tune.trainable",
    "load_model": "chorus_tune.tune.checkpoint",
    "ChorusSearch": "chorus_tune.tune.search",
    "ChorusASHA": "chorus_tune.tune.schedulers",
}


def __getattr__(name: str):
    if name in _RAY_LAYER:
        import importlib

        return getattr(importlib.import_module(_RAY_LAYER[name]), name)
    raise AttributeError(f"module 'chorus_tune' has no attribute {name!r}")
