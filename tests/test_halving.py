"""The cohort successive-halving rule (chorus_tune.tune.rules.halving), without Ray."""
import math
import random

import pytest

from chorus_tune.tune.rules.halving import (
    CONTINUE,
    STOP,
    CohortBracket,
    rung_milestones,
    select_survivors,
    successive_halving,
    survivors_count,
)


def _cohort(scores, t):
    return {tid: (t, s) for tid, s in scores.items()}


def _run_cohort(bracket, scores, t, order):
    """Feed one cohort's results in `order`; every result carries the whole cohort."""
    cohort = _cohort(scores, t)
    return {tid: bracket.on_result(tid, t, scores[tid], cohort) for tid in order}


@pytest.mark.parametrize(
    "n, rf, expected",
    [(0, 4, 0), (1, 4, 1), (3, 4, 1), (4, 4, 1), (5, 4, 1), (7, 4, 1), (8, 4, 2),
     (15, 4, 3), (16, 4, 4), (64, 4, 16), (7, 2, 3), (9, 3, 3), (10, 3, 3), (5, 2.5, 2)],
)
def test_survivors_count_is_floor_with_at_least_one(n, rf, expected):
    assert survivors_count(n, rf) == expected


def test_select_survivors_breaks_ties_by_trial_id():
    scores = {"d": 1.0, "b": 1.0, "a": 0.5, "c": 1.0}
    assert select_survivors(scores, 2) == ["b", "c"]


def test_select_survivors_ranks_nan_last():
    scores = {"a": math.nan, "b": -5.0, "c": math.nan, "d": -9.0}
    assert select_survivors(scores, 2) == ["b", "d"]


def test_rungs_are_placed_like_ray_bracket():
    # _Bracket(1, 16, 4, 0) -> rungs 16, 4, 1 (descending); s shifts them up.
    assert rung_milestones(1, 16, 4) == [16, 4, 1]
    assert rung_milestones(1, 16, 4, s=1) == [16, 4]
    assert rung_milestones(2, 100, 3) == [54, 18, 6, 2]


def test_cohort_of_8_keeps_top_2_for_every_arrival_order():
    rng = random.Random(0)
    scores = {f"t{i}": rng.random() for i in range(8)}
    best = set(sorted(scores, key=scores.get)[-2:])
    for _ in range(200):
        order = list(scores)
        rng.shuffle(order)
        decisions = _run_cohort(CohortBracket(1, 16, 4), scores, 1, order)
        assert {t for t, a in decisions.items() if a == CONTINUE} == best


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 9, 12, 16, 17, 31, 64])
@pytest.mark.parametrize("rf", [2, 3, 4])
def test_cohorts_of_any_size_keep_what_successive_halving_keeps(n, rf):
    rng = random.Random(n * 10 + rf)
    for _ in range(20):
        scores = {f"t{i:02d}": rng.random() for i in range(n)}
        order = list(scores)
        rng.shuffle(order)
        decisions = _run_cohort(CohortBracket(1, 64, rf), scores, 1, order)
        kept = {t for t, a in decisions.items() if a == CONTINUE}
        assert kept == set(select_survivors(scores, rf))
        assert len(kept) == survivors_count(n, rf)


def test_cohort_through_every_rung_matches_synchronous_halving():
    rng = random.Random(1)
    ids = [f"t{i:02d}" for i in range(16)]
    milestones = [1, 4, 16]
    scores = {m: {t: rng.random() for t in ids} for m in milestones}
    expected = successive_halving(scores, milestones, 4, ids)
    for _ in range(50):
        bracket = CohortBracket(1, 64, 4)  # rung at 64 never reached: 16 is a rung
        alive = list(ids)
        for m in milestones:
            assert sorted(alive) == sorted(expected[m])
            order = list(alive)
            rng.shuffle(order)
            decisions = _run_cohort(bracket, {t: scores[m][t] for t in alive}, m, order)
            alive = [t for t in alive if decisions[t] == CONTINUE]
        assert len(alive) == 1


def test_iterations_between_rungs_continue_without_recording():
    bracket = CohortBracket(1, 16, 4)
    _run_cohort(bracket, {"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.2}, 1, "abcd")
    assert bracket.on_result("a", 2, -100.0, _cohort({"a": -100.0}, 2)) == CONTINUE
    assert bracket.on_result("a", 3, -100.0) == CONTINUE
    assert all("a" not in rec or m == 1 for m, rec in bracket._rungs)


def test_first_arrival_returns_every_members_decision():
    bracket = CohortBracket(1, 16, 4)
    scores = {f"t{i}": float(i) for i in range(8)}
    out = bracket.decide("t0", 1, 0.0, _cohort(scores, 1))
    assert out == {t: (CONTINUE if t in ("t6", "t7") else STOP) for t in scores}


def test_cohort_decision_is_kept_even_if_a_later_result_differs():
    # The cohort is recorded once, at its first arrival; a member's own result
    # for that iteration cannot re-open the decision.
    bracket = CohortBracket(1, 16, 4)
    scores = {f"t{i}": float(i) for i in range(8)}
    bracket.on_result("t7", 1, 7.0, _cohort(scores, 1))
    assert bracket.on_result("t0", 1, 1000.0, _cohort(scores, 1)) == STOP


def test_two_cohorts_interleaved_are_each_halved_on_their_own():
    rng = random.Random(2)
    a = {f"a{i}": rng.random() for i in range(8)}          # all worse ...
    b = {f"b{i}": 10 + rng.random() for i in range(8)}     # ... than every b
    for _ in range(100):
        bracket = CohortBracket(1, 16, 4)
        arrivals = [(t, a) for t in a] + [(t, b) for t in b]
        rng.shuffle(arrivals)
        kept = set()
        for tid, group in arrivals:
            if bracket.on_result(tid, 1, group[tid], _cohort(group, 1)) == CONTINUE:
                kept.add(tid)
        assert kept == set(select_survivors(a, 4)) | set(select_survivors(b, 4))


def test_lone_trials_follow_plain_asha():
    bracket = CohortBracket(1, 16, 4)
    assert bracket.on_result("a", 1, 1.0) == CONTINUE   # nothing recorded yet
    assert bracket.on_result("b", 1, 2.0) == CONTINUE   # cutoff 1.75
    assert bracket.on_result("c", 1, 1.5) == STOP       # cutoff 1.75
    assert bracket.on_result("d", 1, 1.8) == CONTINUE   # cutoff 1.75 of [1, 2, 1.5]


def test_lone_trial_is_judged_against_a_recorded_cohort():
    bracket = CohortBracket(1, 16, 4)
    _run_cohort(bracket, {f"t{i}": float(i) for i in range(8)}, 1, [f"t{i}" for i in range(8)])
    # 75th percentile of 0..7 is 5.25
    assert bracket.on_result("late1", 1, 5.0) == STOP
    assert bracket.on_result("late2", 1, 6.0) == CONTINUE


def test_a_cohort_of_one_at_a_rung_is_a_lone_trial():
    bracket = CohortBracket(1, 16, 4)
    bracket.on_result("x", 1, 10.0)
    bracket.on_result("y", 1, 11.0)
    # the cohort holds only "z" at rung 1: plain ASHA applies, and z is worse.
    assert bracket.on_result("z", 1, 0.0, _cohort({"z": 0.0}, 1)) == STOP


def test_nan_lone_trial_stops_when_there_is_a_record():
    bracket = CohortBracket(1, 16, 4)
    assert bracket.on_result("a", 1, math.nan) == CONTINUE
    assert bracket.on_result("b", 1, 1.0) == CONTINUE
    assert bracket.on_result("c", 1, math.nan) == STOP


def test_refilled_members_form_their_own_cohort():
    # A bucket holds 4 survivors at iteration 4 and 4 newcomers at iteration 1.
    bracket = CohortBracket(1, 16, 4)
    old = {f"o{i}": float(i) for i in range(16)}
    _run_cohort(bracket, old, 1, list(old))
    survivors = {t: s for t, s in old.items() if t in {"o12", "o13", "o14", "o15"}}
    new = {f"n{i}": float(i) for i in range(4)}
    cohort = {**_cohort({t: 100 - s for t, s in survivors.items()}, 4), **_cohort(new, 1)}
    # an old member arrives first: only the four at iteration 4 are halved (keep 1)
    out4 = bracket.decide("o13", 4, 100 - 13.0, cohort)
    assert set(out4) == set(survivors)
    assert [t for t, a in out4.items() if a == CONTINUE] == ["o12"]
    # then a newcomer: the four at iteration 1 are halved among themselves (keep 1)
    out1 = bracket.decide("n0", 1, 0.0, cohort)
    assert set(out1) == set(new)
    assert [t for t, a in out1.items() if a == CONTINUE] == ["n3"]


def test_member_missing_from_cohort_field_is_judged_alone():
    bracket = CohortBracket(1, 16, 4)
    scores = {f"t{i}": float(i) for i in range(4)}
    _run_cohort(bracket, scores, 1, list(scores))
    # "extra" was not in the cohort: ASHA against [0, 1, 2, 3] (cutoff 2.25)
    assert bracket.on_result("extra", 1, 2.0, _cohort(scores, 1)) == STOP


def test_forget_drops_a_pending_decision():
    bracket = CohortBracket(1, 16, 4)
    scores = {f"t{i}": float(i) for i in range(8)}
    bracket.on_result("t7", 1, 7.0, _cohort(scores, 1))
    bracket.forget("t0")
    assert "t0" not in bracket._pending and "t1" in bracket._pending


def test_stop_last_trials_false_lets_recorded_trials_continue():
    bracket = CohortBracket(1, 4, 4, stop_last_trials=False)
    bracket.on_result("a", 1, 5.0)
    bracket.on_result("b", 1, 6.0)
    assert bracket.on_result("a", 7, -1.0) == CONTINUE
