"""Population Based Training with per-member checkpoints, on scikit-learn's digits.

    python examples/pbt.py          # 8 members, 12 epochs
    python examples/pbt.py --fast   # 4 members, 4 epochs (a smoke test)

Every trial is one member of a fused bucket, with a checkpoint of its own:
when PBT exploits, the losing trial loads the winner's checkpoint (weights,
optimizer state, batch order) into its slot and goes on with a perturbed
config, still fused with the others.
"""
from __future__ import annotations

import argparse
import time

import ray
from ray import tune
from ray.tune.schedulers import PopulationBasedTraining
from torch import nn

import chorus_tune
from chorus_tune import ChorusTrainable, Task
from chorus_tune.examples_data import digits_split


def mlp(config: dict) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args()
    members, epochs = (4, 4) if args.fast else (8, 12)

    ray.init(configure_logging=False, include_dashboard=False)
    trainable = ChorusTrainable.for_task(Task(mlp, digits_split, optimizer="sgd"), bucket_size=members)
    pbt = PopulationBasedTraining(
        time_attr="training_iteration", perturbation_interval=2,
        hyperparam_mutations={"lr": tune.loguniform(1e-3, 0.3), "momentum": [0.0, 0.5, 0.9]},
    )
    start = time.monotonic()
    results = tune.Tuner(
        trainable, param_space={"lr": tune.loguniform(1e-3, 0.3), "momentum": tune.choice([0.0, 0.5, 0.9])},
        # reuse_actors, as Tune advises for PBT: an exploited trial restarts on
        # a cached actor (ChorusTrainable.reset_config) instead of a new process.
        tune_config=tune.TuneConfig(metric="val_accuracy", mode="max", num_samples=members, scheduler=pbt,
                                    reuse_actors=True),
        run_config=tune.RunConfig(name="chorus_pbt", verbose=0, stop={"training_iteration": epochs},
                                  checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=2)),
    ).fit()
    best = results.get_best_result()
    print(f"\n{len(results)} members in {time.monotonic() - start:.1f}s, {len(results.errors)} errors")
    print(f"best config: lr={best.config['lr']:.4g} momentum={best.config['momentum']}")
    print(f"best val_accuracy {best.metrics['val_accuracy']:.4f}")
    model = chorus_tune.load_model(best.checkpoint)
    print(f"load_model -> {type(model).__name__}")


if __name__ == "__main__":
    main()
