"""Quickstart: an ASHA sweep on scikit-learn's digits, trials trained fused in buckets.

    python examples/quickstart.py          # 24 trials, up to 12 epochs (under 2 minutes on 2 cores)
    python examples/quickstart.py --fast   # 6 trials, 3 epochs (a smoke test)

Ray Tune sees, schedules and prunes every trial on its own; chorus_tune trains
the trials of one structure together, K to a bucket, as one vmap'd step.
"""
from __future__ import annotations

import argparse
import os
import time

import ray
from ray import tune
from torch import nn

import chorus_tune
from chorus_tune import Task
from chorus_tune.examples_data import digits_split
from chorus_tune.tune import ChorusASHA, ChorusSearch, ChorusTrainable, bucket_stats


def mlp(config: dict) -> nn.Module:
    width = config["width"]
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="a few trials and epochs (for tests)")
    args = parser.parse_args()
    trials, epochs = (6, 3) if args.fast else (24, 12)

    # A Ray of its own unless RAY_ADDRESS names a cluster: plain ray.init()
    # joins the last cluster `ray start` recorded on this machine, even a dead one.
    ray.init(address=os.environ.get("RAY_ADDRESS", "local"), configure_logging=False, include_dashboard=False)
    task = Task(model=mlp, data=digits_split, optimizer="sgd", batch_size=64)
    # Width changes the structure: each width gets buckets of its own; lr,
    # momentum and weight decay keep it, so those trials share a bucket.
    trainable = ChorusTrainable.for_task(task, bucket_size=8 if not args.fast else 4)
    space = {
        "width": tune.choice([32, 64]),
        "lr": tune.loguniform(1e-2, 0.5),
        "momentum": tune.uniform(0.0, 0.9),
        "weight_decay": tune.loguniform(1e-6, 1e-3),
    }
    # ChorusSearch draws the trials ahead of Tune and seats them in buckets at
    # once; ChorusASHA's rungs are halved inside each bucket, cohort by cohort.
    # Trial actors only read results: Tune runs about one per CPU, reused.
    search = ChorusSearch(task=trainable, random_state=0)
    scheduler = ChorusASHA(max_t=epochs, grace_period=1, reduction_factor=2)
    start = time.monotonic()
    results = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(metric="val_accuracy", mode="max", num_samples=trials, search_alg=search,
                                    scheduler=scheduler, reuse_actors=True),
        run_config=tune.RunConfig(name="chorus_quickstart", verbose=0, stop={"training_iteration": epochs}),
    ).fit()
    elapsed = time.monotonic() - start

    best = results.get_best_result()
    config = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in best.config.items()}
    print(f"\n{len(results)} trials in {elapsed:.1f}s ({len(results.errors)} errors)")
    print(f"best config: {config}")
    print(f"best val_accuracy: {best.metrics['val_accuracy']:.4f} after {best.metrics['training_iteration']} epochs"
          f" (route {best.metrics['chorus/route']}, seed {best.metrics['chorus/seed']})")
    members = {r.metrics.get("chorus/member") for r in results}
    wasted_by_bucket = {}  # chorus/wasted is each bucket's running total
    for r in results:
        bucket = r.metrics.get("chorus/bucket")
        wasted_by_bucket[bucket] = max(wasted_by_bucket.get(bucket, 0), r.metrics.get("chorus/wasted", 0))
    wasted = sum(wasted_by_bucket.values())
    print("trials fused per bucket:")
    for name, stats in sorted(bucket_stats().items()):
        fused = [t for t in stats["trials"] if t in members]
        if fused:
            print(f"  {name}: {stats['model']}, {stats['bucket_size']} slots, {len(fused)} trials fused")
    print(f"member-iterations computed but never read: {wasted}")
    model = chorus_tune.load_model(best.checkpoint)
    print(f"load_model -> {type(model).__name__} with {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
