"""The same training as a bucket's, for one model, with no fusion: the yardstick.

Same initial weights (``torch.manual_seed(seed); task.model(config)``), same
per-seed batch order, same losses and schedules, and the stock
``torch.optim`` optimizers. Every fused path is tested against this, and the
plain-Tune baseline trains with it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import losses
from .data import BatchOrder, SharedBatches, eval_batches
from .optim import build_torch_optimizer, hyperparameters, scheduled_lr
from .task import Task, TensorSplit


def resolve_seed(config: dict, seed: int | None) -> int:
    if seed is not None:
        return int(seed)
    if "seed" in config:
        return int(config["seed"])
    raise ValueError("reference.train needs a seed: pass seed= or put 'seed' in the config")


def train(task: Task, config: dict, seed: int | None = None, iterations: int = 1,
          device: str | torch.device = "cpu") -> tuple[list[dict[str, Any]], nn.Module]:
    """Train one member of ``task`` unfused; returns (one metrics dict per iteration, model)."""
    device = torch.device(device)
    seed = resolve_seed(config, seed)
    family = task.optimizer_for(config)
    hp = hyperparameters(family, config)
    model = task.build_model(config, seed).to(device)
    optimizer = build_torch_optimizer(family, model.parameters(), hp)
    train_split, val_split = task.load_data()
    batch = task.batch_size_for(config)
    steps = task.steps_per_iteration(config)
    if isinstance(train_split, TensorSplit):
        x_all, y_all = train_split.to(device).tensors
        order, shared = BatchOrder(len(train_split), batch, seed), None
    else:
        order, shared = None, SharedBatches(train_split, batch, task.data_seed)
    val_split = val_split.to(device) if isinstance(val_split, TensorSplit) else val_split
    loss_fn = task.loss_fn
    history, step = [], 0
    for iteration in range(1, iterations + 1):
        model.train()
        indices = order.take(steps) if order is not None else None
        loss_sum = torch.zeros((), device=device)
        for s in range(steps):
            if indices is not None:
                idx = indices[s].to(device)
                x, y = x_all[idx], y_all[idx]
            else:
                x, y = (t.to(device) for t in shared.next())
            for group in optimizer.param_groups:
                group["lr"] = scheduled_lr(hp["lr"], hp["schedule"], step)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y).mean()
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
            step += 1
        metrics = {"train_loss": (loss_sum / steps).item(), **evaluate(task, model, val_split, device),
                   "iteration": iteration, "route": "reference", "seed": seed}
        history.append(metrics)
    return history, model


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, val_split, device: torch.device) -> dict[str, float]:
    """``val_loss`` (and ``val_accuracy`` for classification) of one model."""
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    count = 0
    for x, y in eval_batches(val_split, task.eval_batch_size, device):
        output = model(x)
        loss_sum += task.loss_fn(output, y).sum()
        if task.is_classification:
            correct += losses.accuracy_count(output, y)
        count += int(y.shape[0])
    out = {"val_loss": (loss_sum / count).item()}
    if task.is_classification:
        out["val_accuracy"] = (correct / count).item()
    return out
