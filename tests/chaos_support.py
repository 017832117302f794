"""The fault loop (docs/design.md "Faults"; issue 20): a seed draws a fault, the moment it strikes
and the sweep's shape; the sweep runs with the fault injected, and the checks say whether
nothing hung, nothing was lost and every result stayed on its trial's reference trajectory.

Faults: ``kill_bucket`` (a bucket actor is killed), ``kill_trial`` (a trial
actor is killed), ``oom`` (the models' forward raises ``torch.OutOfMemoryError``
on its next ``n`` calls in a bucket), ``kill_pool`` (the pool actor is killed)
and, on a fake cluster, ``remove_node`` (the worker running a bucket is
removed). The moment: the ``at``-th result Tune receives. The shape: bucket
size (2 or 4; 4 trials, 3 iterations), a stop dict alone or with ChorusASHA, ChorusSearch
or Tune's own search.
"""
from __future__ import annotations

import glob
import os
import random
import sys
import time
from dataclasses import dataclass

import pytest
import ray
import ray.cloudpickle
import torch
from ray import tune
from torch import nn

from chorus_tune import Task, reference
from chorus_tune.tune import ChorusASHA, ChorusSearch, ChorusTrainable, bucket_stats
from chorus_tune.tune.client import get_pool
from chorus_tune.tune.values.protocol import NAMESPACE

from tune_support import digits, mlp

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module

LOCAL_FAULTS = ("kill_bucket", "kill_trial", "oom", "kill_pool")
CLUSTER_FAULTS = LOCAL_FAULTS + ("remove_node",)
# Words one of which each error a trial recovered from names, per fault (it
# failed of the fault injected, not of something else). A trial that ends in
# ERROR is not judged by these: only an out-of-memory fault that outlasts the
# retries may end one (Scenario.outlasts_retries).
FAULT_WORDS = {
    "kill_bucket": ("died", "BucketLost", "closed"),
    "kill_trial": ("died", "ActorDied", "RayActorError", "unexpectedly"),
    "oom": ("out of memory", "OutOfMemory"),
    "kill_pool": ("pool", "died"),
    "remove_node": ("died", "BucketLost", "node", "unexpectedly"),
}
# A sweep here takes 20-60 s on 2 busy cores; one past this hangs.
RUN_BOUND_S = 300
MAX_FAILURES = 3


@dataclass(frozen=True)
class Scenario:
    """One run of the loop, all drawn from ``seed``."""

    seed: int
    fault: str
    at: int  # the fault strikes when Tune has received this many results
    bucket_size: int
    trials: int
    iterations: int
    asha: bool  # ChorusASHA as well as the stop dict
    search: bool  # ChorusSearch, else Tune's default search
    oom_calls: int  # for "oom": forward calls that run out

    @classmethod
    def draw(cls, seed: int, faults: tuple[str, ...] = LOCAL_FAULTS) -> "Scenario":
        rng = random.Random(seed)
        # Small: on 2 shared cores a sweep of 4 trials takes 1-3 minutes, mostly Tune's.
        bucket_size = rng.choice((2, 4))
        trials = 4
        iterations = 3
        fault, at = rng.choice(faults), rng.randint(1, trials * (iterations - 1))
        asha, search, oom_calls = rng.random() < 0.5, rng.random() < 0.5, rng.choice((1, 2, 50))
        if asha:
            # ChorusASHA may stop all but one trial at iteration 1: only the first
            # result of each trial is sure to come (seed 16 once never struck).
            at = 1 + (at - 1) % trials
        return cls(seed=seed, fault=fault, at=at, bucket_size=bucket_size, trials=trials, iterations=iterations,
                   asha=asha, search=search, oom_calls=oom_calls)

    @property
    def outlasts_retries(self) -> bool:
        """Whether the fault may fail one trial more often than ``MAX_FAILURES``
        retries cover. Only an out-of-memory error can fail a trial, one each
        call at most (a group that runs out is split, and only a member alone
        fails), so only more calls than that can; a killed actor fails a trial
        once."""
        return self.fault == "oom" and self.oom_calls > MAX_FAILURES


class OutOfMemoryOnCue(nn.Module):
    """``mlp(config)``, whose forward raises ``torch.OutOfMemoryError`` while
    ``<flag_dir>/oom.*`` files are left: each call under autograd takes one."""

    def __init__(self, config: dict, flag_dir: str):
        super().__init__()
        self.net = mlp(config)
        self.flag_dir = flag_dir

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            for flag in sorted(glob.glob(os.path.join(self.flag_dir, "oom.*"))):
                try:
                    os.unlink(flag)
                except FileNotFoundError:
                    continue  # another bucket took it
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the fault loop)")
        return self.net(x)


def chaos_task(flag_dir: str) -> Task:
    def model(config: dict) -> nn.Module:
        return OutOfMemoryOnCue(config, flag_dir)

    return Task(model=model, data=digits, optimizer="sgd", batch_size=64)


class Injector(tune.Callback):
    """Strikes the scenario's fault at its moment; keeps every result Tune received
    and every error a trial failed with (recovered, or final)."""

    def __init__(self, scenario: Scenario, flag_dir: str, cluster=None, workers=()):
        self.scenario, self.flag_dir = scenario, flag_dir
        self.cluster, self.workers = cluster, list(workers)
        self.count = 0
        self.struck: str | None = None
        self.results: dict[str, list[dict]] = {}
        self.errors: dict[str, list[str]] = {}
        self.recoveries = 0  # trials Tune restarted from their checkpoints

    def __getstate__(self) -> dict:
        return {**self.__dict__, "cluster": None, "workers": []}

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.results.setdefault(trial.trial_id, []).append(
            {k: result.get(k) for k in ("training_iteration", "iteration", "val_loss", "chorus/seed",
                                         "chorus/bucket", "chorus/oom_recoveries")} | {"config": dict(trial.config)})
        self.count += 1
        if self.struck is None and self.count >= self.scenario.at:
            self.struck = self._strike(trial, result)

    def _strike(self, trial, result) -> str:
        fault = self.scenario.fault
        bucket = result["chorus/bucket"]
        if fault == "kill_bucket":
            ray.kill(ray.get_actor(bucket, namespace=NAMESPACE), no_restart=True)
        elif fault == "kill_trial":
            ray.kill(trial.temporary_state.ray_actor, no_restart=True)
        elif fault == "oom":
            for i in range(self.scenario.oom_calls):
                open(os.path.join(self.flag_dir, f"oom.{i:03d}"), "w").close()
        elif fault == "kill_pool":
            ray.kill(get_pool(create=False), no_restart=True)
        elif fault == "remove_node":
            node_id = bucket_stats()[bucket]["node_id"]
            self.cluster.remove_node(next(w for w in self.workers if w.node_id == node_id))
        return f"{fault} at result {self.count} ({trial.trial_id}, bucket {bucket})"

    def _error(self, trial) -> None:
        if trial.error_file and os.path.exists(trial.error_file):
            with open(trial.error_file) as f:
                self.errors.setdefault(trial.trial_id, []).append(f.read())

    def on_trial_recover(self, iteration, trials, trial, **info):
        self.recoveries += 1
        self._error(trial)

    def bucket_oom_recoveries(self) -> int:
        """The most out-of-memory errors any bucket had survived, as its results said."""
        return max((row["chorus/oom_recoveries"] or 0 for rows in self.results.values() for row in rows), default=0)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._error(trial)


def run_scenario(scenario: Scenario, storage: str, flag_dir: str, cluster=None, workers=()) -> dict:
    """Runs one scenario and checks it (see the module's docstring); returns its figures."""
    task = chaos_task(flag_dir)
    trainable = ChorusTrainable.for_task(task, bucket_size=scenario.bucket_size, reap_interval_s=0.5,
                                         result_timeout_s=120.0)
    injector = Injector(scenario, flag_dir, cluster, workers)
    space = {"lr": tune.uniform(0.02, 0.3), "seed": tune.randint(0, 1000)}
    search = (ChorusSearch(task=trainable, random_state=scenario.seed, max_iterations=scenario.iterations)
              if scenario.search else None)
    scheduler = (ChorusASHA(max_t=scenario.iterations, reduction_factor=2, grace_period=1)
                 if scenario.asha else None)
    start = time.monotonic()
    results = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=scenario.trials, reuse_actors=True,
                                    search_alg=search, scheduler=scheduler),
        run_config=tune.RunConfig(storage_path=storage, stop={"training_iteration": scenario.iterations},
                                  verbose=0, callbacks=[injector],
                                  failure_config=tune.FailureConfig(max_failures=MAX_FAILURES),
                                  checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1))).fit()
    seconds = time.monotonic() - start
    assert injector.struck is not None, (scenario, "the fault never struck")
    for flag in glob.glob(os.path.join(flag_dir, "oom.*")):
        os.unlink(flag)  # the reference below builds the same models
    check(scenario, results, injector, task, seconds)
    return {"seed": scenario.seed, "fault": scenario.fault, "struck": injector.struck, "seconds": round(seconds, 1),
            "recovered": injector.recoveries, "bucket_oom_recoveries": injector.bucket_oom_recoveries(),
            "errors": sum(r.error is not None for r in results)}


def check(scenario: Scenario, results, injector: Injector, task: Task, seconds: float) -> None:
    """The loop's three promises, for one run."""
    # No run took longer than its bound (never_hangs stops one that would hang).
    assert seconds < RUN_BOUND_S, (scenario, seconds)
    # Every trial ended without error: one fault, MAX_FAILURES retries. Only
    # an out-of-memory fault that outlasts the retries may end a trial in
    # ERROR, and then of running out of memory.
    assert len(results) == scenario.trials, (scenario, len(results))
    for r in results:
        if r.error is not None:
            assert scenario.outlasts_retries, (scenario, "a trial ended in ERROR", str(r.error)[-2000:])
            assert "OutOfMemory" in str(r.error) or "out of memory" in str(r.error), (scenario, str(r.error)[-2000:])
        elif not scenario.asha:  # the stop dict alone stops nobody early
            assert r.metrics["training_iteration"] == scenario.iterations, (scenario, r.metrics)
    words = FAULT_WORDS[scenario.fault]
    for trial_id, texts in injector.errors.items():
        for text in texts:
            assert any(w in text for w in words), (scenario, trial_id, text[-2000:])
    # The fault was recovered from: a trial restarted from its checkpoint, or
    # (out of memory) a bucket that split its group and went on. Else the run
    # tested no recovery at all (the fault struck nothing that mattered).
    assert injector.recoveries + injector.bucket_oom_recoveries() >= 1, (scenario, "no recovery", injector.struck)
    # Every result Tune received (after a recovery too) is on its trial's
    # reference trajectory, the member's iteration count equal to Tune's: a
    # recovered trial went on from its checkpoint, not from scratch.
    references: dict[tuple, list[dict]] = {}
    for trial_id, rows in injector.results.items():
        for row in rows:
            config = {k: v for k, v in row["config"].items() if not k.startswith("__")}
            key = (tuple(sorted(config.items())), row["chorus/seed"])
            if key not in references:
                references[key], _ = reference.train(task, config, seed=row["chorus/seed"],
                                                     iterations=scenario.iterations)
            assert row["iteration"] == row["training_iteration"], (scenario, trial_id, row)
            expected = references[key][row["iteration"] - 1]["val_loss"]
            assert row["val_loss"] == pytest.approx(expected, rel=1e-5), (scenario, trial_id, row)
