"""A task's own evaluation metrics: ``Task(metrics={"name": fn})``.

Each metric is computed once per member per evaluation, on the member's
outputs for the **whole** validation split and the split's targets, both
already there from the evaluation pass (no extra forward pass). Computing it
once on the whole split, not averaging it over evaluation batches, is what
makes F1, AUC or a median come out as they would on the split: a mean of
per-batch F1 scores is not the F1 score. The fused bucket and
``reference.evaluate`` compute them by the same function here.

A metric is either

* a callable ``fn(outputs, targets) -> float`` (a number, or a tensor holding
  one; a ``torchmetrics.functional`` function with its arguments bound by
  ``functools.partial`` is one), or
* a torchmetrics-style stateful metric: an object with ``reset()``,
  ``update(outputs, targets)`` and ``compute()`` (a ``torchmetrics.Metric``
  is one). It is reset, updated once with the whole split, computed and reset
  again, so no state carries over from member to member or from evaluation to
  evaluation; an ``nn.Module`` metric is moved to the outputs' device first.

``outputs`` is the member's model output for the validation split in order,
``(N, ...)``, in float32 (a bf16 evaluation's outputs are converted), on the
device the evaluation ran on; ``targets`` is the split's targets ``(N, ...)``
on the same device. Neither carries gradients.

This module imports torch only.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Union

import torch

MetricFn = Callable[[torch.Tensor, torch.Tensor], Any]
Metric = Union[MetricFn, Any]  # a callable, or an object with reset/update/compute

# Names a metric may not take: the bucket's own metrics, and the keys Ray Tune
# puts in every result (a metric under one of them would be overwritten, or
# would overwrite, silently).
BUILT_IN = ("train_loss", "val_loss", "val_accuracy", "iteration", "route", "seed")
TUNE_RESERVED = (
    "done", "training_iteration", "trial_id", "experiment_id", "experiment_tag", "date", "timestamp",
    "time_this_iter_s", "time_total_s", "time_since_restore", "iterations_since_restore",
    "timesteps_total", "timesteps_this_iter", "timesteps_since_restore", "episodes_total",
    "episodes_this_iter", "pid", "hostname", "node_ip", "config", "should_checkpoint", "checkpoint_dir_name",
)
RESERVED_PREFIXES = ("chorus/", "__", "config/")


class MetricError(RuntimeError):
    """A task metric raised, or returned something that is not a number.

    ``metric`` is the metric's name. The message says which metric, what it
    raised, and (from the bucket) which member's evaluation it broke.
    """

    def __init__(self, message: str, metric: str):
        super().__init__(message)
        self.metric = metric

    def __reduce__(self):  # crosses processes pickled (a bucket actor's error)
        return type(self), (str(self), self.metric)


def is_stateful(metric: Any) -> bool:
    """A torchmetrics-style metric: ``reset``, ``update`` and ``compute`` methods."""
    return all(callable(getattr(metric, name, None)) for name in ("reset", "update", "compute"))


def check_metrics(metrics: Mapping[str, Metric] | None) -> dict[str, Metric]:
    """``Task.metrics`` checked: a dict of names to metrics (empty for ``None``).

    Raises ``TypeError`` for a mapping that is not one, a name that is not a
    string or a metric that is neither callable nor torchmetrics-style, and
    ``ValueError`` for an empty name or one that clashes with a built-in
    result key (``val_loss``, ``training_iteration``, ``chorus/...``).
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"Task.metrics must be a dict {{name: fn(outputs, targets) -> float}}; "
                        f"got {type(metrics).__name__}")
    for name, metric in metrics.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"Task.metrics names must be non-empty strings; got {name!r}")
        if name in BUILT_IN or name in TUNE_RESERVED or name.startswith(RESERVED_PREFIXES):
            raise ValueError(f"Task.metrics name {name!r} clashes with a key every result already has "
                             f"(built in: {', '.join(BUILT_IN)}; Ray Tune's own keys; 'chorus/...'): "
                             "choose another name")
        if not (callable(metric) or is_stateful(metric)):
            raise TypeError(f"Task.metrics[{name!r}] must be callable as fn(outputs, targets) -> float, "
                            f"or have reset/update/compute (torchmetrics); got {type(metric).__name__}")
    return dict(metrics)


def as_number(value: Any, name: str) -> float:
    """A metric's return value as a float, or a :class:`MetricError` saying what it was."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise MetricError(f"metric {name!r} must return one number; got a tensor of shape "
                              f"{tuple(value.shape)}", name)
        return float(value.detach().float().item())
    if isinstance(value, (bool, str, bytes)):
        raise MetricError(f"metric {name!r} must return one number; got {type(value).__name__} {value!r:.80}", name)
    try:
        return float(value)  # a Python or numpy number, a one-element array
    except (TypeError, ValueError) as exc:
        raise MetricError(f"metric {name!r} must return one number; got {type(value).__name__} {value!r:.80}",
                          name) from exc


def _call(metric: Metric, outputs: torch.Tensor, targets: torch.Tensor) -> Any:
    if not is_stateful(metric):
        return metric(outputs, targets)
    if isinstance(metric, torch.nn.Module):
        metric.to(outputs.device)
    metric.reset()
    try:
        metric.update(outputs, targets)
        return metric.compute()
    finally:
        metric.reset()  # nothing of this member stays in the metric's state


def compute_metric(name: str, metric: Metric, outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """One metric of one member: a float, or a :class:`MetricError` naming the
    metric and what it raised (its cause chained)."""
    try:
        value = _call(metric, outputs, targets)
    except MetricError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the user's metric raises is reported as its own
        raise MetricError(f"metric {name!r} raised {type(exc).__name__}: {exc}", name) from exc
    return as_number(value, name)


def as_metric_outputs(outputs: torch.Tensor) -> torch.Tensor:
    """What a metric is handed as ``outputs``: detached, in float32."""
    return outputs.detach().float()
