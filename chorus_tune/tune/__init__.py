"""The Ray Tune layer of chorus_tune (the only package that imports ray).

``ChorusTrainable`` (trials as members of fused buckets), ``load_model`` (a
checkpoint back to the user's module) and ``load_weights`` (its weights,
loaded without running code), ``retire_trial`` (free a trial's slot
now, for schedulers), ``close_idle_buckets`` (free the devices idle buckets
hold now), and, from their own modules, ``ChorusSearch`` and ``ChorusASHA``.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ChorusTrainable": ".trial.trainable",
    "BucketLost": ".trial.trainable",
    "load_model": ".trial.checkpoint",
    "load_weights": ".trial.checkpoint",
    "retire_trial": ".client",
    "bucket_stats": ".client",
    "free_slots": ".client",
    "close_idle_buckets": ".client",
    "ChorusSearch": ".search.search",
    "ChorusASHA": ".schedulers.asha",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy, so that importing one submodule does not import every other one.
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name], __name__), name)
