"""ChorusSearch's state in one file for ``Tuner.restore``: its own (buffer, id maps)
and its inner searcher's, which saves itself (or cannot: then it is said)."""
from __future__ import annotations

import logging
import os
import pickle
import tempfile
from typing import Any, Dict

import ray.cloudpickle as cloudpickle

logger = logging.getLogger(__name__)


def write_state(checkpoint_path: str, state: Dict, inner: Any) -> None:
    """``state`` and what ``inner`` (a Tune ``Searcher``) saves of itself, in ``checkpoint_path``."""
    with tempfile.TemporaryDirectory() as tmp:
        inner_path = os.path.join(tmp, "inner")
        inner_bytes = None
        try:
            inner.save(inner_path)
            with open(inner_path, "rb") as f:
                inner_bytes = f.read()
        except NotImplementedError:
            logger.warning("%s cannot save its state", type(inner).__name__)
    with open(checkpoint_path, "wb") as f:
        cloudpickle.dump({"chorus": state, "inner": inner_bytes}, f)


def read_state(checkpoint_path: str, inner: Any) -> Dict:
    """The state :func:`write_state` saved; ``inner`` restores its own from it, where it saved one."""
    with open(checkpoint_path, "rb") as f:
        saved = pickle.load(f)
    if saved["inner"] is not None:
        with tempfile.TemporaryDirectory() as tmp:
            inner_path = os.path.join(tmp, "inner")
            with open(inner_path, "wb") as f:
                f.write(saved["inner"])
            inner.restore(inner_path)
    return saved["chorus"]
