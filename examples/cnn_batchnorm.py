"""A small CNN with BatchNorm, trials fused, on scikit-learn's 8x8 digits images.

    python examples/cnn_batchnorm.py          # 16 trials, 6 epochs
    python examples/cnn_batchnorm.py --fast   # 4 trials, 2 epochs (a smoke test)

Each member keeps its own BatchNorm running statistics (stacked buffers under
vmap); ``load_model`` gives back a plain ``DigitsCNN`` with them, ready for eval.
"""
from __future__ import annotations

import argparse
import time

import ray
import torch
from ray import tune
from torch import nn

import chorus_tune
from chorus_tune import ChorusASHA, ChorusSearch, ChorusTrainable, Task
from chorus_tune.examples_data import digits_split


class DigitsCNN(nn.Module):
    def __init__(self, channels: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(channels * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def images():
    (x, y), (xv, yv) = digits_split()
    return (x.reshape(-1, 1, 8, 8), y), (xv.reshape(-1, 1, 8, 8), yv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args()
    trials, epochs = (4, 2) if args.fast else (16, 6)

    ray.init(configure_logging=False, include_dashboard=False)
    task = Task(lambda config: DigitsCNN(config.get("channels", 16)), images, optimizer="sgd", batch_size=64)
    trainable = ChorusTrainable.for_task(task, bucket_size=trials)
    start = time.monotonic()
    results = tune.Tuner(
        trainable,
        param_space={"lr": tune.loguniform(1e-2, 0.3), "momentum": 0.9, "weight_decay": tune.loguniform(1e-5, 1e-3)},
        tune_config=tune.TuneConfig(metric="val_accuracy", mode="max", num_samples=trials, reuse_actors=True,
                                    search_alg=ChorusSearch(task=trainable),
                                    scheduler=ChorusASHA(max_t=epochs, grace_period=1, reduction_factor=2)),
        run_config=tune.RunConfig(name="chorus_cnn", verbose=0, stop={"training_iteration": epochs}),
    ).fit()
    best = results.get_best_result()
    print(f"\n{len(results)} trials in {time.monotonic() - start:.1f}s, {len(results.errors)} errors, "
          f"route {best.metrics['chorus/route']}")
    print(f"best val_accuracy {best.metrics['val_accuracy']:.4f} (lr={best.config['lr']:.4g})")
    model = chorus_tune.load_model(best.checkpoint)
    bn = model.features[1]
    print(f"load_model -> {type(model).__name__}, eval mode: {not model.training}, "
          f"BatchNorm batches tracked: {int(bn.num_batches_tracked)}")


if __name__ == "__main__":
    main()
