"""ChorusASHA's Tune plumbing, driven directly (no Ray cluster needed)."""
import json
import pickle
import random

import pytest

from chorus_tune.tune import schedulers
from chorus_tune.tune.schedulers import COHORT_FIELD, ChorusASHA, parse_cohort


class _Trial:
    def __init__(self, trial_id):
        self.trial_id = trial_id


@pytest.fixture
def retired(monkeypatch):
    calls = []
    monkeypatch.setattr(schedulers, "_retire_fn", calls.append)
    return calls


def _sched(**kw):
    kw = {"metric": "val_loss", "mode": "min", "max_t": 16, "reduction_factor": 4, **kw}
    return ChorusASHA(**kw)


def _results(losses, it=1):
    """One result per member, each carrying the whole cohort."""
    cohort = json.dumps({t: {"iteration": it, "val_loss": v} for t, v in losses.items()})
    return {t: {"training_iteration": it, "val_loss": v, COHORT_FIELD: cohort}
            for t, v in losses.items()}


def _add(sched, ids):
    trials = {t: _Trial(t) for t in ids}
    for tr in trials.values():
        sched.on_trial_add(None, tr)
    return trials


def test_cohort_keeps_the_best_quarter_in_every_arrival_order(retired):
    rng = random.Random(0)
    losses = {f"t{i}": rng.random() for i in range(8)}
    best = set(sorted(losses, key=losses.get)[:2])  # mode=min
    for _ in range(50):
        sched = _sched()
        trials = _add(sched, losses)
        results = _results(losses)
        order = list(losses)
        rng.shuffle(order)
        kept = {t for t in order
                if sched.on_trial_result(None, trials[t], results[t]) == "CONTINUE"}
        assert kept == best


def test_mode_max_keeps_the_highest(retired):
    acc = {f"t{i}": float(i) for i in range(8)}
    sched = _sched(metric="acc", mode="max")
    trials = _add(sched, acc)
    cohort = json.dumps({t: {"iteration": 1, "acc": v} for t, v in acc.items()})
    kept = {t for t in acc if sched.on_trial_result(
        None, trials[t], {"training_iteration": 1, "acc": acc[t], COHORT_FIELD: cohort}
    ) == "CONTINUE"}
    assert kept == {"t6", "t7"}


def test_stop_retires_every_losing_member_at_the_first_arrival(retired):
    losses = {f"t{i}": float(i) for i in range(8)}
    sched = _sched()
    trials = _add(sched, losses)
    sched.on_trial_result(None, trials["t5"], _results(losses)["t5"])
    assert sorted(retired) == ["t2", "t3", "t4", "t5", "t6", "t7"]


def test_reaching_max_t_stops_and_retires(retired):
    sched = _sched(max_t=4)
    trials = _add(sched, ["a"])
    action = sched.on_trial_result(None, trials["a"], {"training_iteration": 4, "val_loss": 0.1})
    assert action == "STOP" and retired == ["a"]


def test_result_without_metric_continues(retired):
    sched = _sched()
    trials = _add(sched, ["a"])
    assert sched.on_trial_result(None, trials["a"], {"training_iteration": 1}) == "CONTINUE"


def test_without_cohort_field_it_decides_like_stock_asha(retired):
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


def test_cohort_members_in_another_bracket_are_left_out(retired):
    losses = {f"t{i}": float(i) for i in range(8)}
    sched = _sched(brackets=2)
    trials = _add(sched, losses)
    b0, b1 = sched._brackets
    for i, t in enumerate(losses):  # force: t0..t3 in bracket 0, t4..t7 in bracket 1
        sched._trial_info[t] = b0 if i < 4 else b1
    results = _results(losses, it=4)  # both brackets have a rung at 4
    kept = {t for t in losses
            if sched.on_trial_result(None, trials[t], results[t]) == "CONTINUE"}
    assert kept == {"t0", "t4"}  # one of four kept in each bracket


def test_completion_forgets_an_undelivered_decision(retired):
    losses = {f"t{i}": float(i) for i in range(8)}
    sched = _sched()
    trials = _add(sched, losses)
    sched.on_trial_result(None, trials["t0"], _results(losses)["t0"])
    sched.on_trial_complete(None, trials["t7"], {"training_iteration": 1, "val_loss": 7.0})
    assert "t7" not in sched._brackets[0]._pending
    assert "t7" not in sched._trial_info


def test_save_and_restore_keep_pending_cohort_decisions(retired, tmp_path):
    losses = {f"t{i}": float(i) for i in range(8)}
    sched = _sched()
    trials = _add(sched, losses)
    results = _results(losses)
    sched.on_trial_result(None, trials["t3"], results["t3"])
    sched.save(str(tmp_path / "s.pkl"))
    fresh = _sched()
    fresh.restore(str(tmp_path / "s.pkl"))
    assert fresh.on_trial_result(None, trials["t1"], results["t1"]) == "CONTINUE"
    assert fresh.on_trial_result(None, trials["t6"], results["t6"]) == "STOP"
    pickle.dumps(fresh)


def test_parse_cohort_reads_json_and_signs_scores():
    raw = json.dumps({"a": {"iteration": 2, "val_loss": 0.5}, "b": {"iteration": 2}})
    assert parse_cohort(raw, "training_iteration", "val_loss", -1.0) == {"a": (2.0, -0.5)}


def test_parse_cohort_needs_the_time_attr_unless_it_is_the_iteration():
    raw = json.dumps({"a": {"iteration": 2, "val_loss": 0.5}})
    assert parse_cohort(raw, "time_total_s", "val_loss", 1.0) == {}
    assert parse_cohort("not json", "training_iteration", "val_loss", 1.0) is None
