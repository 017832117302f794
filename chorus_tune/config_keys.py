"""Which keys of a trial's config are the user's: Tune adds its own, named
``__...`` (``__trial_index__``), which no model or training setting reads.

Torch-free: Tune's trial actors read configs too. The one place that says
so; the searcher, the trainable, the sizing and the core's unread-key
warning all ask here.
"""
from __future__ import annotations

from typing import Any, Mapping

TUNE_PREFIX = "__"


def is_tune_key(key: Any) -> bool:
    """Whether ``key`` is one Tune adds to a config (``__trial_index__``)."""
    return isinstance(key, str) and key.startswith(TUNE_PREFIX)


def users_config(config: Mapping[Any, Any]) -> dict:
    """``config`` without the keys Tune adds: what a member is built and trained from."""
    return {k: v for k, v in config.items() if not is_tune_key(k)}
