"""The Ray-free rules under the bucket and pool actors: lockstep, placement, resources."""
from __future__ import annotations

import pytest

from chorus_tune.tune.lockstep import Lockstep
from chorus_tune.tune.options import derived_seed, member_seed
from chorus_tune.tune.placement import Placement
from chorus_tune.tune.resources import (bucket_actor_options, bucket_budget, default_bucket_resources,
                                        trial_token_cpu)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


# ----- lockstep ----------------------------------------------------------------------------------------
def test_iteration_waits_until_every_expected_member_asked():
    lock = Lockstep(capacity=3, gather_s=0.0)
    for m in "abc":
        lock.expect(m)
    lock.request("a")
    lock.request("b")
    assert lock.ready_in() is None and lock.missing() == ["c"]
    lock.request("c")
    assert lock.ready_in() == 0.0
    assert sorted(lock.take()) == ["a", "b", "c"]
    assert lock.requested == [] and lock.ready_in() is None


def test_a_leaving_member_no_longer_blocks_the_others():
    lock = Lockstep(capacity=2, gather_s=0.0)
    lock.expect("a")
    lock.expect("b")
    lock.request("a")
    assert lock.drop("b") is False
    assert lock.ready_in() == 0.0


def test_drop_reports_a_pending_request_and_is_idempotent():
    lock = Lockstep(capacity=2)
    lock.expect("a")
    lock.request("a")
    assert lock.drop("a") is True
    assert lock.drop("a") is False


def test_bucket_with_free_slots_gathers_newcomers_before_running():
    clock = Clock()
    lock = Lockstep(capacity=4, gather_s=1.0, clock=clock)
    lock.expect("a")
    lock.request("a")
    assert lock.ready_in() == pytest.approx(1.0)
    clock.now = 0.6
    lock.expect("b")  # a newcomer restarts the gathering window
    assert lock.ready_in() is None
    lock.request("b")
    assert lock.ready_in() == pytest.approx(1.0)
    clock.now = 1.7
    assert lock.ready_in() == 0.0


def test_full_bucket_runs_without_gathering():
    lock = Lockstep(capacity=2, gather_s=10.0)
    lock.expect("a")
    lock.expect("b")
    lock.request("a")
    lock.request("b")
    assert lock.ready_in() == 0.0


def test_waiting_time_counts_from_the_oldest_request():
    clock = Clock()
    lock = Lockstep(capacity=2, clock=clock)
    lock.expect("a")
    lock.expect("b")
    lock.request("a")
    clock.now = 5.0
    assert lock.waiting_for_s() == 5.0


def test_request_from_a_stranger_and_overfull_expect_are_refused():
    lock = Lockstep(capacity=1)
    with pytest.raises(KeyError):
        lock.request("x")
    lock.expect("a")
    lock.expect("a")  # idempotent
    with pytest.raises(ValueError, match="full"):
        lock.expect("b")


# ----- placement ---------------------------------------------------------------------------------------
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


# ----- resources and seeds -----------------------------------------------------------------------------
def test_cpu_only_cluster_gets_one_bucket_per_core_and_a_token_per_slot():
    cluster = {"CPU": 2.0}
    per_bucket = default_bucket_resources(cluster)
    assert per_bucket == {"CPU": 1.0} and bucket_budget(cluster, per_bucket) == 2
    token = trial_token_cpu(cluster, per_bucket, bucket_size=8)
    assert token == 0.125 and 16 * token <= 2.0
    assert bucket_actor_options(per_bucket) == {"num_cpus": 0, "num_gpus": 0.0}


def test_gpu_cluster_claims_whole_gpus_and_fractions_share_a_card():
    cluster = {"CPU": 16.0, "GPU": 2.0}
    assert default_bucket_resources(cluster) == {"GPU": 1.0, "CPU": 1.0}
    assert bucket_budget(cluster, {"GPU": 0.5, "CPU": 1}) == 4
    assert bucket_actor_options({"GPU": 0.5, "CPU": 1})["num_gpus"] == 0.5


def test_token_never_rounds_to_zero():
    assert trial_token_cpu({"CPU": 1.0}, {"CPU": 1.0}, bucket_size=100000) == pytest.approx(1e-4)


def test_member_seed_is_the_config_seed_else_stable_per_trial():
    assert member_seed({"seed": 9}, "abc_00001") == 9
    assert member_seed({}, "abc_00001") == derived_seed("abc_00001") == member_seed({}, "abc_00001")
    assert derived_seed("abc_00001") != derived_seed("abc_00002")
