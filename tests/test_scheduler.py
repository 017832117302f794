"""ChorusASHA's Tune plumbing, driven directly (no Ray cluster needed)."""
import pickle
import random

import pytest

from chorus_tune.tune.schedulers.asha import ChorusASHA
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values import run_plan


class _Trial:
    def __init__(self, trial_id):
        self.trial_id = trial_id

    def get_trainable_cls(self):
        return None  # not a ChorusTrainable: nothing is sent to a pool


def _sched(**kw):
    kw = {"metric": "val_loss", "mode": "min", "max_t": 16, "reduction_factor": 4, **kw}
    return ChorusASHA(**kw)


def _add(sched, ids):
    trials = {t: _Trial(t) for t in ids}
    for tr in trials.values():
        sched.on_trial_add(None, tr)
    return trials


def _decided(loss, decision, it=1):
    """A result whose bucket decided its cohort at this rung."""
    return {"training_iteration": it, "val_loss": loss, rk.DECISION: decision, rk.COHORT_SIZE: 8}


def test_it_returns_the_decision_the_bucket_made_for_a_cohort():
    sched = _sched()
    trials = _add(sched, ["a", "b"])
    # Whatever the scores say, the bucket saw the whole cohort: its decision stands.
    assert sched.on_trial_result(None, trials["a"], _decided(9.0, "CONTINUE")) == "CONTINUE"
    assert sched.on_trial_result(None, trials["b"], _decided(0.1, "STOP")) == "STOP"


def test_bucket_decided_scores_are_recorded_so_a_lone_arrival_is_judged_against_them():
    sched = _sched()
    trials = _add(sched, [f"t{i}" for i in range(9)])
    for i in range(8):
        sched.on_trial_result(None, trials[f"t{i}"], _decided(float(i), "CONTINUE" if i < 2 else "STOP"))
    held = {"training_iteration": 1, "val_loss": 5.0, rk.DECISION: rk.HELD, rk.COHORT_SIZE: 1}
    assert sched.on_trial_result(None, trials["t8"], held) == "STOP"  # worse than the 75th percentile


def test_a_member_held_alone_at_a_rung_with_nothing_recorded_continues():
    sched = _sched()
    trials = _add(sched, ["a"])
    held = {"training_iteration": 1, "val_loss": 5.0, rk.DECISION: rk.HELD, rk.COHORT_SIZE: 1}
    assert sched.on_trial_result(None, trials["a"], held) == "CONTINUE"


def test_reaching_max_t_stops():
    sched = _sched()
    trials = _add(sched, ["a"])
    assert sched.on_trial_result(None, trials["a"], {"training_iteration": 16, "val_loss": 0.1}) == "STOP"


def test_result_without_metric_continues():
    sched = _sched()
    trials = _add(sched, ["a"])
    assert sched.on_trial_result(None, trials["a"], {"training_iteration": 1}) == "CONTINUE"


def test_without_a_decision_field_it_decides_like_stock_asha():
    from ray.tune.schedulers import ASHAScheduler

    rng = random.Random(3)
    for _ in range(20):
        stock = ASHAScheduler(metric="m", mode="max", max_t=16, reduction_factor=4)
        ours = ChorusASHA(metric="m", mode="max", max_t=16, reduction_factor=4)
        ids = [f"t{i}" for i in range(12)]
        ts, to = _add(stock, ids), _add(ours, ids)
        alive = set(ids)
        for it in range(1, 17):
            for t in sorted(alive, key=lambda _: rng.random()):
                r = {"training_iteration": it, "m": rng.random()}
                a = stock.on_trial_result(None, ts[t], dict(r))
                assert ours.on_trial_result(None, to[t], dict(r)) == a
                if a == "STOP":
                    alive.discard(t)


def test_its_rungs_are_what_buckets_decide():
    schedule = _sched(max_t=20).rung_schedule()
    assert schedule.rungs == (1, 4, 16) and schedule.max_t == 20
    assert schedule.metric == "val_loss" and schedule.sign == -1.0 and schedule.reduction_factor == 4


@pytest.mark.parametrize("kw", [{"brackets": 2}, {"time_attr": "time_total_s"}, {"stop_last_trials": False}])
def test_buckets_decide_nothing_when_only_tune_can(kw):
    assert _sched(**kw).rung_schedule() is None


def test_setting_its_metric_announces_the_rungs_for_the_run():
    run_plan.clear()
    sched = ChorusASHA(max_t=16, reduction_factor=4)
    sched.set_search_properties("val_accuracy", "max")
    assert run_plan.announced() == sched.rung_schedule()
    assert run_plan.announced().sign == 1.0
    run_plan.clear()


def test_completion_forgets_the_trial():
    sched = _sched()
    trials = _add(sched, ["a"])
    sched.on_trial_complete(None, trials["a"], {"training_iteration": 1, "val_loss": 7.0})
    assert "a" not in sched._trial_info


def test_save_and_restore_keep_what_the_rungs_recorded(tmp_path):
    sched = _sched()
    trials = _add(sched, [f"t{i}" for i in range(9)])
    for i in range(8):
        sched.on_trial_result(None, trials[f"t{i}"], _decided(float(i), "CONTINUE" if i < 2 else "STOP"))
    sched.save(str(tmp_path / "s.pkl"))
    fresh = _sched()
    fresh.restore(str(tmp_path / "s.pkl"))
    held = {"training_iteration": 1, "val_loss": 5.0, rk.DECISION: rk.HELD}
    assert fresh.on_trial_result(None, trials["t8"], held) == "STOP"
    pickle.dumps(fresh)


def test_a_stopper_below_max_t_is_the_buckets_budget():
    sched = _sched(max_t=16)
    sched.set_search_properties(None, None, stop={"training_iteration": 6})
    schedule = sched.rung_schedule()
    assert schedule.max_t == 6 and schedule.rungs == (1, 4)
    run_plan.clear()


class _ChorusTrial(_Trial):
    def get_trainable_cls(self):
        from chorus_tune.tune.trial.trainable import ChorusTrainable

        return ChorusTrainable


def _no_rungs_sched():
    # Two brackets: no rungs a bucket decides, so on_trial_add sends nothing to a pool.
    return ChorusASHA(metric="val_loss", mode="min", max_t=16, reduction_factor=4, brackets=2)


def test_without_a_cohort_seating_search_it_warns_once_what_is_lost(caplog):
    run_plan.clear()
    sched = _no_rungs_sched()
    sched.set_search_properties(None, None)
    with caplog.at_level("WARNING", logger="chorus_tune.tune.schedulers.asha"):
        for t in ("a", "b", "c"):
            sched.on_trial_add(None, _ChorusTrial(t))
    warnings = [r for r in caplog.records if "ChorusSearch" in r.getMessage()]
    assert len(warnings) == 1
    assert "one trial at a time" in warnings[0].getMessage()


def test_with_chorus_search_seating_cohorts_it_does_not_warn(caplog):
    run_plan.clear()
    run_plan.search_seats_cohorts()  # what ChorusSearch.set_search_properties says first
    sched = _no_rungs_sched()
    sched.set_search_properties(None, None)
    with caplog.at_level("WARNING", logger="chorus_tune.tune.schedulers.asha"):
        sched.on_trial_add(None, _ChorusTrial("a"))
    assert not [r for r in caplog.records if "ChorusSearch" in r.getMessage()]


def test_on_a_plain_trainable_it_does_not_warn(caplog):
    run_plan.clear()
    sched = _no_rungs_sched()
    sched.set_search_properties(None, None)
    with caplog.at_level("WARNING", logger="chorus_tune.tune.schedulers.asha"):
        sched.on_trial_add(None, _Trial("a"))
    assert not caplog.records
