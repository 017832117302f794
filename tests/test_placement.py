"""Which bucket a member goes to (Ray-free: the pool actor is an adapter over Placement)."""
from __future__ import annotations

import pytest

from chorus_tune.tune.rules.placement import Placement


def test_a_bucket_fills_to_capacity_before_another_of_its_key_opens():
    p = Placement(max_buckets=4)
    placed = [p.request(f"t{i}", "k", 3) for i in range(5)]
    assert [x.bucket for x in placed] == ["chorus-bucket-1"] * 3 + ["chorus-bucket-2"] * 2
    assert [x.opened for x in placed] == [True, False, False, True, False]


def test_different_keys_never_share_a_bucket():
    p = Placement()
    a, b = p.request("t1", "k1", 4), p.request("t2", "k2", 4)
    assert a.bucket != b.bucket and p.free_slots("k1") == 3


def test_freed_slot_is_refilled_by_the_same_key():
    p = Placement(max_buckets=1)
    p.request("t1", "k", 2)
    p.request("t2", "k", 2)
    assert p.request("t3", "k", 2) is None and p.is_waiting("t3")
    update = p.remove("t1")
    assert [(x.trial_id, x.bucket) for x in update.placed] == [("t3", "chorus-bucket-1")]


def test_over_budget_trial_waits_then_takes_the_budget_of_an_emptied_bucket():
    p = Placement(max_buckets=1)
    p.request("t1", "k1", 2)
    assert p.request("t2", "k2", 2) is None
    update = p.remove("t1")
    assert update.closed == ["chorus-bucket-1"]
    assert [(x.trial_id, x.opened) for x in update.placed] == [("t2", True)]


def test_a_request_over_budget_takes_the_budget_of_an_idle_bucket_of_another_key_at_once():
    p = Placement(max_buckets=1)
    p.request("t1", "k1", 2)
    p.remove("t1")  # idle: open for a member of k1, nobody waiting
    placed = p.request("t2", "k2", 2)
    assert (placed.bucket, placed.opened, placed.replaces) == ("chorus-bucket-2", True, ("chorus-bucket-1",))
    assert list(p.buckets) == ["chorus-bucket-2"] and not p.is_waiting("t2")


def test_a_request_under_a_budget_that_shrank_takes_as_many_idle_buckets_as_it_needs_at_once():
    # A run at max_buckets=1 after one that left two empty buckets open.
    p = Placement(max_buckets=2)
    p.request("t1", "k1", 2)
    p.request("t2", "k2", 2)
    p.remove("t1")
    p.remove("t2")
    p.max_buckets = 1
    placed = p.request("t3", "k3", 2)
    assert placed.replaces == ("chorus-bucket-1", "chorus-bucket-2") and placed.opened
    assert list(p.buckets) == ["chorus-bucket-3"] and not p.is_waiting("t3")


def test_a_request_under_a_budget_that_shrank_waits_while_too_few_buckets_are_idle():
    p = Placement(max_buckets=2)
    p.request("t1", "k1", 2)
    p.request("t2", "k2", 2)
    p.remove("t1")
    p.max_buckets = 1
    assert p.request("t3", "k3", 2) is None and p.is_waiting("t3")
    assert list(p.buckets) == ["chorus-bucket-1", "chorus-bucket-2"]  # nothing closed for nothing
    update = p.remove("t2")
    assert update.closed == ["chorus-bucket-1", "chorus-bucket-2"]
    assert [(x.trial_id, x.bucket, x.opened) for x in update.placed] == [("t3", "chorus-bucket-3", True)]


def test_a_request_over_budget_waits_while_every_bucket_has_members():
    p = Placement(max_buckets=1)
    p.request("t1", "k1", 2)
    assert p.request("t2", "k2", 2) is None and p.is_waiting("t2")
    assert list(p.buckets) == ["chorus-bucket-1"]


def test_a_request_within_budget_opens_a_bucket_and_leaves_the_idle_one_open():
    p = Placement(max_buckets=2)
    p.request("t1", "k1", 2)
    p.remove("t1")
    placed = p.request("t2", "k2", 2)
    assert placed.replaces == () and list(p.buckets) == ["chorus-bucket-1", "chorus-bucket-2"]


def test_empty_bucket_with_no_one_waiting_stays_open_as_idle():
    p = Placement()
    p.request("t1", "k", 2)
    update = p.remove("t1")
    assert update.idle == ["chorus-bucket-1"] and not update.closed


def test_remove_is_idempotent_and_safe_for_unknown_trials():
    p = Placement()
    assert p.remove("nobody").placed == []
    p.request("t1", "k", 2)
    p.remove("t1")
    assert p.remove("t1").placed == [] and p.bucket_of("t1") is None


def test_closing_a_dead_bucket_returns_its_trials_and_places_waiters():
    p = Placement(max_buckets=1)
    p.request("t1", "k", 1)
    p.request("t2", "k", 1)
    members, update = p.close("chorus-bucket-1")
    assert members == ["t1"] and p.bucket_of("t1") is None
    assert [(x.trial_id, x.bucket, x.opened) for x in update.placed] == [("t2", "chorus-bucket-2", True)]


# ----- members moving between buckets of one key (regrouping) ------------------------------------------
def _two_buckets() -> Placement:
    p = Placement(max_buckets=3)
    for i in range(3):
        p.request(f"t{i}", "k", 2)  # bucket-1: t0, t1; bucket-2: t2
    return p


def test_buckets_in_a_move_offer_no_slot_and_their_key_opens_no_other_bucket_meanwhile():
    p = _two_buckets()
    assert p.begin_move("chorus-bucket-2", "chorus-bucket-1") == (["t2"], ["t0", "t1"])
    assert p.request("t3", "k", 2) is None and p.is_waiting("t3")
    assert p.begin_compaction("chorus-bucket-1") is None  # nor compacts


def test_a_move_hands_the_members_to_the_other_bucket_and_the_emptied_one_is_idle():
    p = Placement(max_buckets=3)
    p.request("t0", "k", 3)
    p.request("t1", "k", 3)
    p.request("t2", "k", 3)
    p.request("t3", "k", 3)  # bucket-2
    p.remove("t1")
    p.begin_move("chorus-bucket-2", "chorus-bucket-1")
    p.move(["t3"], "chorus-bucket-2", "chorus-bucket-1")
    update = p.end_move("chorus-bucket-2", "chorus-bucket-1")
    assert p.bucket_of("t3") == "chorus-bucket-1" and "t3" in p.buckets["chorus-bucket-1"].ever
    assert p.buckets["chorus-bucket-1"].members == ["t0", "t2", "t3"]
    assert update.idle == ["chorus-bucket-2"]


def test_a_move_places_the_members_that_waited_while_it_ran():
    p = _two_buckets()
    p.begin_move("chorus-bucket-2", "chorus-bucket-1")
    p.request("t3", "k", 2)
    update = p.end_move("chorus-bucket-2", "chorus-bucket-1")
    assert [(x.trial_id, x.bucket) for x in update.placed] == [("t3", "chorus-bucket-2")]


def test_a_move_is_refused_between_keys_busy_buckets_or_a_bucket_and_itself():
    p = _two_buckets()
    p.request("u0", "other", 2)
    assert p.begin_move("chorus-bucket-1", "chorus-bucket-3") is None  # another key
    assert p.begin_move("chorus-bucket-1", "chorus-bucket-1") is None
    p.begin_compaction("chorus-bucket-2")
    assert p.begin_move("chorus-bucket-2", "chorus-bucket-1") is None


def test_a_move_into_a_bucket_without_room_raises():
    p = _two_buckets()
    p.begin_move("chorus-bucket-2", "chorus-bucket-1")
    with pytest.raises(ValueError, match="no room"):
        p.move(["t2"], "chorus-bucket-2", "chorus-bucket-1")


def test_a_bucket_holding_members_is_refilled_before_an_empty_one_of_its_key():
    # An emptied bucket (regrouping moved its members away) is closing: refilled
    # first, it would train its new members apart from the others.
    p = Placement(max_buckets=2)
    for i in range(3):
        p.request(f"t{i}", "k", 2)  # bucket-1: t0, t1; bucket-2: t2
    p.remove("t0")
    p.remove("t1")  # bucket-1 empty, bucket-2 holds t2
    assert p.request("t3", "k", 2).bucket == "chorus-bucket-2"


def test_a_structure_with_no_bucket_open_takes_the_spare_beyond_the_budget():
    p = Placement(max_buckets=2, spare=1)
    p.request("a", "k1", 4)
    p.request("b", "k2", 4)
    placed = p.request("c", "k3", 4)
    assert placed is not None and placed.opened and len(p.buckets) == 3
    assert p.request("d", "k4", 4) is None and p.is_waiting("d")  # one spare, not more


def test_a_structure_with_a_bucket_open_never_takes_the_spare():
    p = Placement(max_buckets=2, spare=1)
    for i in range(8):  # two full buckets of k
        p.request(f"t{i}", "k", 4)
    assert p.request("t8", "k", 4) is None and len(p.buckets) == 2


def test_without_a_spare_a_new_structure_waits_for_the_budget():
    p = Placement(max_buckets=2)
    p.request("a", "k1", 4)
    p.request("b", "k2", 4)
    assert p.request("c", "k3", 4) is None


def test_the_spare_is_taken_from_an_idle_bucket_of_another_structure_at_once():
    p = Placement(max_buckets=1, spare=1)
    p.request("a", "k1", 4)
    p.request("b", "k2", 4)  # the spare
    p.remove("b")  # k2's bucket is idle now
    placed = p.request("c", "k3", 4)
    assert placed is not None and placed.replaces == ("chorus-bucket-2",)
