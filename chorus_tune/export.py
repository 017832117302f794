"""Turning a saved member back into the user's own module."""
from __future__ import annotations

from typing import Callable, Union

import torch
from torch import nn

from .task import Task


def model_from_state(model: Union[Task, Callable[[dict], nn.Module]], state: dict) -> nn.Module:
    """An instance of the user's class holding the weights of a ``Bucket.member_state``, in eval mode."""
    factory = model.model if isinstance(model, Task) else model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(state["seed"]))
        module = factory(state["config"])
    module.load_state_dict(state["model"])
    return module.eval()
