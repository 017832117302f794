"""ChorusASHA in real Tune runs: on a plain function trainable, and on fused ChorusTrainable members."""
import random
import sys

import pytest
import ray
import ray.cloudpickle
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from chorus_tune import reference
from chorus_tune.tune.schedulers.asha import ChorusASHA

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from prune_support import Recorder, cohorts_at, reference_metric, replay  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.usefixtures("local_ray")




def _noisy(config):
    rng = random.Random(config["seed"])
    for _ in range(8):
        tune.report({"score": config["q"] + rng.random()})


class _Stub:
    def __init__(self, trial_id):
        self.trial_id = trial_id


def test_on_a_plain_trainable_it_decides_what_stock_asha_decides_in_the_same_order(tmp_path):
    recorder = Recorder()
    tuner = tune.Tuner(
        _noisy,
        param_space={"q": tune.grid_search([0.0, 0.5, 1.0, 1.5]), "seed": tune.grid_search([1, 2])},
        # reuse_actors: the decisions are compared on the recorded events; a
        # fresh actor per trial only costs about 2 CPU-s of imports each.
        tune_config=tune.TuneConfig(metric="score", mode="max", reuse_actors=True,
                                    scheduler=ChorusASHA(max_t=8, reduction_factor=2)),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0, callbacks=[recorder]),
    )
    results = tuner.fit()
    assert not results.errors
    stock = ASHAScheduler(metric="score", mode="max", max_t=8, reduction_factor=2)
    stubs = {}
    stopped_by_stock = set()
    for kind, tid, it, result in recorder.events:
        if tid not in stubs:
            stubs[tid] = _Stub(tid)
            stock.on_trial_add(None, stubs[tid])
        if kind == "result" and stock.on_trial_result(None, stubs[tid], result) == "STOP" and it < 8:
            stopped_by_stock.add(tid)
    stopped = {r.metrics["trial_id"] for r in results if r.metrics["training_iteration"] < 8}
    assert stopped == stopped_by_stock and stopped


@pytest.fixture(scope="module")
def fused_sweep(tmp_path_factory):
    """8 digits MLPs seated in one bucket of 8, pruned by ChorusASHA (rf=4, rungs 1 and 4)."""
    from chorus_tune.tune import ChorusSearch, ChorusTrainable

    from tune_support import digits_task

    task = digits_task()
    trainable = ChorusTrainable.for_task(task, bucket_size=8)
    recorder = Recorder()
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search([0.01, 0.03, 0.1, 0.3]),
                     "momentum": tune.grid_search([0.0, 0.9]), "seed": 0},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=8, reuse_actors=True,
                                    search_alg=ChorusSearch(task=trainable),
                                    scheduler=ChorusASHA(max_t=4, reduction_factor=4)),
        run_config=tune.RunConfig(storage_path=str(tmp_path_factory.mktemp("fused")), verbose=0,
                                  callbacks=[recorder]),
    )
    results = tuner.fit()
    return task, results, recorder


def test_fused_cohort_is_halved_in_its_bucket_as_reference_metrics_say(fused_sweep):
    task, results, recorder = fused_sweep
    assert not results.errors
    configs = {r.metrics["trial_id"]: ({k: v for k, v in r.config.items()}, r.metrics["chorus/seed"])
               for r in results}
    ref = reference_metric(task, configs, 4)
    expected_stopped = replay(recorder.events, ref, max_t=4, reduction_factor=4)
    stopped = {t for t in configs
               if max(it for k, tt, it, _ in recorder.events if tt == t and k == "result") < 4}
    assert stopped == expected_stopped
    cohorts = cohorts_at(recorder.events, 1)
    assert cohorts == {frozenset(configs)}  # seated together: one cohort of 8, decided in the bucket
    assert len(set(configs) - stopped) == 2


def test_survivors_follow_their_reference_trajectory(fused_sweep):
    task, results, _ = fused_sweep
    survivors = [r for r in results if r.metrics["training_iteration"] == 4]
    assert survivors
    for r in survivors:
        history, _ = reference.train(task, r.config, r.metrics["chorus/seed"], 4)
        fused = r.metrics_dataframe.sort_values("training_iteration")["val_loss"].tolist()
        assert fused == pytest.approx([h["val_loss"] for h in history], rel=1e-4)


def test_pruned_members_train_no_further_and_nothing_is_wasted(fused_sweep):
    _, results, recorder = fused_sweep
    last = {r.metrics["trial_id"]: r.metrics["training_iteration"] for r in results}
    survivors = sum(it >= 2 for it in last.values())
    live_after = {r["chorus/live"] for k, _, it, r in recorder.events if k == "result" and it >= 2}
    assert live_after and max(live_after) <= survivors < len(last)
    assert all(r.metrics["chorus/wasted"] == 0 for r in results)
