"""Losing a worker node whose bucket was full, when the only GPU left is held by the other bucket
(issue 20): the lost bucket's trials must get a bucket once the survivor frees its GPU, and finish.

A head with 1 CPU and two workers with 2 CPUs and 1 GPU each: one bucket of 4
per worker, 8 trials under Tune's default search (each trial builds a member
of its own). One worker is removed once 4 trials have reported iteration 2.
(Issue 20 hung with buckets of 8; what matters is that both buckets are full
and the survivor holds the only GPU left, which buckets of 4 keep, with half
the trial actors.)
Before the fix the survivor compacted and trained on, and the lost bucket's
trials waited, forever, for a bucket that could not start (see docs/design.md
"Faults"). Slow (minutes on 2 cores): deselect with ``-m "not cluster"``.
"""
from __future__ import annotations

import sys

import pytest
import ray
import ray.cloudpickle
from ray import tune

from chorus_tune.tune import bucket_stats

from cluster_support import assert_on_reference, fake_cluster, never_hangs, sweep

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module

pytestmark = pytest.mark.cluster

ITERATIONS = 8
# Tune's cached actors are part of this test's scenario (members of finished
# trials hold the survivor's slots while their actors wait in Tune's cache), so
# it keeps reuse_actors. A cached actor that died with the removed node costs
# the trial it is handed to two failures (cluster_support.NODE_LOSS_REUSE), on
# top of its own loss: room for that, and every recovery must be the node's loss.
MAX_FAILURES = 8
NODE_LOSS_ERRORS = ("BucketLost", "its node has died")


class RemoveAWorkerAtTheFourthReport(tune.Callback):
    """Removes the worker that ran the reporting trial's bucket once 4 trials
    have reported iteration 2."""

    def __init__(self, cluster, workers):
        self.cluster, self.workers = cluster, workers
        self.removed: str | None = None
        self.at_two: set[str] = set()
        self.recovered: list[str] = []  # the error each recovery was from

    def __getstate__(self) -> dict:
        return {**self.__dict__, "cluster": None, "workers": []}

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result["training_iteration"] == 2:
            self.at_two.add(trial.trial_id)
        if self.removed is None and len(self.at_two) >= 4:
            node_id = bucket_stats()[result["chorus/bucket"]]["node_id"]
            self.cluster.remove_node(next(w for w in self.workers if w.node_id == node_id))
            self.removed = node_id

    def on_trial_recover(self, iteration, trials, trial, **info):
        with open(trial.error_file) as f:  # Tune appends each failure under "Failure # n"
            self.recovered.append(f.read().rsplit("Failure # ", 1)[-1])


def test_a_lost_full_bucket_s_trials_wait_for_the_survivor_s_gpu_and_finish(tmp_path):
    with fake_cluster(workers=2, gpus_per_worker=1, head_cpus=1) as (fake, workers):
        remover = RemoveAWorkerAtTheFourthReport(fake, workers)
        with never_hangs():
            results = sweep(str(tmp_path / "runs"), trials=8, bucket_size=4, iterations=ITERATIONS,
                            search=False, callbacks=[remover],
                            failure_config=tune.FailureConfig(max_failures=MAX_FAILURES),
                            checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1))
        stats = bucket_stats()
    assert remover.removed is not None
    assert len(results) == 8 and not results.errors
    # Every retry was for the node's loss (a bucket lost, or an actor that died with it), none for another fault.
    assert remover.recovered
    assert all(any(cause in text for cause in NODE_LOSS_ERRORS) for text in remover.recovered), remover.recovered
    for result in results:
        assert result.metrics["training_iteration"] == ITERATIONS
        assert_on_reference(result, ITERATIONS)
    # A bucket of the lost node died; every other bucket ran on the survivor.
    assert any(s.get("died") for s in stats.values())
    print("figures:", {name: {k: s.get(k) for k in ("capacity", "died", "closed", "iterations")}
                       for name, s in stats.items()})
