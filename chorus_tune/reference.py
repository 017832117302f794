"""The same training as a bucket's, for one model, with no fusion: the yardstick.

Same initial weights (``torch.manual_seed(seed); task.model(config)``), same
per-seed batch order, same losses and schedules, the same precision (the
forward pass and loss under the task's autocast), and the stock
``torch.optim`` optimizers, ``F.cross_entropy(..., label_smoothing=)`` and
``torch.nn.utils.clip_grad_norm_`` (config keys ``label_smoothing`` and
``max_grad_norm``), and the task's own metrics on the whole validation split.
Every fused path is tested against this, and the plain-Tune baseline trains
with it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import losses
from .data import BatchOrder, SharedBatches, eval_batches
from .member_spec import MemberSpec
from .optim import build_torch_optimizer
from .precision import autocast
from .schedules import scheduled_lr
from .seeds import chosen_seed
from .task import Task, TensorSplit
from .task_metrics import as_metric_outputs, compute_metric


def resolve_seed(config: dict, seed: int | None) -> int:
    return chosen_seed(config, seed, otherwise=_no_seed)


def _no_seed() -> int:
    raise ValueError("reference.train needs a seed: pass seed= or put 'seed' in the config")


def train(task: Task, config: dict, seed: int | None = None, iterations: int = 1,
          device: str | torch.device = "cpu") -> tuple[list[dict[str, Any]], nn.Module]:
    """Train one member of ``task`` unfused; returns (one metrics dict per iteration, model)."""
    run = ReferenceRun(task, config, seed, device)
    history = [run.run_iteration() for _ in range(iterations)]
    return history, run.model


class ReferenceRun:
    """One member trained unfused, an iteration at a time (what a plain Tune
    trial would run, reporting after each iteration)."""

    def __init__(self, task: Task, config: dict, seed: int | None = None, device: str | torch.device = "cpu",
                 splits: tuple | None = None):
        """``splits``: the task's ``(train, val)`` as ``task.load_data()``
        gives them, already on ``device`` (a bucket's copies: a lone member
        trained unfused in a bucket does not copy the data again)."""
        self.task, self.device = task, torch.device(device)
        spec = MemberSpec.read(task, config, resolve_seed(config, seed))
        self.seed, self.hp, self.label_smoothing = spec.seed, spec.hp, spec.label_smoothing
        self.family = spec.family
        self.model = task.build_model(config, self.seed)
        task.check_model(self.model)  # the checks a bucket makes of its first member
        self.model = self.model.to(self.device)
        self.optimizer = build_torch_optimizer(spec.family, self.model.parameters(), self.hp)
        train_split, val_split = task.load_data() if splits is None else splits
        batch = spec.batch_size
        self.steps = task.steps_per_iteration(config)
        if isinstance(train_split, TensorSplit):
            self.x, self.y = train_split.to(self.device).tensors
            self.order, self.shared = BatchOrder(len(train_split), batch, self.seed), None
        else:
            self.order, self.shared = None, SharedBatches(train_split, batch, task.data_seed)
        self.val = val_split.to(self.device) if isinstance(val_split, TensorSplit) else val_split
        self.iteration, self.step = 0, 0

    def run_iteration(self) -> dict[str, Any]:
        model, optimizer, device = self.model, self.optimizer, self.device
        model.train()
        # The iteration's whole index table moves to the device in one copy, as the
        # bucket's does: a copy per step would make plain Tune pay a host-device
        # sync on every step on a GPU that the fused path never pays.
        indices = self.order.take(self.steps).to(device) if self.order is not None else None
        loss_sum = torch.zeros((), device=device)
        for s in range(self.steps):
            if indices is not None:
                idx = indices[s]
                x, y = self.x[idx], self.y[idx]
            else:
                x, y = (t.to(device) for t in self.shared.next())
            for group in optimizer.param_groups:
                group["lr"] = scheduled_lr(self.hp["lr"], self.hp["schedule"], self.step)
            optimizer.zero_grad(set_to_none=True)
            with autocast(self.task.precision, device):
                if self.label_smoothing:
                    loss = F.cross_entropy(model(x), y, reduction="none", label_smoothing=self.label_smoothing).mean()
                else:
                    loss = self.task.loss_fn(model(x), y).mean()
            loss.backward()
            if self.hp["max_grad_norm"] is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.hp["max_grad_norm"])
            optimizer.step()
            loss_sum += loss.detach()
            self.step += 1
        self.iteration += 1
        return {"train_loss": (loss_sum / self.steps).item(), **evaluate(self.task, model, self.val, device),
                "iteration": self.iteration, "route": "reference", "seed": self.seed}


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, val_split, device: torch.device) -> dict[str, float]:
    """``val_loss`` (and ``val_accuracy`` for classification) of one model,
    and each of the task's metrics on its outputs for the whole split (a
    metric that raises raises :class:`chorus_tune.task_metrics.MetricError`)."""
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    count = 0
    metrics = task.metrics or {}
    outputs, targets = [], []
    for x, y in eval_batches(val_split, task.eval_batch_size, device):
        with autocast(task.precision, device):
            output = model(x)
            loss_sum += task.loss_fn(output, y).float().sum()
        if task.is_classification:
            correct += losses.accuracy_count(output, y)
        if metrics:
            outputs.append(as_metric_outputs(output))
            targets.append(y)
        count += int(y.shape[0])
    out = {"val_loss": (loss_sum / count).item()}
    if task.is_classification:
        out["val_accuracy"] = (correct / count).item()
    if metrics:
        all_outputs, all_targets = torch.cat(outputs), torch.cat(targets)
        for name, metric in metrics.items():
            out[name] = compute_metric(name, metric, all_outputs, all_targets)
    return out
