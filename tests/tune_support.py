"""Shared pieces of the Ray Tune layer's tests: small digits tasks, run configs, result readers.

The model factories and data loaders here travel to bucket actors inside the
pickled task. Workers cannot import this test module, so it is pickled by value.
"""
from __future__ import annotations

import sys

import ray
import ray.cloudpickle
from ray import tune
from torch import nn

from chorus_tune import Task

import models
from models import mlp  # noqa: F401  (re-exported: the Tune tests' model)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(models)


def digits(n_train: int = 512, n_val: int = 256):
    """The digits split the Tune tests use (fewer samples than the core tests': faster epochs)."""
    return models.digits(n_train, n_val)


def picky_mlp(config: dict) -> nn.Module:
    if config.get("lr", 0) > 1.0:
        raise ValueError(f"picky_mlp refuses lr={config['lr']}: too large")
    return mlp(config)


def imported(actor, modules) -> dict[str, bool]:
    """For ``__ray_call__`` on an actor: which of ``modules`` its process has imported."""
    return {name: name in sys.modules for name in modules}


def digits_task(model=mlp, **kwargs) -> Task:
    return Task(model=model, data=digits, optimizer=kwargs.pop("optimizer", "sgd"),
                batch_size=kwargs.pop("batch_size", 64), **kwargs)


def run_config(tmp_path, iterations: int, **kwargs) -> tune.RunConfig:
    return tune.RunConfig(storage_path=str(tmp_path), stop={"training_iteration": iterations}, verbose=0,
                          **kwargs)


def start_ray(**kwargs):
    """A fresh local Ray instance of our own (other Ray instances may run on the machine)."""
    if ray.is_initialized():
        ray.shutdown()
    return ray.init(address="local", num_cpus=kwargs.pop("num_cpus", 2),
                    include_dashboard=kwargs.pop("include_dashboard", False), configure_logging=False, **kwargs)


def history(result, metric: str = "val_loss") -> list[float]:
    """One value per reported iteration, in order."""
    frame = result.metrics_dataframe.sort_values("training_iteration")
    return frame[metric].tolist()


def by_iteration(result, metric: str = "val_loss") -> dict[int, float]:
    """``{training_iteration: value}`` of the reported results (the last report wins)."""
    frame = result.metrics_dataframe.sort_values("training_iteration")
    return dict(zip(frame["training_iteration"].astype(int), frame[metric]))
