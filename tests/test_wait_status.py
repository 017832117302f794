"""What a waiting trial waits for, in words (chorus_tune.tune.rules.wait_status), no Ray."""
from chorus_tune.tune.rules.grouping import GroupKey
from chorus_tune.tune.rules.placement import Placement
from chorus_tune.tune.rules.wait_status import (
    BUCKET,
    COHORT,
    HOUSED,
    SLOT,
    UNKNOWN,
    Wait,
    claimed,
    what_it_waits_for,
    word_wait,
)
from chorus_tune.tune.values.options import BucketOptions

KEY = GroupKey("task", BucketOptions(bucket_size=2), "MLP", ("mlp",))
OTHER = KEY._replace(model_name="CNN", structural_key=("cnn",))
GPU = {"GPU": 1.0, "CPU": 4.0}


def words(member, placement, started=(), resources=GPU, nodes=(GPU,), wait=None):
    wait = wait or what_it_waits_for(member, None, placement, False)
    return word_wait(member, wait, placement, set(started), lambda options: resources, lambda: list(nodes), 30.0)


def full_placement():
    """One bucket of KEY (2 slots, m1 and m2) and the budget used: m3 and m4 queue."""
    placement = Placement(max_buckets=1)
    for member in ("m1", "m2", "m3", "m4"):
        placement.request(member, KEY, 2)
    return placement


def test_a_member_with_a_home_waits_for_nothing_whatever_the_placement_says():
    assert what_it_waits_for("m3", "b0", full_placement(), True) == Wait(HOUSED, bucket="b0")


def test_a_placed_member_without_a_home_waits_for_its_bucket_to_start():
    assert what_it_waits_for("m1", None, full_placement(), False) == Wait(BUCKET, bucket="chorus-bucket-1")


def test_a_held_scout_member_waits_for_its_cohort():
    assert what_it_waits_for("s1", None, full_placement(), True).kind == COHORT


def test_a_queued_member_waits_for_a_slot_of_its_key_behind_those_queued_before_it():
    assert what_it_waits_for("m4", None, full_placement(), False) == Wait(SLOT, key=KEY, ahead=1)


def test_a_member_the_pool_never_saw_is_unknown():
    assert what_it_waits_for("m9", None, full_placement(), False).kind == UNKNOWN
    assert what_it_waits_for("m9", None, None, False).kind == UNKNOWN


def test_a_bucket_claims_its_gpus_and_custom_resources_not_its_cpus():
    assert claimed({"CPU": 4.0, "GPU": 0.5, "accel": 1.0}) == {"GPU": 0.5, "accel": 1.0}


def test_a_bucket_no_alive_node_can_hold_is_a_hopeless_wait():
    said, hopeless = words("m1", full_placement(), resources={"GPU": 2.0}, nodes=[GPU])
    assert hopeless and "which no alive node has" in said


def test_a_bucket_some_node_can_hold_is_not_hopeless():
    said, hopeless = words("m1", full_placement(), nodes=[{"CPU": 8.0}, GPU])
    assert not hopeless and "to start: it claims {'GPU': 1.0}" in said


def test_a_bucket_waiting_to_start_names_the_other_started_buckets_holding_resources():
    placement = Placement(max_buckets=3)
    placement.request("o1", OTHER, 2)  # chorus-bucket-1: started
    placement.request("p1", OTHER._replace(structural_key=("p",)), 2)  # chorus-bucket-2: not started
    placement.request("m1", KEY, 2)  # chorus-bucket-3: its own
    said, _ = words("m1", placement, started={"chorus-bucket-1", "chorus-bucket-3"})
    assert said.endswith("held now by ['chorus-bucket-1 (1 members)']")


def test_a_bucket_waiting_to_start_with_no_other_started_says_nothing_holds_it():
    said, _ = words("m1", full_placement(), started={"chorus-bucket-1"})
    assert said.endswith("held now by nothing")


def test_a_member_with_a_home_is_worded_as_in_its_bucket():
    said, hopeless = words("m1", full_placement(), wait=Wait(HOUSED, bucket="b0"))
    assert said == "nothing: member m1 is in bucket b0" and not hopeless


def test_a_held_scout_member_is_worded_with_the_wait_before_it_is_placed_alone():
    said, _ = words("s1", full_placement(), wait=Wait(COHORT))
    assert said == "the cohort ChorusSearch seats with scout member s1 (placed alone after 30 s)"


def test_a_queued_member_is_worded_with_those_ahead_and_the_buckets_open():
    said, _ = words("m4", full_placement())
    assert said == ("a slot in a bucket of MLP (1 member(s) queued before it; 1 of 1 bucket(s) open: "
                    "['chorus-bucket-1 (2/2)'])")


def test_an_unknown_member_is_worded_as_unknown():
    said, hopeless = words("m9", full_placement())
    assert said == "member m9, which the pool does not know" and not hopeless


def test_the_nodes_are_asked_only_for_a_bucket_waiting_to_start():
    def no_nodes():
        raise AssertionError("nodes asked")

    placement = full_placement()
    word_wait("m4", what_it_waits_for("m4", None, placement, False), placement, set(), lambda o: GPU, no_nodes, 30.0)
