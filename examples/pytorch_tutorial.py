"""The sweep of PyTorch's tutorial "Hyperparameter tuning with Ray Tune", run through chorus_tune.

    python examples/pytorch_tutorial.py          # the tutorial's 10 trials, up to 10 epochs
    python examples/pytorch_tutorial.py --fast   # 4 trials, 2 epochs, a smaller set (a smoke test)

The tutorial tunes a small CNN on CIFAR-10: the widths of its two hidden
layers (``l1``, ``l2``: powers of two from 4 to 256), ``lr`` and
``batch_size`` (2, 4, 8 or 16), under Tune's stock ``ASHAScheduler``, then
loads the best trial's checkpoint and measures it on the test split. This is
the same sweep written for chorus_tune, with the tutorial's model and search
space unchanged. The data is CIFAR-shaped (3x32x32, 10 classes) and made here,
seeded, so nothing is downloaded: each class is a colour grating of its own
orientation and frequency, under noise.

What fuses: trials whose models differ only in ``l1``/``l2`` still differ in
shape, and members with different batch sizes take different numbers of steps
per epoch, so with ``batch_size`` and both widths swept most trials get a
bucket of their own. ``ChorusSearch`` says how the space splits, as a WARNING,
when the run starts.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import ray
import torch
import torch.nn.functional as F
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from torch import nn

import chorus_tune
from chorus_tune import ChorusSearch, ChorusTrainable, Task


class Net(nn.Module):
    """The tutorial's model, as it writes it."""

    def __init__(self, l1: int = 120, l2: int = 84):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, l1)
        self.fc2 = nn.Linear(l1, l2)
        self.fc3 = nn.Linear(l2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def gratings(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` CIFAR-shaped images: class c is a grating at angle c*pi/10, with a
    frequency and a colour of its own, plus noise (learnable, not trivially)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    yy, xx = np.mgrid[0:32, 0:32].astype(np.float32) / 32.0
    angle = labels * math.pi / 10
    freq = 2.0 + (labels % 3)
    phase = rng.uniform(0, 2 * math.pi, n)
    wave = np.sin(2 * math.pi * freq[:, None, None] * (np.cos(angle)[:, None, None] * xx
                                                        + np.sin(angle)[:, None, None] * yy) + phase[:, None, None])
    colour = np.stack([np.cos(labels), np.sin(labels), np.cos(2 * labels)], axis=1).astype(np.float32)
    images = colour[:, :, None, None] * wave[:, None] + rng.normal(0, 3.0, (n, 3, 32, 32))
    return torch.tensor(images, dtype=torch.float32), torch.tensor(labels, dtype=torch.long)


def data_for(n_train: int, n_val: int):
    """The train and validation splits the trials see (made in each bucket: no transfer)."""
    def load():
        return gratings(n_train, seed=1), gratings(n_val, seed=2)
    load.__qualname__ = f"gratings_{n_train}_{n_val}"
    return load


def test_accuracy(model: nn.Module, n_test: int) -> float:
    """The tutorial's last step: the best trial's model on a test split no trial saw."""
    x, y = gratings(n_test, seed=3)
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true")
    parser.add_argument("--num-samples", type=int, default=None, help="trials (default: the tutorial's 10)")
    args = parser.parse_args()
    trials, epochs, n_train, n_eval = (4, 2, 256, 128) if args.fast else (10, 10, 2048, 512)
    trials = args.num_samples or trials

    ray.init(configure_logging=False, include_dashboard=False)
    task = Task(lambda config: Net(config["l1"], config["l2"]), data_for(n_train, n_eval), optimizer="sgd")
    trainable = ChorusTrainable.for_task(task, bucket_size=16)
    start = time.monotonic()
    results = tune.Tuner(
        trainable,
        param_space={  # the tutorial's search space
            "l1": tune.choice([2 ** i for i in range(2, 9)]),
            "l2": tune.choice([2 ** i for i in range(2, 9)]),
            "lr": tune.loguniform(1e-4, 1e-1),
            "batch_size": tune.choice([2, 4, 8, 16]),
            "momentum": 0.9,
        },
        tune_config=tune.TuneConfig(
            metric="val_loss", mode="min", num_samples=trials, reuse_actors=True,
            search_alg=ChorusSearch(task=trainable),
            scheduler=ASHAScheduler(max_t=epochs, grace_period=1, reduction_factor=2),  # the tutorial's
        ),
        run_config=tune.RunConfig(name="chorus_pytorch_tutorial", verbose=0, stop={"training_iteration": epochs}),
    ).fit()
    best = results.get_best_result()
    live = [r.metrics.get("chorus/live", 1) for r in results]
    print(f"\n{len(results)} trials in {time.monotonic() - start:.1f}s, {len(results.errors)} errors, "
          f"buckets: {len({r.metrics['chorus/bucket'] for r in results})}, "
          f"mean chorus/live at the last result: {sum(live) / len(live):.1f}")
    print(f"best trial config: {best.config}")
    print(f"best trial final val_loss {best.metrics['val_loss']:.4f}, val_accuracy {best.metrics['val_accuracy']:.4f}")
    model = chorus_tune.load_model(best.checkpoint)
    print(f"load_model -> {type(model).__name__}; best trial test set accuracy: {test_accuracy(model, n_eval):.4f}")


if __name__ == "__main__":
    main()
