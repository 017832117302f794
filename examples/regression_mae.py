"""Tune a regression model on its own metric, MAE, with ChorusASHA deciding on it.

    python examples/regression_mae.py          # 32 trials, up to 16 epochs
    python examples/regression_mae.py --fast   # 4 trials, 4 epochs (a smoke test)

The model trains on squared error (``loss="mse"``), but what the user cares
about is the mean absolute error on held-out data, so that is what the sweep
optimises: ``Task(metrics={"val_mae": ...})`` computes it for every member on
the fused evaluation's outputs (no second forward pass), results carry it as
``val_mae``, and it is Tune's ``metric=`` and ChorusASHA's: each bucket halves
its cohorts on it. Gradient clipping (``max_grad_norm``) is tuned too, per
member, inside the same bucket. The data is Friedman's #1 regression problem
(Friedman, 1991), generated here: no download.
"""
from __future__ import annotations

import argparse
import math
import time

import ray
import torch
from ray import tune
from torch import nn

from chorus_tune import ChorusASHA, ChorusSearch, ChorusTrainable, Task


def friedman1(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y = 10 sin(pi x1 x2) + 20 (x3 - 0.5)^2 + 10 x4 + 5 x5 + noise; x6..x10 are noise features."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 10, generator=g)
    y = (10 * torch.sin(math.pi * x[:, 0] * x[:, 1]) + 20 * (x[:, 2] - 0.5) ** 2 + 10 * x[:, 3] + 5 * x[:, 4]
         + torch.randn(n, generator=g))
    return x, y.unsqueeze(1)


def data():
    return friedman1(4096, seed=0), friedman1(1024, seed=1)


def mlp(config: dict) -> nn.Module:
    return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def mae(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean absolute error over the whole validation split (one call per member)."""
    return float((outputs - targets).abs().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args()
    trials, epochs, bucket = (4, 4, 4) if args.fast else (32, 16, 16)

    ray.init(configure_logging=False, include_dashboard=False)
    task = Task(mlp, data, loss="mse", optimizer="adam", batch_size=64, metrics={"val_mae": mae})
    trainable = ChorusTrainable.for_task(task, bucket_size=bucket)
    space = {"lr": tune.loguniform(3e-4, 3e-2), "weight_decay": tune.loguniform(1e-6, 1e-2),
             "max_grad_norm": tune.choice([None, 0.5, 2.0])}
    start = time.monotonic()
    results = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(
            metric="val_mae", mode="min", num_samples=trials, reuse_actors=True,
            search_alg=ChorusSearch(task=trainable),
            scheduler=ChorusASHA(max_t=epochs, grace_period=1, reduction_factor=2),
        ),
        run_config=tune.RunConfig(name="chorus_regression_mae", verbose=0),
    ).fit()
    best = results.get_best_result()
    finished = sum(1 for r in results if r.metrics.get("training_iteration") == epochs)
    decided = sum(1 for r in results for d in r.metrics_dataframe.get("chorus/decision", [])
                  if d in ("CONTINUE", "STOP"))
    print(f"\n{len(results)} trials in {time.monotonic() - start:.1f}s, {finished} reached {epochs} epochs, "
          f"{decided} rung decisions made in buckets on val_mae, {len(results.errors)} errors")
    print(f"best config: { {k: (round(v, 5) if isinstance(v, float) else v) for k, v in best.config.items()} }")
    print(f"best val_mae {best.metrics['val_mae']:.4f} (val_loss, the MSE, {best.metrics['val_loss']:.4f})")


if __name__ == "__main__":
    main()
