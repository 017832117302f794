"""What a ChorusTrainable does in the driver as Tune creates its trials (Ray-free):
it starts its job's pool then, once, so that the pool's start overlaps the trial actors'."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray

import chorus_tune.tune.trial.trainable as trainable_module
from chorus_tune.tune import ChorusTrainable

from models import mlp_task


@pytest.fixture
def driver(monkeypatch):
    """A driver of job ``driver.job`` on a 2-CPU Ray at ``driver.gcs``, as Tune sees it when it
    creates trials; ``driver.pools`` lists the jobs whose pool was started."""
    state = SimpleNamespace(job="01000000", gcs="10.0.0.1:6379", pools=[], fail=False)

    def get_pool(create=False, job_id=None):
        assert create
        if state.fail:
            raise RuntimeError("no pool here")
        state.pools.append((state.gcs, state.job))

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: SimpleNamespace(get_job_id=lambda: state.job, gcs_address=state.gcs))
    monkeypatch.setattr(trainable_module, "get_pool", get_pool)
    monkeypatch.setattr(trainable_module, "_POOL_STARTED", set())
    return state


def test_tune_creating_trials_starts_the_job_s_pool_once(driver):
    trainable = ChorusTrainable.for_task(mlp_task(), bucket_size=4)
    for lr in (0.1, 0.2, 0.3):
        trainable.default_resource_request({"lr": lr})
    assert driver.pools == [("10.0.0.1:6379", "01000000")]
    driver.job = "02000000"  # the next driver (a restore, a second script) starts its own
    trainable.default_resource_request({"lr": 0.1})
    assert driver.pools[1:] == [("10.0.0.1:6379", "02000000")]


def test_a_new_ray_s_first_job_gets_its_pool_started_though_an_old_one_s_had_the_same_id(driver):
    trainable = ChorusTrainable.for_task(mlp_task(), bucket_size=4)
    trainable.default_resource_request({"lr": 0.1})
    driver.gcs = "10.0.0.1:6380"  # Ray restarted in this process: its jobs count from 1 again
    trainable.default_resource_request({"lr": 0.1})
    assert driver.pools == [("10.0.0.1:6379", "01000000"), ("10.0.0.1:6380", "01000000")]


def test_a_pool_that_cannot_start_early_leaves_the_trial_s_resources_as_they_were(driver):
    trainable = ChorusTrainable.for_task(mlp_task(), bucket_size=4)
    expected = trainable.default_resource_request({"lr": 0.1})  # started (in the fake) and sized
    driver.fail, driver.job = True, "02000000"
    assert trainable.default_resource_request({"lr": 0.1}).required_resources == expected.required_resources


def test_without_ray_no_pool_is_started(driver, monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    ChorusTrainable.for_task(mlp_task(), bucket_size=4).default_resource_request({"lr": 0.1})
    assert driver.pools == []


def test_a_trial_chorus_search_suggested_holds_its_share_of_the_cores(driver):
    # Issue 40 item 5: ChorusSearch runs 2 trials at once on the 2 CPUs; the
    # trials' tokens hold the cores the buckets compute on (1 CPU each), not
    # 2 / 8 slots each (Ray saw 0.5 of 2 CPUs in use).
    from chorus_tune.tune.values import run_plan

    trainable = ChorusTrainable.for_task(mlp_task(), bucket_size=4)
    run_plan.hand_trial_concurrency(2)  # ChorusSearch.suggest, just before Tune creates the trial
    assert trainable.default_resource_request({"lr": 0.1}).required_resources == {"CPU": 1.0}


def test_a_trial_of_tunes_default_search_gets_a_token_per_slot(driver):
    from chorus_tune.tune.values import run_plan

    trainable = ChorusTrainable.for_task(mlp_task(), bucket_size=4)
    run_plan.hand_trial_concurrency(2)
    trainable.default_resource_request({"lr": 0.1})
    # Handed once, for the trial Tune creates next: a later default-search run is not affected.
    assert trainable.default_resource_request({"lr": 0.2}).required_resources == {"CPU": 0.25}
