"""From a ChorusTrainable checkpoint back to the user's own ``nn.Module`` (docs/design.md D7).

A checkpoint directory holds two things:

- ``weights.pt`` (:data:`WEIGHTS_FILE`): the member's model ``state_dict``,
  for ``torch.load(weights_only=True)``: loading it runs no code.
  :func:`load_weights` reads it, and :func:`load_model` with ``model=`` fills a
  module you built with it.
- Tune's ``_dict_checkpoint.pkl``: everything a trial resumes from (the full
  member state, the model factory), pickled. Reading it unpickles, which can
  run code: plain :func:`load_model` reads it, for checkpoints you trust.

This module is imported by trial actors: torch is imported only inside the
functions that load tensors (docs/design.md D3).
"""
from __future__ import annotations

import os
from typing import Any, Union

import ray.cloudpickle as cloudpickle

from chorus_tune.tune.values import state_io

# Where Tune writes the dict a class trainable's save_checkpoint returns.
_DICT_FILE = "_dict_checkpoint.pkl"
WEIGHTS_FILE = "weights.pt"

CheckpointLike = Union["ray.tune.Checkpoint", str, os.PathLike, dict]  # noqa: F821


def read_checkpoint(checkpoint: CheckpointLike) -> dict[str, Any]:
    """The dict a :class:`ChorusTrainable` saved: from a Tune ``Checkpoint``, its
    directory, or the dict itself. Unpickles: for checkpoints you trust."""
    if isinstance(checkpoint, dict):
        return checkpoint
    if hasattr(checkpoint, "as_directory"):  # a Tune Checkpoint (checked first: it is PathLike but refuses)
        with checkpoint.as_directory() as directory:
            return read_checkpoint(directory)
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.path.join(os.fspath(checkpoint), _DICT_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{os.fspath(checkpoint)} is not a ChorusTrainable checkpoint directory: it has "
                                    f"no {_DICT_FILE} (pass the directory Tune's Checkpoint points at, e.g. "
                                    "result.checkpoint)")
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    raise TypeError(f"expected a Tune Checkpoint, a checkpoint directory or a dict; got {type(checkpoint).__name__}")


def write_weights(checkpoint_dir: str, member: bytes | None) -> None:
    """Write the weights of ``member`` (a member state's bytes) into
    ``checkpoint_dir`` as :data:`WEIGHTS_FILE`. Torch-free (a trial actor
    calls it); nothing is written before the first result or for bytes saved
    before the weights had a file of their own."""
    weights = state_io.weights_bytes(member) if member is not None else None
    if weights is not None:
        with open(os.path.join(checkpoint_dir, WEIGHTS_FILE), "wb") as f:
            f.write(weights)


def member_state(checkpoint: CheckpointLike) -> dict[str, Any]:
    """The member state (a core ``Bucket.member_state``) held by a checkpoint."""
    data = _chorus_dict(read_checkpoint(checkpoint))
    if data["member"] is None:
        raise ValueError("this checkpoint was taken before the trial's first iteration: it holds no weights")
    return state_io.loads(data["member"])


def load_weights(checkpoint: CheckpointLike) -> dict[str, Any]:
    """The member's model ``state_dict`` (CPU tensors, the user's key names),
    read with ``torch.load(weights_only=True)``: no code in the checkpoint runs.

    ``checkpoint``: a Tune ``Checkpoint``, its directory, or the dict a
    ChorusTrainable saved (whose bytes are then in memory already).

    >>> model = mlp(best.config)                                  # doctest: +SKIP
    >>> model.load_state_dict(load_weights(best.checkpoint))      # doctest: +SKIP
    """
    import io

    import torch

    if isinstance(checkpoint, dict):
        weights = state_io.weights_bytes(checkpoint["member"]) if checkpoint.get("member") else None
        if weights is None:
            raise ValueError(_no_weights("this checkpoint dict"))
        return torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
    if hasattr(checkpoint, "as_directory"):
        with checkpoint.as_directory() as directory:
            return load_weights(directory)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError("expected a Tune Checkpoint, a checkpoint directory or a dict; "
                        f"got {type(checkpoint).__name__}")
    path = os.path.join(os.fspath(checkpoint), WEIGHTS_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(_no_weights(os.fspath(checkpoint)))
    return torch.load(path, map_location="cpu", weights_only=True)


def _no_weights(where: str) -> str:
    return (f"{where} has no {WEIGHTS_FILE}: it is not a ChorusTrainable checkpoint, or one taken before the "
            "trial's first result (it holds no weights), or one saved by an older chorus_tune. "
            "load_model(checkpoint) reads an older one, by unpickling it: only if you trust it.")


def load_model(checkpoint: CheckpointLike, model: Any = None):
    """The trained member of a ChorusTrainable checkpoint as an instance of the
    user's own ``nn.Module`` class, on the CPU, in eval mode.

    With ``model=`` (a module you built, e.g. ``mlp(result.config)``), its
    weights are filled from the checkpoint's weights file (:func:`load_weights`:
    no code runs), strictly: a module of another shape is refused, naming what
    differs. It is returned in eval mode, on its own device.

    Without it, the model factory and member state are unpickled (cloudpickle
    and ``torch.load(weights_only=False)``), which can run code: only for
    checkpoints you trust, e.g. your own runs.

    >>> model = load_model(results.get_best_result().checkpoint)  # doctest: +SKIP
    """
    if model is not None:
        _check_module(model)
        return _fill(model, load_weights(checkpoint))
    from chorus_tune.export import model_from_state

    data = _chorus_dict(read_checkpoint(checkpoint))
    if data.get("factory") is None:
        raise ValueError("this checkpoint holds no model factory to rebuild the module: pass model= (a module "
                         "you built for the trial's config) to fill it from the checkpoint's weights")
    return model_from_state(cloudpickle.loads(data["factory"]), member_state(data))


def _chorus_dict(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict) or "chorus_format" not in data or "member" not in data:
        raise ValueError("not a ChorusTrainable checkpoint (no 'chorus_format' and 'member' entries): pass the "
                         "checkpoint of a trial that ran a ChorusTrainable")
    return data


def _check_module(model: Any) -> None:
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"model= must be the nn.Module to fill (e.g. your factory's module for the trial's "
                        f"config); got {model!r}")


def _fill(model: Any, weights: dict[str, Any]):
    own = model.state_dict()
    problems = []
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    if missing:
        problems.append("missing from the checkpoint: " + ", ".join(missing))
    if unexpected:
        problems.append("in the checkpoint but not the model: " + ", ".join(unexpected))
    problems += [f"{name}: checkpoint {tuple(weights[name].shape)} vs model {tuple(own[name].shape)}"
                 for name in sorted(set(own) & set(weights)) if weights[name].shape != own[name].shape]
    if problems:
        raise ValueError(f"the checkpoint's weights do not fit the {type(model).__name__} passed as model= ("
                         + "; ".join(problems) + "): build it with the trial's config (result.config)")
    model.load_state_dict(weights, strict=True)
    return model.eval()
