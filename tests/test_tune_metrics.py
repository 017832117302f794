"""A task's own metric through tune.Tuner: ChorusASHA's cohort decision on it, and
a metric that raises failing only the trials whose evaluation it broke."""
from __future__ import annotations

import sys

import pytest
import ray.cloudpickle
import torch
from ray import tune

from chorus_tune.tune import ChorusSearch, ChorusTrainable
from chorus_tune.tune.schedulers.asha import ChorusASHA
from chorus_tune.tune.values import result_keys as rk

from prune_support import Recorder, reference_metric, replay
from tune_support import digits_task, run_config

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.usefixtures("local_ray")


def confidence(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The mean top-class probability: continuous (no ties), and ranked neither
    as val_loss nor as val_accuracy rank."""
    return float(outputs.softmax(dim=1).max(dim=1).values.mean())


def finite_only(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    if not torch.isfinite(outputs).all():
        raise ValueError("non-finite outputs")
    return float((outputs.argmax(dim=1) == targets).float().mean())


def test_a_task_metric_drives_chorus_asha_cohort_decision(tmp_path):
    """8 members in one bucket, halved at rung 1 on ``confidence`` with
    mode="min" (the least confident go on), exactly as the cohort rule decides
    on the reference's ``confidence``."""
    task = digits_task(metrics={"confidence": confidence})
    trainable = ChorusTrainable.for_task(task, bucket_size=8)
    recorder = Recorder()
    results = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search([0.003, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.6]), "seed": 0},
        tune_config=tune.TuneConfig(metric="confidence", mode="min", num_samples=8, reuse_actors=True,
                                    search_alg=ChorusSearch(task=trainable),
                                    scheduler=ChorusASHA(max_t=4, reduction_factor=4)),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0, callbacks=[recorder]),
    ).fit()
    assert not results.errors
    configs = {r.metrics["trial_id"]: (dict(r.config), r.metrics["chorus/seed"]) for r in results}
    at_rung = [r for k, _, it, r in recorder.events if k == "result" and it == 1]
    assert len(at_rung) == 8 and all(r[rk.DECISION] in ("CONTINUE", "STOP") for r in at_rung)
    assert {r[rk.COHORT_SIZE] for r in at_rung} == {8}  # one cohort, decided in its bucket
    ref = reference_metric(task, configs, 4, metric="confidence")
    expected_stopped = replay(recorder.events, ref, max_t=4, reduction_factor=4, sign=-1.0)
    stopped = {r.metrics["trial_id"] for r in results if r.metrics["training_iteration"] < 4}
    assert stopped == expected_stopped and len(stopped) >= 6
    for r in results:  # the metric each trial reported is its reference's
        fused = r.metrics_dataframe.sort_values("training_iteration")["confidence"].tolist()
        assert fused == pytest.approx([ref[r.metrics["trial_id"]][i + 1] for i in range(len(fused))], rel=1e-5)


def test_a_metric_that_raises_fails_only_the_trials_whose_evaluation_it_broke(tmp_path):
    task = digits_task(metrics={"strict": finite_only})
    trainable = ChorusTrainable.for_task(task, bucket_size=4, max_iterations=2)
    results = tune.Tuner(
        trainable, param_space={"lr": tune.grid_search([0.05, 1e12, 0.1, 0.2]), "seed": 0},
        tune_config=tune.TuneConfig(metric="strict", mode="min", num_samples=4, reuse_actors=True,
                                    search_alg=ChorusSearch(task=trainable, max_iterations=2)),
        run_config=run_config(tmp_path, 2),
    ).fit()
    errors = [r for r in results if r.error is not None]
    assert [r.config["lr"] for r in errors] == [1e12]  # it diverges: non-finite outputs
    assert "metric 'strict' raised ValueError: non-finite outputs" in str(errors[0].error)
    finished = [r for r in results if r.error is None]
    assert len(finished) == 3 and all(r.metrics["training_iteration"] == 2 for r in finished)
    assert all(0.0 <= r.metrics["strict"] <= 1.0 for r in finished)
