"""ChorusSearch inside real Tune runs: an inner OptunaSearch, a stock scheduler, Tuner.restore."""
import os
import sys

import pytest
import ray
import ray.cloudpickle
from ray import tune
from ray.tune import Callback
from ray.tune.schedulers import ASHAScheduler

from chorus_tune.tune.search.search import ChorusSearch

# Workers cannot import this test module: ship its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.usefixtures("local_ray")




# The function trainable's trials reuse their actors (reuse_actors=True): what
# these tests check is the search's bookkeeping, and a fresh trial actor costs
# about 2 CPU-s of imports on this 2-core machine (16 of them took 38 CPU-s).
def _quadratic(config):
    for i in range(1, 4):
        tune.report({"score": -((config["x"] - 0.3) ** 2) * i})


def _run_config(tmp_path, **kw):
    return tune.RunConfig(storage_path=str(tmp_path), verbose=0, **kw)


def test_inner_optuna_search_is_told_every_trial_under_its_own_ids(tmp_path):
    optuna = pytest.importorskip("optuna")
    from ray.tune.search.optuna import OptunaSearch

    search = ChorusSearch(OptunaSearch(seed=0), bucket_size=4, max_buckets=1)
    tuner = tune.Tuner(
        _quadratic,
        param_space={"x": tune.uniform(0, 1)},
        tune_config=tune.TuneConfig(metric="score", mode="max", num_samples=8, reuse_actors=True,
                                    search_alg=search, scheduler=ASHAScheduler(max_t=3)),
        run_config=_run_config(tmp_path),
    )
    results = tuner.fit()
    assert len(results) == 8 and not results.errors
    study = search.searcher._ot_study
    finished = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(finished) == 8
    # Optuna's record of each trial is the Tune trial's last score, for its own x.
    by_x = {round(r.config["x"], 12): r.metrics["score"] for r in results}
    assert {round(t.params["x"], 12): t.value for t in finished} == pytest.approx(by_x)


class _StopAfter(Callback):
    """Interrupts the experiment once, when `n` trials have completed.

    The marker file keeps the restored run (which gets this callback back
    from the experiment state) from being interrupted again.
    """

    def __init__(self, n, marker):
        self.n, self.marker = n, marker

    def on_step_begin(self, iteration, trials, **info):
        if os.path.exists(self.marker):
            return
        if sum(t.status == "TERMINATED" for t in trials) >= self.n:
            open(self.marker, "w").close()
            raise RuntimeError("interrupted on purpose")


def test_tuner_restore_resumes_the_search_without_repeating_or_losing_configs(tmp_path):
    grid = [round(0.1 * i, 1) for i in range(8)]
    tuner = tune.Tuner(
        _quadratic,
        param_space={"x": tune.grid_search(grid)},
        tune_config=tune.TuneConfig(metric="score", mode="max", num_samples=8, reuse_actors=True,
                                    search_alg=ChorusSearch(bucket_size=2, max_buckets=1)),
        run_config=_run_config(tmp_path, name="exp", callbacks=[_StopAfter(3, str(tmp_path / "interrupted"))]),
    )
    with pytest.raises(RuntimeError, match="interrupted on purpose"):
        tuner.fit()
    path = str(tmp_path / "exp")
    restored = tune.Tuner.restore(path, trainable=_quadratic, resume_errored=True)
    results = restored.fit()
    assert sorted(r.config["x"] for r in results) == grid
    assert not results.errors


def test_tuner_restore_reseats_members_and_every_trial_follows_its_reference(tmp_path):
    from chorus_tune import reference
    from chorus_tune.tune import ChorusTrainable

    from tune_support import digits_task

    task = digits_task()
    trainable = ChorusTrainable.for_task(task, bucket_size=4, max_buckets=1)
    lrs = [0.02, 0.05, 0.1, 0.15, 0.2, 0.3]
    tuner = tune.Tuner(
        trainable, param_space={"lr": tune.grid_search(lrs)},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=len(lrs), reuse_actors=True,
                                    search_alg=ChorusSearch(task=trainable, max_concurrent_trials=2,
                                                            max_iterations=3, lookahead=2)),
        run_config=_run_config(tmp_path, name="exp", stop={"training_iteration": 3},
                               callbacks=[_StopAfter(2, str(tmp_path / "interrupted"))]),
    )
    with pytest.raises(RuntimeError, match="interrupted on purpose"):
        tuner.fit()
    results = tune.Tuner.restore(str(tmp_path / "exp"), trainable=trainable, resume_errored=True).fit()
    assert sorted(r.config["lr"] for r in results) == lrs and not results.errors
    for r in results:
        expected, _ = reference.train(task, {"lr": r.config["lr"]}, seed=r.metrics["chorus/seed"], iterations=3)
        # A trial run again by the restore starts over (a member of its own, or
        # its seat again): its last run's rows are the last three.
        frame = r.metrics_dataframe
        rows = frame.iloc[-3:]
        assert rows["iteration"].tolist() == [1, 2, 3], frame.to_string()
        assert (rows["chorus/member"] == r.metrics["chorus/member"]).all()
        assert rows["val_loss"].tolist() == pytest.approx([h["val_loss"] for h in expected], rel=1e-5)


def _seat_one(pool, trainable, member, lr):
    # The tests that seat one member by hand look at the bucket it trains in:
    # their trainables say solo=False (seated alone, it would train in its
    # trial's own process: chorus_tune.tune.rules.solo).
    from chorus_tune.tune.values.plan import Plan

    args = ([(member, {"lr": lr}, 7)], trainable._task_id, trainable._task_blob, trainable.bucket_options(), Plan())
    return ray.get(pool.seat.remote(*args))[member]


def _stats_once_closed(pool, name: str, timeout_s: float) -> dict:
    """The pool's stats once bucket ``name`` has closed, or after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get(pool.stats.remote())
        if stats[name]["closed"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_seating_again_keeps_a_member_a_trial_already_reads():
    # A restore in the same driver seats ChorusSearch's members again; a
    # restarted trial may already read one of them by then. The re-seat must
    # not pull that member from under it.
    from chorus_tune.tune import ChorusTrainable
    from chorus_tune.tune.client import get_pool
    from chorus_tune.tune.values.options import Join

    from tune_support import digits_task

    trainable = ChorusTrainable.for_task(digits_task(), bucket_size=2, max_buckets=1, solo=False)
    pool = get_pool(create=True)
    # "queued" while an earlier test's bucket still has members (an idle one gives its budget up).
    assert _seat_one(pool, trainable, "m-kept", 0.1) in ("seated", "queued")
    assert ray.get(pool.bind.remote("trial-kept", ["m-kept"])) == "m-kept"
    reservation = ray.get(pool.reserve.remote("trial-kept", trainable._task_id, None, {"lr": 0.1},
                                              trainable.bucket_options()))
    name, bucket = ray.get(pool.await_placement.remote(reservation.member), timeout=60)
    first = ray.get(bucket.next_result.remote("m-kept", Join(config={"lr": 0.1}, seed=7)), timeout=60)

    assert _seat_one(pool, trainable, "m-kept", 0.1) == "seated"
    assert ray.get(pool.bind.remote("trial-kept", ["m-kept"])) == "m-kept"
    second = ray.get(bucket.next_result.remote("m-kept"), timeout=60)
    assert (first["iteration"], second["iteration"]) == (1, 2)
    assert ray.get(pool.bucket_of.remote("trial-kept"))[0] == name
    ray.get(pool.trial_left.remote("trial-kept"))


def test_a_member_that_left_is_seated_again_afresh():
    from chorus_tune.tune import ChorusTrainable
    from chorus_tune.tune.client import get_pool
    from chorus_tune.tune.values.options import Join

    from tune_support import digits_task

    trainable = ChorusTrainable.for_task(digits_task(), bucket_size=2, max_buckets=1, solo=False)
    pool = get_pool(create=True)
    assert _seat_one(pool, trainable, "m-fresh", 0.1) in ("seated", "queued")
    name, bucket = ray.get(pool.await_placement.remote("m-fresh"), timeout=60)
    ray.get(bucket.next_result.remote("m-fresh", Join(config={"lr": 0.1}, seed=7)), timeout=60)
    ray.get(pool.leave.remote("m-fresh"))

    assert _seat_one(pool, trainable, "m-fresh", 0.1) in ("seated", "queued")
    name, bucket = ray.get(pool.await_placement.remote("m-fresh"), timeout=60)
    assert ray.get(bucket.next_result.remote("m-fresh"), timeout=60)["iteration"] == 1
    ray.get(pool.leave.remote("m-fresh"))


def _finite_only(outputs, targets) -> float:
    import torch

    if not torch.isfinite(outputs).all():
        raise ValueError("non-finite outputs")
    return 1.0


def test_a_seated_member_that_fails_before_its_trial_asks_gives_the_trial_its_own_error():
    # ChorusSearch seats members ahead of their trials: in a bucket that is
    # already running, one whose task metric raises fails in its first
    # iteration, before Tune may have started its trial. That trial, asking
    # the pool later, must fail with the member's own error (as one that asked
    # first does), not with one that says nothing of it.
    import time

    from chorus_tune.tune import ChorusTrainable
    from chorus_tune.tune.client import get_pool

    from tune_support import digits_task

    trainable = ChorusTrainable.for_task(digits_task(metrics={"strict": _finite_only}), bucket_size=2,
                                         max_buckets=1, solo=False)
    pool = get_pool(create=True)
    assert _seat_one(pool, trainable, "m-diverges", 1e12) in ("seated", "queued")  # diverges at once
    name, _ = ray.get(pool.await_placement.remote("m-diverges"), timeout=60)  # it has a bucket
    deadline = time.monotonic() + 60
    while "m-diverges" in ray.get(pool.stats.remote())[name]["members"]:  # until its bucket frees its slot
        assert time.monotonic() < deadline, "the member never failed"
        time.sleep(0.2)
    with pytest.raises(Exception, match="metric 'strict' raised ValueError: non-finite outputs"):
        ray.get(pool.await_placement.remote("m-diverges"), timeout=60)
    ray.get(pool.leave.remote("m-diverges"))


def test_a_member_that_leaves_while_its_new_bucket_starts_is_not_trained_there():
    # A new bucket's actor takes seconds to start (it imports torch); a leave
    # in that window found no home to tell, and the bucket then trained the
    # member, unread, for good, and never closed: it held the bucket budget.

    from chorus_tune.tune import ChorusTrainable
    from chorus_tune.tune.client import get_pool

    from tune_support import digits_task

    trainable = ChorusTrainable.for_task(digits_task(), bucket_size=2, max_buckets=8, idle_close_s=0.5,
                                         solo=False)
    pool = get_pool(create=True)
    assert _seat_one(pool, trainable, "m-left-early", 0.1) == "seated"  # placed in a bucket now starting
    ray.get(pool.leave.remote("m-left-early"))
    stats = ray.get(pool.stats.remote())
    (name,) = [n for n, s in stats.items() if "m-left-early" in s["trials"]]
    closed = _stats_once_closed(pool, name, 60)[name]["closed"]
    assert closed, f"bucket {name} still open: it trains the member that left"


def test_close_idle_buckets_closes_the_idle_ones_now_and_leaves_the_busy_ones():

    from chorus_tune.tune import ChorusTrainable, close_idle_buckets
    from chorus_tune.tune.client import get_pool

    from tune_support import digits_task

    # idle_close_s=300: an idle bucket that closes within the test was closed by the call.
    idle = ChorusTrainable.for_task(digits_task(), bucket_size=2, max_buckets=8, idle_close_s=300.0,
                                    solo=False)
    busy = ChorusTrainable.for_task(digits_task(), bucket_size=3, max_buckets=8, idle_close_s=300.0,
                                    solo=False)
    pool = get_pool(create=True)
    _seat_one(pool, idle, "m-idle", 0.1)
    _seat_one(pool, busy, "m-busy", 0.1)
    idle_name, _ = ray.get(pool.await_placement.remote("m-idle"), timeout=60)
    busy_name, _ = ray.get(pool.await_placement.remote("m-busy"), timeout=60)
    ray.get(pool.leave.remote("m-idle"))
    try:
        closed = close_idle_buckets()
        assert idle_name in closed and busy_name not in closed
        stats = _stats_once_closed(pool, idle_name, 30)
        assert stats[idle_name]["closed"] and not stats[busy_name]["closed"]
    finally:
        ray.get(pool.leave.remote("m-busy"))


@ray.remote(num_cpus=0)
class _TrialActor:
    """Stands in for a trial actor that dies before its first result."""


def test_a_seated_member_whose_trial_actor_dies_before_reading_is_reaped():
    import time

    from chorus_tune.tune import ChorusTrainable
    from chorus_tune.tune.client import get_pool

    from tune_support import digits_task

    trainable = ChorusTrainable.for_task(digits_task(), bucket_size=2, max_buckets=1, reap_interval_s=0.2,
                                         solo=False)
    pool = get_pool(create=True)
    _seat_one(pool, trainable, "m-orphan", 0.1)
    ray.get(pool.await_placement.remote("m-orphan"), timeout=60)
    ray.get(pool.bind.remote("trial-orphan", ["m-orphan"]))
    actor = _TrialActor.remote()
    ray.get(actor.__ray_ready__.remote())
    ray.get(pool.reserve.remote("trial-orphan", trainable._task_id, None, {"lr": 0.1},
                                trainable.bucket_options(), actor._actor_id.hex()))
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while ray.get(pool.bucket_of.remote("m-orphan")) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.get(pool.bucket_of.remote("m-orphan")) is None
    assert any("m-orphan" in s["reaped"] for s in ray.get(pool.stats.remote()).values())


class _EndRunAfter(tune.Stopper):
    """Ends the whole run after its first ``n`` results, as ``time_budget_s`` or a stopper's ``stop_all`` does."""

    def __init__(self, n: int):
        self.n, self.seen = n, 0

    def __call__(self, trial_id, result):
        self.seen += 1
        return False

    def stop_all(self):
        return self.seen >= self.n


def test_a_run_that_ended_early_leaves_no_unread_member_holding_the_next_run_s_budget(tmp_path):
    # Tune tells a searcher nothing when a run ends early: the members
    # ChorusSearch seated ahead of its trials stayed, trained unread, and their
    # bucket never drained. At max_buckets=1 (one GPU) the next run in this
    # driver waited for that bucket's budget for good.
    from chorus_tune.tune import ChorusTrainable
    from chorus_tune.tune.actors.pool_seating import UNREAD_AT_NEW_RUN
    from chorus_tune.tune.client import get_pool

    from tune_support import digits_task

    first = ChorusTrainable.for_task(digits_task(), bucket_size=4, max_buckets=1)
    ended = tune.Tuner(
        first, param_space={"lr": tune.uniform(0.02, 0.3)},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=12,
                                    search_alg=ChorusSearch(task=first, max_concurrent_trials=2)),
        run_config=_run_config(tmp_path, name="ended", stop=_EndRunAfter(2))).fit()
    assert len(ended) < 12
    pool = get_pool(create=False)
    # A trial the early end caught before its first result read nothing.
    read = {r.metrics["chorus/member"] for r in ended if "chorus/member" in r.metrics}
    unread = {n: set(s["members"]) - read for n, s in ray.get(pool.stats.remote()).items()}
    unread = {n: members for n, members in unread.items() if members}
    assert unread, "the early end left no unread member seated: this test tests nothing"

    # Another structure (width 48): it needs the budget the first run's bucket holds.
    second = ChorusTrainable.for_task(digits_task(), bucket_size=2, max_buckets=1)
    results = tune.Tuner(
        second, param_space={"lr": tune.grid_search([0.05, 0.1]), "width": 48},
        # time_budget_s: with the unread members kept, its trials never get a
        # bucket, and the run ends at the budget with neither at iteration 2.
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=2, time_budget_s=90,
                                    search_alg=ChorusSearch(task=second, max_concurrent_trials=2)),
        run_config=_run_config(tmp_path, name="next", stop={"training_iteration": 2})).fit()
    assert not results.errors
    assert sorted(r.metrics.get("training_iteration", 0) for r in results) == [2, 2]
    stats = ray.get(pool.stats.remote())
    for name, members in unread.items():
        assert members <= set(stats[name].get(UNREAD_AT_NEW_RUN, [])), stats[name]


class _Starts(Callback):
    def __init__(self):
        self.started = []

    def on_trial_start(self, iteration, trials, trial, **info):
        self.started.append(trial.trial_id)


def test_a_grid_under_the_default_num_samples_is_refused_before_any_trial_starts(tmp_path):
    # Tune's default search would run all 16 points; with a Searcher Tune
    # creates num_samples (default 1) trials in all, so 15 would be lost.
    from chorus_tune.tune import ChorusTrainable

    from tune_support import digits_task

    trainable = ChorusTrainable.for_task(digits_task(), bucket_size=4)
    starts = _Starts()
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search([0.01, 0.03, 0.1, 0.3]),
                     "momentum": tune.grid_search([0.0, 0.5, 0.8, 0.9])},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", search_alg=ChorusSearch(task=trainable)),
        run_config=_run_config(tmp_path, name="grid", stop={"training_iteration": 1}, callbacks=[starts]),
    )
    with pytest.raises(ValueError, match=r"grid of 16 points, but num_samples=1.*num_samples=16") as raised:
        tuner.fit()
    assert starts.started == [], raised.value
