"""End to end: 32 digits MLPs through Tune with ChorusSearch + ChorusASHA.

Two buckets of 8 run at once; ChorusASHA halves each cohort (rf=4, rungs at
iterations 1, 4 and 16) and retires the pruned members in their buckets;
ChorusSearch refills the freed slots with the waiting trials. The trials that
reach max_t must be exactly those the cohort rule picks from the *reference*
(unfused) metrics of the same configs and seeds.
"""
import json
import sys
from collections import defaultdict

import pytest
import ray
import ray.cloudpickle
from ray import tune

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from prune_support import Recorder, cohorts_at, reference_metric, replay  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRIALS, BUCKET, MAX_BUCKETS, MAX_T, RF = 32, 8, 2, 16, 4


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    from chorus_tune.tune import ChorusTrainable
    from chorus_tune.tune.schedulers import ChorusASHA
    from chorus_tune.tune.search import ChorusSearch
    from tune_support import digits_task

    # address="local": a Ray instance of our own (others may run on this machine)
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    task = digits_task()
    # compact_after_s=0: an epoch of digits takes milliseconds, so with the
    # default 1 s delay the survivors can finish before a bucket compacts.
    # ChorusSearch's waiting counts keep refills safe without the delay.
    trainable = ChorusTrainable.for_task(task, bucket_size=BUCKET, max_buckets=MAX_BUCKETS,
                                         gather_s=2.0, park_after_s=None, compact_after_s=0.0)
    recorder = Recorder()
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": tune.loguniform(0.003, 0.5), "momentum": tune.uniform(0.0, 0.9),
                     "seed": tune.randint(0, 10_000)},
        tune_config=tune.TuneConfig(
            metric="val_loss", mode="min", num_samples=TRIALS,
            # A pruned trial's actor serves the next waiting trial at once (a
            # fresh actor takes seconds to start on a small machine, by which
            # time the survivors may have finished).
            reuse_actors=True,
            search_alg=ChorusSearch(task=trainable, random_state=0),
            scheduler=ChorusASHA(max_t=MAX_T, reduction_factor=RF),
        ),
        run_config=tune.RunConfig(storage_path=str(tmp_path_factory.mktemp("e2e")), verbose=0,
                                  callbacks=[recorder]),
    )
    results = tuner.fit()
    yield task, results, recorder
    ray.shutdown()


def _results(recorder):
    return [(tid, it, r) for kind, tid, it, r in recorder.events if kind == "result"]


def test_every_trial_runs_and_none_errors(sweep):
    _, results, _ = sweep
    assert len(results) == TRIALS and not results.errors


def test_trials_reaching_max_t_are_those_halving_picks_from_reference_metrics(sweep):
    task, results, recorder = sweep
    configs = {r.metrics["trial_id"]: (dict(r.config), r.metrics["chorus/seed"]) for r in results}
    ref = reference_metric(task, configs, MAX_T)
    stopped = replay(recorder.events, ref, max_t=MAX_T, reduction_factor=RF)
    reached = {r.metrics["trial_id"] for r in results if r.metrics["training_iteration"] == MAX_T}
    assert reached == set(configs) - stopped
    assert reached


def test_each_cohort_at_the_first_rung_keeps_a_quarter(sweep):
    _, _, recorder = sweep
    last = defaultdict(int)
    for tid, it, _ in _results(recorder):
        last[tid] = max(last[tid], it)
    cohorts = cohorts_at(recorder.events, 1)
    assert any(len(c) > 1 for c in cohorts)
    for cohort in cohorts:
        if len(cohort) > 1:
            assert sum(last[t] > 1 for t in cohort) == max(1, len(cohort) // RF)


def test_no_bucket_ever_holds_more_live_members_than_its_capacity(sweep):
    _, _, recorder = sweep
    for _, _, r in _results(recorder):
        assert r["chorus/live"] <= BUCKET
        assert len(json.loads(r["chorus/cohort"])) <= BUCKET


def test_pruned_trials_leave_their_buckets(sweep):
    _, _, recorder = sweep
    last = defaultdict(int)
    for tid, it, _ in _results(recorder):
        last[tid] = max(last[tid], it)
    for _, _, r in _results(recorder):
        for member, entry in json.loads(r["chorus/cohort"]).items():
            assert entry["iteration"] <= last[member]


def test_freed_slots_are_refilled_with_waiting_trials(sweep):
    _, _, recorder = sweep
    hosted = defaultdict(set)
    for tid, _, r in _results(recorder):
        hosted[r["chorus/bucket"]].add(tid)
    assert any(len(trials) > BUCKET for trials in hosted.values())


def test_buckets_compact_but_only_once_no_trial_is_left_to_start(sweep):
    _, _, recorder = sweep
    events = _results(recorder)
    first_result = {}
    for i, (tid, _, _) in enumerate(events):
        first_result.setdefault(tid, i)
    last_start = max(first_result.values())
    compacted = [i for i, (_, _, r) in enumerate(events) if r.get("chorus/compactions", 0) > 0]
    assert compacted, "no bucket compacted"
    # while a trial was still to join, a pruned bucket was refilled, not shrunk
    assert min(compacted) > last_start
    assert all(r["chorus/capacity"] < BUCKET for _, _, r in events[min(compacted):]
               if r.get("chorus/compactions", 0) > 0)
