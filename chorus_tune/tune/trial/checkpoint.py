"""From a ChorusTrainable checkpoint back to the user's own ``nn.Module`` (docs/design.md D7)."""
from __future__ import annotations

import os
from typing import Any, Union

import ray.cloudpickle as cloudpickle

from . import state_io

# Where Tune writes the dict a class trainable's save_checkpoint returns.
_DICT_FILE = "_dict_checkpoint.pkl"

CheckpointLike = Union["ray.tune.Checkpoint", str, os.PathLike, dict]  # noqa: F821


def read_checkpoint(checkpoint: CheckpointLike) -> dict[str, Any]:
    """The dict a :class:`ChorusTrainable` saved: from a Tune ``Checkpoint``, its
    directory, or the dict itself."""
    if isinstance(checkpoint, dict):
        return checkpoint
    if hasattr(checkpoint, "as_directory"):  # a Tune Checkpoint (checked first: it is PathLike but refuses)
        with checkpoint.as_directory() as directory:
            return read_checkpoint(directory)
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.path.join(os.fspath(checkpoint), _DICT_FILE)
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    raise TypeError(f"expected a Tune Checkpoint, a checkpoint directory or a dict; got {type(checkpoint).__name__}")


def member_state(checkpoint: CheckpointLike) -> dict[str, Any]:
    """The member state (a core ``Bucket.member_state``) held by a checkpoint."""
    data = read_checkpoint(checkpoint)
    if "chorus_format" not in data:
        raise ValueError("not a ChorusTrainable checkpoint (no 'chorus_format' entry)")
    if data["member"] is None:
        raise ValueError("this checkpoint was taken before the trial's first iteration: it holds no weights")
    return state_io.loads(data["member"])


def load_model(checkpoint: CheckpointLike):
    """The trained member of a ChorusTrainable checkpoint as an instance of the
    user's own ``nn.Module`` class, on the CPU, in eval mode.

    >>> model = load_model(results.get_best_result().checkpoint)  # doctest: +SKIP
    """
    from chorus_tune.export import model_from_state

    data = read_checkpoint(checkpoint)
    return model_from_state(cloudpickle.loads(data["factory"]), member_state(data))
