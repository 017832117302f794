"""Sweeps written the way Ray Tune's docs write them (docs/design.md D4, D10).

A stop dict and Tune's default FIFO scheduler, with no chorus-only knob: every
seated member trains in each fused step, nothing is wasted, and every result
is the reference's. ``ChorusSearch()`` without ``task=`` learns its task from
the run's first trial and keeps exactly what synchronous halving keeps under
ChorusASHA. Stock ASHA decides on the fused metrics, as it would on the
reference's, and the speculation it stops early is counted and bounded.
"""
from __future__ import annotations

import sys

import pytest
import ray
import ray.cloudpickle
from ray import tune
from ray.tune.schedulers import ASHAScheduler

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from chorus_tune import reference  # noqa: E402
from chorus_tune.tune import ChorusTrainable  # noqa: E402
from chorus_tune.tune.schedulers.asha import ChorusASHA  # noqa: E402
from chorus_tune.tune.search.search import ChorusSearch  # noqa: E402
from chorus_tune.tune.values import result_keys as rk  # noqa: E402

from prune_support import Recorder  # noqa: E402
from tune_support import digits_task, run_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("local_ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SPACE = {"lr": tune.loguniform(0.003, 0.5), "momentum": tune.uniform(0.0, 0.9)}


def _results(recorder):
    return [r for kind, _, _, r in recorder.events if kind == "result"]


def _sweep(tmp_path, trainable, search, scheduler=None, trials=8, iterations=4, metric="val_loss"):
    recorder = Recorder()
    results = tune.Tuner(
        trainable, param_space=SPACE,
        tune_config=tune.TuneConfig(metric=metric, mode="min", num_samples=trials, reuse_actors=True,
                                    search_alg=search, scheduler=scheduler),
        run_config=run_config(tmp_path, iterations, callbacks=[recorder]),
    ).fit()
    assert not results.errors
    return results, recorder


def test_a_stop_dict_fifo_sweep_trains_every_seated_member_in_each_fused_step(tmp_path):
    task = digits_task()
    trainable = ChorusTrainable.for_task(task, bucket_size=8, max_buckets=1)
    results, recorder = _sweep(tmp_path, trainable, ChorusSearch(task=trainable, random_state=0))
    rows = _results(recorder)
    assert len(rows) == 8 * 4
    # One bucket of 8 seated at once: every fused iteration trained all 8,
    # without waiting for the two trials Tune runs at a time.
    assert {r[rk.LIVE] for r in rows} == {8}
    assert max(r[rk.WASTED] for r in rows) == 0
    for result in results:
        history, _ = reference.train(task, dict(result.config), result.metrics[rk.SEED], 4)
        got = result.metrics_dataframe.sort_values("training_iteration")["val_loss"].tolist()
        assert got == pytest.approx([h["val_loss"] for h in history], rel=1e-5, abs=1e-6)


def test_chorus_search_without_task_keeps_what_synchronous_halving_keeps(tmp_path):
    task = digits_task()
    trainable = ChorusTrainable.for_task(task, bucket_size=16, max_buckets=1)
    # The case: 16 trials, rf 4, rungs at 1 and 4: halving keeps 4, then 1.
    results, recorder = _sweep(tmp_path, trainable, ChorusSearch(bucket_size=16, random_state=0),
                               scheduler=ChorusASHA(max_t=9, grace_period=1, reduction_factor=4),
                               trials=16, iterations=9)
    reached = {r.metrics["trial_id"]: r.metrics["training_iteration"] for r in results}
    rows = _results(recorder)
    # One cohort of 16 at rung 1; halving keeps the 4 best of it by the
    # reference's val_loss, then the best of those at rung 4.
    assert {r[rk.COHORT_SIZE] for r in rows if r["training_iteration"] == 1} == {16}
    ref = {r.metrics["trial_id"]: [h["val_loss"] for h in reference.train(task, dict(r.config), r.metrics[rk.SEED],
                                                                          min(reached[r.metrics["trial_id"]], 4))[0]]
           for r in results}
    kept_at_1 = {t for t, it in reached.items() if it > 1}
    assert kept_at_1 == set(sorted(ref, key=lambda t: ref[t][0])[:4])
    assert {t for t, it in reached.items() if it > 4} == {min(kept_at_1, key=lambda t: ref[t][3])}
    assert {r[rk.BUCKET] for r in rows} == {rows[0][rk.BUCKET]}  # the scout trained with its cohort
    assert max(r[rk.WASTED] for r in rows) == 0


def test_stock_asha_stops_on_the_fused_metrics_and_its_waste_is_bounded(tmp_path):
    task = digits_task()
    # idle_close_s: the bucket stays open, so that what it learnt can be read after the run.
    trainable = ChorusTrainable.for_task(task, bucket_size=8, max_buckets=1, idle_close_s=60.0)
    max_t = 6
    results, recorder = _sweep(tmp_path, trainable, ChorusSearch(task=trainable, random_state=0),
                               scheduler=ASHAScheduler(max_t=max_t, grace_period=1, reduction_factor=4),
                               trials=8, iterations=max_t)
    rows = _results(recorder)
    # Every result Tune saw (and stock ASHA decided on) is the reference's.
    by_trial = {}
    for result in results:
        by_trial[result.metrics["trial_id"]] = result
    refs = {tid: reference.train(task, dict(r.config), r.metrics[rk.SEED], max_t)[0] for tid, r in by_trial.items()}
    for row in rows:
        expect = refs[row["trial_id"]][row["training_iteration"] - 1]["val_loss"]
        assert row["val_loss"] == pytest.approx(expect, rel=1e-5, abs=1e-6)
    # Stock ASHA stopped some trials early; the bucket learnt its rung at 1.
    assert any(r.metrics["training_iteration"] < max_t for r in results)
    from chorus_tune.tune import bucket_stats

    (bucket,) = {r[rk.BUCKET] for r in rows}
    assert 1 in bucket_stats()[bucket]["decision_points"]
    # The bound (docs/guide/how-a-sweep-runs.md): a member trains past a Tune decision
    # point only before the bucket has seen a trial stopped there, so each
    # trial stopped early wastes at most max_t - 1 iterations.
    stopped = sum(r.metrics["training_iteration"] < max_t for r in results)
    wasted = max(r[rk.WASTED] for r in rows)
    assert wasted <= stopped * (max_t - 1)


def test_a_run_learns_nothing_from_where_the_last_run_stopped_trials(tmp_path):
    from chorus_tune.tune import bucket_stats

    task = digits_task()
    trainable = ChorusTrainable.for_task(task, bucket_size=8, max_buckets=1, idle_close_s=60.0)
    _, stock = _sweep(tmp_path / "stock", trainable, ChorusSearch(task=trainable, random_state=0),
                      scheduler=ASHAScheduler(max_t=4, grace_period=1, reduction_factor=4), trials=8, iterations=4)
    (bucket,) = {r[rk.BUCKET] for r in _results(stock)}
    assert bucket_stats()[bucket]["decision_points"]  # stock ASHA taught its rung
    # The next run in this driver seats its members in that bucket, still open.
    # Two trials: what the bucket learnt does not depend on how many it seats.
    _, fifo = _sweep(tmp_path / "fifo", trainable, ChorusSearch(task=trainable, random_state=1), trials=2,
                     iterations=2)
    assert {r[rk.BUCKET] for r in _results(fifo)} == {bucket}
    assert bucket_stats()[bucket]["decision_points"] == []
