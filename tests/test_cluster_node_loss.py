"""Losing a worker node mid-sweep (docs/design.md D14): only its buckets are lost, and their
trials resume from their checkpoints on the other node, on their reference trajectories.

A fake cluster of its own (the test removes one of its nodes): a head and two
workers with two GPUs each. Slow (minutes on 2 cores): deselect with
``-m "not cluster"``.
"""
from __future__ import annotations

import sys

import pytest
import ray
import ray.cloudpickle
from ray import tune

from chorus_tune import reference
from chorus_tune.tune import bucket_stats

from cluster_support import assert_on_reference, fake_cluster, never_hangs, sweep
from tune_support import digits_task

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module

pytestmark = pytest.mark.cluster

ITERATIONS = 4


@pytest.fixture
def cluster():
    with fake_cluster() as (fake, workers):
        yield fake, workers


class RemoveANodeMidSweep(tune.Callback):
    """When a trial first reports iteration 2, removes the worker node that ran
    its bucket; notes which trials recovered, and from what error, and every
    result as Tune received it (a recovered trial's own table may hold only its
    rows after the recovery)."""

    def __init__(self, cluster, workers):
        self.cluster, self.workers = cluster, workers
        self.removed: str | None = None
        self.recovered: dict[str, str] = {}
        self.results: dict[str, list[dict]] = {}

    def __getstate__(self) -> dict:
        # Tune pickles its callbacks with the run's state (for Tuner.restore);
        # the cluster's handles cannot be, and a restored run would not need them.
        return {**self.__dict__, "cluster": None, "workers": []}

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.results.setdefault(trial.trial_id, []).append(
            {k: result[k] for k in ("training_iteration", "iteration", "val_loss", "chorus/bucket")})
        if self.removed is None and result["training_iteration"] == 2:
            node_id = bucket_stats()[result["chorus/bucket"]]["node_id"]
            self.cluster.remove_node(next(w for w in self.workers if w.node_id == node_id))
            self.removed = node_id

    def on_trial_recover(self, iteration, trials, trial, **info):
        with open(trial.error_file) as f:
            self.recovered[trial.trial_id] = f.read()


def test_a_lost_node_loses_only_its_buckets_and_their_trials_resume_on_the_other(cluster, tmp_path):
    fake, workers = cluster
    remover = RemoveANodeMidSweep(fake, workers)
    with never_hangs():
        results = sweep(str(tmp_path / "runs"), trials=16, bucket_size=4, iterations=ITERATIONS,
                        callbacks=[remover], failure_config=tune.FailureConfig(max_failures=3),
                        checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1))

    assert remover.removed is not None
    survivor = next(w.node_id for w in workers if w.node_id != remover.removed)
    # The ResultGrid is complete, and every trial is on its reference trajectory
    # (a resumed member's own iteration count goes on from its checkpoint's).
    assert len(results) == 16 and not results.errors
    for result in results:
        assert_on_reference(result, ITERATIONS)

    # Only the removed node's buckets died; the pool (on the head) kept their record.
    stats = bucket_stats()
    lost = {name for name, s in stats.items() if s["node_id"] == remover.removed}
    assert lost and all(stats[name].get("died") for name in lost)
    assert not any(s.get("died") for name, s in stats.items() if name not in lost)
    assert all(s["node_id"] == survivor for name, s in stats.items() if name not in lost)

    # The trials that read a lost bucket failed with BucketLost, were recovered,
    # and finished in buckets on the other node.
    hit = [r for r in results if {row["chorus/bucket"] for row in remover.results[r.metrics["trial_id"]]} & lost]
    assert hit and {r.metrics["trial_id"] for r in hit} <= set(remover.recovered)
    assert all(stats[r.metrics["chorus/bucket"]]["node_id"] == survivor for r in hit)
    assert any("died" in text for text in remover.recovered.values())
    # Every result Tune received from them after the loss continues their
    # reference trajectories, the member's own count equal to Tune's; at least
    # one went on from a checkpoint past iteration 1 (not from scratch).
    resumed_at = []
    for r in hit:
        expected, _ = reference.train(digits_task(), dict(r.config), seed=r.config["seed"], iterations=ITERATIONS)
        after = [row for row in remover.results[r.metrics["trial_id"]] if row["chorus/bucket"] not in lost]
        for row in after:
            assert row["iteration"] == row["training_iteration"]
            assert row["val_loss"] == pytest.approx(expected[row["iteration"] - 1]["val_loss"], rel=1e-5)
        resumed_at.append(min(row["training_iteration"] for row in after))
    assert any(first > 1 for first in resumed_at)
    print("figures:", {"removed": remover.removed[:8], "survivor": survivor[:8], "buckets lost": len(lost),
                       "buckets on the survivor": len(stats) - len(lost), "trials recovered": len(remover.recovered),
                       "trials whose bucket was lost": len(hit), "resumed at iteration": sorted(resumed_at)})
