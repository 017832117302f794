"""OptunaSearch inside ChorusSearch, pruned by ChorusASHA, on scikit-learn's digits.

    python examples/optuna_search.py          # 32 trials, up to 8 epochs
    python examples/optuna_search.py --fast   # 8 trials, 2 epochs (a smoke test)

Optuna proposes configs one at a time, as usual; ChorusSearch draws a bucket's
worth ahead of Tune and seats them at once, so compatible ones train together
in a bucket, and seats the next ones in the slots pruning frees. Optuna is told
every result under its own trial ids.
"""
from __future__ import annotations

import argparse
import time

import ray
from ray import tune
from ray.tune.search.optuna import OptunaSearch
from torch import nn

from chorus_tune import ChorusASHA, ChorusSearch, ChorusTrainable, Task
from chorus_tune.examples_data import digits_split


def mlp(config: dict) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args()
    trials, epochs, bucket = (8, 2, 4) if args.fast else (32, 8, 8)

    ray.init(configure_logging=False, include_dashboard=False)
    trainable = ChorusTrainable.for_task(Task(mlp, digits_split, optimizer="adam"), bucket_size=bucket)
    space = {"lr": tune.loguniform(1e-4, 3e-2), "beta1": tune.uniform(0.8, 0.95),
             "weight_decay": tune.loguniform(1e-6, 1e-2)}
    start = time.monotonic()
    results = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(
            metric="val_loss", mode="min", num_samples=trials, reuse_actors=True,
            search_alg=ChorusSearch(OptunaSearch(seed=0), task=trainable),
            scheduler=ChorusASHA(max_t=epochs, grace_period=1, reduction_factor=2),
        ),
        run_config=tune.RunConfig(name="chorus_optuna", verbose=0, stop={"training_iteration": epochs}),
    ).fit()
    best = results.get_best_result()
    finished = sum(1 for r in results if r.metrics.get("training_iteration") == epochs)
    print(f"\n{len(results)} trials in {time.monotonic() - start:.1f}s, {finished} reached {epochs} epochs, "
          f"{len(results.errors)} errors")
    print(f"best config: { {k: round(v, 5) for k, v in best.config.items()} }")
    print(f"best val_loss {best.metrics['val_loss']:.4f}, val_accuracy {best.metrics['val_accuracy']:.4f}")


if __name__ == "__main__":
    main()
