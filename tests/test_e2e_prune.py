"""End to end: 32 digits MLPs through Tune with ChorusSearch + ChorusASHA.

ChorusSearch seats members ahead of Tune, two buckets of 8 at once; each
bucket halves the cohorts that reach ChorusASHA's rungs (rf=4, rungs at 1
and 4) and refills the freed slots with seated members. The trials that
reach max_t must be exactly those the cohort rule picks from the *reference*
(unfused) metrics of the same configs and seeds; nothing is wasted; and the
sweep needs about as many trial actors as the machine has CPUs.
"""
import sys
from collections import defaultdict

import pytest
import ray
import ray.cloudpickle
from ray import tune

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from prune_support import Recorder, cohorts_at, reference_metric, replay  # noqa: E402

pytestmark = pytest.mark.usefixtures("local_ray")  # the suite's shared Ray (conftest.py), 2 CPUs

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRIALS, BUCKET, MAX_BUCKETS, MAX_T, RF = 32, 8, 2, 16, 4


def _trial_actors() -> set[str]:
    """Every trial actor this job ever created, alive or not (the GCS's actor
    table: the shared Ray runs no dashboard for the state API)."""
    job = ray.get_runtime_context().get_job_id()
    return {a["ActorID"] for a in ray._private.state.actors().values()
            if a["ActorClassName"] == "ChorusTrainable" and a["JobID"] == job}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    from chorus_tune.tune import ChorusTrainable, bucket_stats
    from chorus_tune.tune.schedulers.asha import ChorusASHA
    from chorus_tune.tune.search.search import ChorusSearch

    from tune_support import digits_task

    before = _trial_actors()  # the module shares its Ray: earlier modules' trial actors are not this sweep's
    task = digits_task()
    # compact_after_s=0: at the default 1 s, a bucket left with its last survivors
    # looks again only after they have trained their last epochs (a lone member's
    # 12 trains unfused in well under a second), and then has nothing to compact.
    trainable = ChorusTrainable.for_task(task, bucket_size=BUCKET, max_buckets=MAX_BUCKETS, compact_after_s=0.0)
    recorder = Recorder()
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": tune.loguniform(0.003, 0.5), "momentum": tune.uniform(0.0, 0.9),
                     "seed": tune.randint(0, 10_000)},
        tune_config=tune.TuneConfig(
            metric="val_loss", mode="min", num_samples=TRIALS,
            # A finished trial's actor serves the next trial (a fresh one costs
            # about 1.3 CPU-s of imports).
            reuse_actors=True,
            search_alg=ChorusSearch(task=trainable, random_state=0),
            scheduler=ChorusASHA(max_t=MAX_T, reduction_factor=RF),
        ),
        run_config=tune.RunConfig(storage_path=str(tmp_path_factory.mktemp("e2e")), verbose=0,
                                  callbacks=[recorder]),
    )
    results = tuner.fit()
    # The shared pool also holds earlier modules' buckets (a trial that errored may have reported none).
    ours = {r.metrics.get("chorus/bucket") for r in results}
    stats = {name: s for name, s in bucket_stats().items() if name in ours}
    yield task, results, recorder, stats, _trial_actors() - before


def _results(recorder):
    return [(tid, it, r) for kind, tid, it, r in recorder.events if kind == "result"]


def test_every_trial_runs_and_none_errors(sweep):
    _, results, *_ = sweep
    assert len(results) == TRIALS and not results.errors


def test_trials_reaching_max_t_are_those_halving_picks_from_reference_metrics(sweep):
    task, results, recorder, *_ = sweep
    configs = {r.metrics["trial_id"]: (dict(r.config), r.metrics["chorus/seed"]) for r in results}
    ref = reference_metric(task, configs, MAX_T)
    stopped = replay(recorder.events, ref, max_t=MAX_T, reduction_factor=RF)
    reached = {r.metrics["trial_id"] for r in results if r.metrics["training_iteration"] == MAX_T}
    assert reached == set(configs) - stopped
    assert reached


def test_each_cohort_at_the_first_rung_keeps_a_quarter(sweep):
    _, _, recorder, *_ = sweep
    last = defaultdict(int)
    for tid, it, _ in _results(recorder):
        last[tid] = max(last[tid], it)
    cohorts = cohorts_at(recorder.events, 1)
    assert any(len(c) == BUCKET for c in cohorts)  # members seated together reach the rung together
    for cohort in cohorts:
        assert sum(last[t] > 1 for t in cohort) == max(1, len(cohort) // RF)


def test_no_bucket_ever_trains_more_members_than_its_capacity(sweep):
    _, _, recorder, *_ = sweep
    for _, _, r in _results(recorder):
        assert r["chorus/live"] <= r["chorus/capacity"] <= BUCKET


def test_nothing_is_wasted_when_the_bucket_knows_every_decision(sweep):
    _, results, *_ = sweep
    assert all(r.metrics["chorus/wasted"] == 0 for r in results)


def test_freed_slots_are_refilled_with_seated_members(sweep):
    _, _, recorder, *_ = sweep
    hosted = defaultdict(set)
    for tid, _, r in _results(recorder):
        hosted[r["chorus/bucket"]].add(tid)
    assert len(hosted) <= MAX_BUCKETS * 2 and any(len(trials) > BUCKET for trials in hosted.values())


def test_a_bucket_compacts_once_nothing_waits_for_its_slots(sweep):
    *_, stats, _ = sweep
    assert any(s.get("compactions", 0) >= 1 and s["capacity"] < BUCKET for s in stats.values())


def test_trial_actors_number_about_the_cpus_not_the_slots(sweep):
    *_, actors = sweep
    # ChorusSearch runs one trial per CPU and Tune reuses their actors; a few
    # more may start while a finishing trial's actor is not yet cached.
    cpus = int(ray.cluster_resources()["CPU"])
    assert 1 <= len(actors) <= cpus + 2, len(actors)
