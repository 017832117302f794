"""Solo members inside real Tune runs (chorus_tune.tune.rules.solo): where nothing fuses, each
trial trains its member itself, as plain Tune would, with no bucket actor; results, seeds and
checkpoints are those a bucket would give."""
from __future__ import annotations

import sys

import pytest
import ray
import ray.cloudpickle
from ray import tune

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from chorus_tune import reference  # noqa: E402
from chorus_tune.tune import ChorusTrainable, load_model  # noqa: E402
from chorus_tune.tune.client import bucket_stats  # noqa: E402
from chorus_tune.tune.search.search import ChorusSearch  # noqa: E402
from chorus_tune.tune.values import result_keys as rk  # noqa: E402

from tune_support import digits_task, history, run_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("local_ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ITERATIONS = 3


def _sweep(tmp_path, space, trials, reuse_actors=True, iterations=ITERATIONS, **options):
    task = digits_task()
    trainable = ChorusTrainable.for_task(task, bucket_size=4, **options)
    before = set(bucket_stats())
    results = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", reuse_actors=reuse_actors, num_samples=trials,
                                    search_alg=ChorusSearch(task=trainable, random_state=0)),
        run_config=run_config(tmp_path, iterations),
    ).fit()
    assert not results.errors
    stats = {name: entry for name, entry in bucket_stats().items() if name not in before}
    return task, results, stats


# Every trial its own batch size: nothing can fuse.
APART = {"batch_size": tune.grid_search([16, 32, 64]), "lr": 0.05, "momentum": 0.5}


def test_where_nothing_fuses_every_trial_trains_its_member_itself_as_the_reference_does(tmp_path):
    task, results, stats = _sweep(tmp_path, APART, 3)
    assert len(results) == 3
    for result in results:
        frame = result.metrics_dataframe
        assert frame[rk.SOLO].all() and (frame[rk.LIVE] == 1).all()
        ref, model = reference.train(task, dict(result.config), result.metrics[rk.SEED], ITERATIONS)
        assert history(result) == pytest.approx([h["val_loss"] for h in ref], rel=1e-5, abs=1e-6)
        # Its checkpoint holds its own model, as a bucket's would.
        loaded = load_model(result.checkpoint)
        for got, want in zip(loaded.state_dict().values(), model.state_dict().values()):
            assert got.shape == want.shape and (got - want).abs().max().item() < 1e-5
    # No bucket actor: each solo member only held a place in the budget.
    assert len(stats) == 3 and all(entry["solo"] and entry["closed"] for entry in stats.values())


def test_with_solo_off_every_trial_opens_a_bucket(tmp_path):
    _, results, stats = _sweep(tmp_path, {"batch_size": tune.grid_search([16, 32]), "lr": 0.05}, 2, solo=False)
    assert not any(result.metrics.get(rk.SOLO) for result in results)
    assert len(stats) == 2 and not any(entry["solo"] for entry in stats.values())


def test_members_of_one_structure_seated_together_share_a_bucket_not_solo(tmp_path):
    space = {"batch_size": tune.grid_search([16, 32]), "lr": tune.grid_search([0.02, 0.05])}
    _, results, stats = _sweep(tmp_path, space, 4)
    assert not any(result.metrics.get(rk.SOLO) for result in results)
    assert {result.metrics[rk.LIVE] for result in results} == {2}
    assert len(stats) == 2 and not any(entry["solo"] for entry in stats.values())


@ray.remote(num_cpus=0)
class _TrialActor:
    """Stands in for a trial actor that dies while it trains its solo member."""


def test_a_solo_member_whose_trial_actor_dies_leaves_and_frees_its_place(tmp_path):
    import time

    from chorus_tune.tune.client import get_pool
    from chorus_tune.tune.values.plan import Plan

    trainable = ChorusTrainable.for_task(digits_task(), bucket_size=2, max_buckets=1)
    pool = get_pool(create=True)
    seat = ([("m-solo", {"lr": 0.1}, 7)], trainable._task_id, trainable._task_blob, trainable.bucket_options(), Plan())
    assert ray.get(pool.seat.remote(*seat))["m-solo"] == "solo"
    ray.get(pool.bind.remote("trial-solo", ["m-solo"]))
    actor = _TrialActor.remote()
    ray.get(actor.__ray_ready__.remote())
    reply = ray.get(pool.reserve.remote("trial-solo", trainable._task_id, None, {"lr": 0.1},
                                        trainable.bucket_options(), actor._actor_id.hex()))
    assert reply.solo and reply.handle is None
    ray.kill(actor)  # it dies without leaving, as a killed trial process does
    deadline = time.monotonic() + 30
    while ray.get(pool.bucket_of.remote("m-solo")) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.get(pool.bucket_of.remote("m-solo")) is None
    assert any("m-solo" in entry["reaped"] for entry in ray.get(pool.stats.remote()).values())


def _counted_digits(path):
    """The digits splits, counting each call in ``path`` (one line per process that loads them)."""
    import models  # pickled by value (tune_support registers it): workers cannot import it

    def load():
        import os

        with open(path, "a") as f:
            f.write(f"loaded {os.getpid()}\n")
        return models.digits(512, 256)
    return load


def test_a_callables_data_is_loaded_once_per_sweep_and_shared_with_later_processes(tmp_path):
    from chorus_tune import Task
    from chorus_tune.tune.client import get_pool

    from tune_support import digits, mlp

    counter = tmp_path / "loads.txt"
    task = Task(model=mlp, data=_counted_digits(str(counter)), batch_size=64)  # digits_task's, counted
    trainable = ChorusTrainable.for_task(task, bucket_size=4)
    # One trial at a time, each in a process of its own: only the first loads.
    results = tune.Tuner(
        trainable, param_space=APART,
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", reuse_actors=False, num_samples=3,
                                    search_alg=ChorusSearch(task=trainable, random_state=0, max_concurrent_trials=1)),
        run_config=run_config(tmp_path, ITERATIONS),
    ).fit()
    assert not results.errors and len(results) == 3
    assert all(result.metrics[rk.SOLO] for result in results)
    # On this CPU-only cluster the pool loaded it, as it learnt the task.
    [line] = counter.read_text().splitlines()
    pool_pid = ray.get(get_pool().__ray_call__.remote(lambda pool: __import__("os").getpid()))
    assert line == f"loaded {pool_pid}"
    for result in results:  # the shared copy trains as the member's own load would
        own = Task(model=mlp, data=digits, batch_size=64)
        ref, _ = reference.train(own, dict(result.config), result.metrics[rk.SEED], ITERATIONS)
        assert history(result) == pytest.approx([h["val_loss"] for h in ref], rel=1e-5, abs=1e-6)


def test_a_width_sweeps_data_is_loaded_once_by_the_pool_not_again_to_price_padding(tmp_path):
    # Widths that differ are priced with an input row of the data (docs/design.md D9): the
    # pool's keys and the driver's split report take it from the pool's own load.
    from chorus_tune import Task
    from chorus_tune.tune.client import get_pool

    from models import mlp

    counter = tmp_path / "loads.txt"
    task = Task(model=mlp, data=_counted_digits(str(counter)), batch_size=64)
    trainable = ChorusTrainable.for_task(task, bucket_size=4)
    search = ChorusSearch(task=trainable, random_state=0)
    results = tune.Tuner(
        trainable, param_space={"width": tune.grid_search([16, 32]), "lr": 0.05},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", reuse_actors=True, num_samples=2,
                                    search_alg=search),
        run_config=run_config(tmp_path, 1),
    ).fit()
    assert not results.errors and len(results) == 2
    search.split_report.join(timeout=30)
    pool_pid = ray.get(get_pool().__ray_call__.remote(lambda pool: __import__("os").getpid()))
    assert counter.read_text().splitlines() == [f"loaded {pool_pid}"]


@ray.remote(num_cpus=0)
def _load_in_a_process(task_blob, task_id):
    import ray.cloudpickle as cloudpickle

    from chorus_tune.tune.actors.shared_data import load_task_data
    from chorus_tune.tune.client import get_pool

    task = cloudpickle.loads(task_blob)
    load_task_data(task, task_id, get_pool(create=False))
    train, _ = task.load_data()
    return float(train.tensors[0].sum())


def test_where_the_pool_has_not_loaded_a_tasks_data_the_first_process_offers_it_to_the_next(tmp_path):
    # What a GPU cluster does (the pool loads nothing there): the pool never learnt this task.
    from chorus_tune import Task
    from chorus_tune.tune.client import get_pool

    from tune_support import mlp

    get_pool(create=True)
    counter = tmp_path / "loads.txt"
    blob = ray.cloudpickle.dumps(Task(model=mlp, data=_counted_digits(str(counter)), batch_size=64))
    first = ray.get(_load_in_a_process.remote(blob, "offered-task"))
    second = ray.get(_load_in_a_process.remote(blob, "offered-task"))
    assert first == second and counter.read_text().count("loaded") == 1


# One structure of three trials: they would share a bucket.
TOGETHER = {"lr": tune.grid_search([0.02, 0.05, 0.1]), "momentum": 0.5}


def test_a_structure_measured_to_gain_too_little_trains_solo_as_the_reference_does(tmp_path):
    # No structure gains a thousandfold: the pool's measurement sends all three solo.
    task, results, stats = _sweep(tmp_path, TOGETHER, 3, solo_below=1000.0)
    for result in results:
        frame = result.metrics_dataframe
        assert frame[rk.SOLO].all() and (frame[rk.LIVE] == 1).all()
        ref, _ = reference.train(task, dict(result.config), result.metrics[rk.SEED], ITERATIONS)
        assert history(result) == pytest.approx([h["val_loss"] for h in ref], rel=1e-5, abs=1e-6)
    assert len(stats) == 3 and all(entry["solo"] for entry in stats.values())


def test_a_structure_that_gains_enough_shares_a_bucket(tmp_path):
    task, results, stats = _sweep(tmp_path, TOGETHER, 3, solo_below=1e-6)
    assert not any(result.metrics.get(rk.SOLO) for result in results)
    assert len(stats) == 1 and not next(iter(stats.values()))["solo"]


def test_where_tune_starts_a_process_per_trial_members_sent_solo_for_their_gain_go_back_to_buckets(tmp_path):
    # reuse_actors off: once the run's first 8 trials each came from a process of their
    # own, the members no trial reads yet leave their solo places for a bucket (a solo
    # trial would import torch in every process), and train there exactly as asked.
    space = {"lr": tune.grid_search([0.01 * (i + 1) for i in range(10)]), "momentum": 0.5}
    task, results, _ = _sweep(tmp_path, space, 10, reuse_actors=False, iterations=1, solo_below=1000.0)
    solo = [bool(result.metrics.get(rk.SOLO)) for result in results]
    assert any(solo) and not all(solo)
    for result in results:
        ref, _ = reference.train(task, dict(result.config), result.metrics[rk.SEED], 1)
        assert history(result) == pytest.approx([h["val_loss"] for h in ref], rel=1e-5, abs=1e-6)
