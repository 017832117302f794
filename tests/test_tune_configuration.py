"""Module settings through tune.Tuner (docs/design.md D9): a dropout sweep stays in one bucket per width."""
from __future__ import annotations

import math
import sys

import pytest
import ray.cloudpickle
from ray import tune
from torch import nn

from chorus_tune import reference
from chorus_tune.tune import ChorusSearch, ChorusTrainable
from chorus_tune.tune.values import result_keys as rk

from tune_support import digits_task, run_config

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.usefixtures("local_ray")


def dropout_mlp(config: dict) -> nn.Module:
    width = config["width"]
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Dropout(config["p"]), nn.Linear(width, 10))


def test_a_dropout_sweep_stays_in_one_vmapped_bucket_per_width_each_member_at_its_own_rate(tmp_path):
    task = digits_task(model=dropout_mlp, iteration_steps=4)
    trainable = ChorusTrainable.for_task(task, bucket_size=4, max_buckets=2, route="vmap")
    # lr 0.3: 8 steps move the loss well away from chance, and dropout with it.
    # 16 and 128: too far apart to pad together (docs/design.md D9), so one bucket each.
    space = {"width": tune.grid_search([16, 128]), "p": tune.grid_search([0.0, 0.3, 0.6, 0.9]), "lr": 0.3}
    results = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=8, reuse_actors=True,
                                    search_alg=ChorusSearch(task=trainable)),
        run_config=run_config(tmp_path, iterations=2),
    ).fit()
    assert not results.errors and len(results) == 8
    buckets: dict[int, set[str]] = {}
    for result in results:
        buckets.setdefault(result.config["width"], set()).add(result.metrics[rk.BUCKET])
    assert {width: len(names) for width, names in buckets.items()} == {16: 1, 128: 1}
    assert buckets[16] != buckets[128]
    # Each member trains at its own rate in the fused step: p = 0 draws no mask
    # and follows its reference to the float; p > 0 leaves the trajectory of
    # p = 0 (the rate a stack that lost its members' rates would use for all).
    for result in results:
        config = dict(result.config)
        no_dropout = reference.train(task, {**config, "p": 0.0}, result.metrics[rk.SEED], 2)[0][-1]["val_loss"]
        same = math.isclose(result.metrics["val_loss"], no_dropout, rel_tol=1e-5)
        assert same == (config["p"] == 0.0), (config, result.metrics["val_loss"], no_dropout)
