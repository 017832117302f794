"""When the pool closes an empty bucket and compacts one (chorus_tune.tune.rules.closing), no Ray."""
from chorus_tune.tune.rules.closing import Watches, compact_after_s, compaction_due, idle_close_s, stays_idle
from chorus_tune.tune.rules.grouping import GroupKey
from chorus_tune.tune.rules.placement import Placement
from chorus_tune.tune.values.options import BucketOptions

OPTIONS = BucketOptions(bucket_size=4, idle_close_s=7.0, compact_after_s=3.0)
KEY = GroupKey("task", OPTIONS, "MLP", ("mlp",))


def bucket_of(members, key=KEY, capacity=4, max_buckets=None):
    """A placement with one bucket of ``key`` holding ``members``; its name."""
    placement = Placement(max_buckets)
    for member in members:
        placement.request(member, key, capacity)
    return placement, next(iter(placement.buckets))


def test_an_idle_bucket_stays_open_for_its_options_idle_close_s():
    placement, name = bucket_of(["m1"])
    assert idle_close_s(placement, name) == 7.0


def test_a_bucket_no_longer_placed_is_not_waited_for():
    assert idle_close_s(Placement(), "chorus-bucket-1") is None


def test_an_empty_bucket_stays_idle():
    placement, name = bucket_of(["m1"])
    placement.remove("m1")
    assert stays_idle(placement, name)


def test_a_refilled_bucket_no_longer_heads_for_closing():
    placement, name = bucket_of(["m1"])
    placement.remove("m1")
    placement.request("m2", KEY, 4)
    assert not stays_idle(placement, name)


def test_a_bucket_whose_budget_went_to_another_key_no_longer_heads_for_closing():
    placement, name = bucket_of(["m1"], max_buckets=1)
    placement.request("o1", KEY._replace(structural_key=("other",)), 4)  # queued: no budget
    placement.remove("m1")  # the empty bucket gives its budget up to o1's key
    assert name not in placement.buckets and not stays_idle(placement, name)


def test_a_bucket_is_watched_by_one_task_at_a_time():
    watches = Watches()
    assert watches.start("b") and not watches.start("b")


def test_a_watch_that_ended_may_start_again():
    watches = Watches()
    watches.start("b")
    watches.end("b")
    assert watches.start("b")


def test_buckets_are_watched_apart():
    watches = Watches()
    watches.start("b1")
    assert watches.start("b2")


def test_a_bucket_is_looked_at_for_compaction_its_compact_after_s_after_a_member_left():
    placement, name = bucket_of(["m1"])
    assert compact_after_s(placement, name) == 3.0


def test_a_bucket_not_placed_is_looked_at_for_compaction_at_once():
    assert compact_after_s(None, "b") == 0.0 and compact_after_s(Placement(), "b") == 0.0


def test_a_bucket_at_half_its_slots_with_none_waiting_compacts():
    placement, name = bucket_of(["m1", "m2"])
    assert compaction_due(placement, name)


def test_a_bucket_over_half_full_does_not_compact():
    placement, name = bucket_of(["m1", "m2", "m3"])
    assert not compaction_due(placement, name)


def test_a_bucket_whose_key_has_members_waiting_does_not_compact():
    placement, name = bucket_of(["m1", "m2"], max_buckets=1, capacity=2)
    placement.request("m3", KEY, 2)  # queued: the bucket is full and the budget used
    placement.buckets[name].capacity = 4  # now at half its slots, with m3 waiting for its key
    assert placement.waiting_for(KEY) == 1 and not compaction_due(placement, name)


def test_a_bucket_whose_options_forbid_compaction_does_not_compact():
    placement, name = bucket_of(["m1"], key=KEY._replace(options=BucketOptions(bucket_size=4, compact=False)))
    assert not compaction_due(placement, name)


def test_a_bucket_not_placed_does_not_compact():
    assert not compaction_due(None, "b") and not compaction_due(Placement(), "b")


def test_a_compacted_bucket_has_the_capacity_it_compacted_to():
    placement, name = bucket_of(["m1"])
    assert placement.begin_compaction(name) == ["m1"]
    placement.end_compaction(name, 1)
    assert placement.buckets[name].capacity == 1 and placement.buckets[name].free == 0


def test_a_bucket_that_did_not_compact_keeps_its_capacity():
    placement, name = bucket_of(["m1"])
    placement.begin_compaction(name)
    placement.end_compaction(name, None)
    assert placement.buckets[name].capacity == 4 and placement.buckets[name].free == 3


def test_a_bucket_closed_while_it_compacted_is_not_recorded():
    placement, name = bucket_of(["m1"])
    placement.begin_compaction(name)
    placement.remove("m1")
    placement.close(name)
    placement.end_compaction(name, 1)
    assert name not in placement.buckets


def test_a_compacting_bucket_is_not_due_to_compact_again():
    placement, name = bucket_of(["m1"])
    assert placement.begin_compaction(name) is not None
    assert not compaction_due(placement, name) and placement.begin_compaction(name) is None


def test_a_compacting_bucket_offers_no_slot_and_its_key_waits_instead_of_opening_a_bucket():
    # Seen in the suite: a member placed in a slot the compaction was removing
    # could not join ("bucket is full") and its trial failed.
    placement, name = bucket_of(["m1"])
    placement.begin_compaction(name)
    assert placement.free_slots(KEY) == 0
    assert placement.request("m2", KEY, 4) is None and placement.is_waiting("m2")
    assert list(placement.buckets) == [name]


def test_a_trial_that_waited_for_a_compaction_is_placed_when_it_ends():
    placement, name = bucket_of(["m1", "m2"])
    placement.begin_compaction(name)
    placement.request("m3", KEY, 4)
    update = placement.end_compaction(name, None)  # refused: the slots are offered again
    assert [(p.trial_id, p.bucket) for p in update.placed] == [("m3", name)]


def test_a_trial_that_waited_for_a_compaction_that_left_no_slot_gets_a_new_bucket():
    placement, name = bucket_of(["m1"])
    placement.begin_compaction(name)
    placement.request("m2", KEY, 4)
    update = placement.end_compaction(name, 1)
    (placed,) = update.placed
    assert placed.trial_id == "m2" and placed.opened and placed.bucket != name


def test_a_member_leaving_while_its_bucket_compacts_frees_its_slot_once_the_compaction_ends():
    # The pool removes a member before its bucket hears of it: compacted to the
    # two it held when the compaction began, the bucket then has a free slot.
    placement, name = bucket_of(["m1", "m2"])
    assert placement.begin_compaction(name) == ["m1", "m2"]
    placement.remove("m2")
    assert placement.free_slots(KEY) == 0
    placement.end_compaction(name, 2)
    assert placement.free_slots(KEY) == 1


def test_a_waiting_trial_never_takes_another_key_s_budget_while_its_own_bucket_compacts():
    other = KEY._replace(model_name="CNN", structural_key=("cnn",))
    placement, name = bucket_of(["m1"], max_buckets=2)
    placement.request("x", other, 4)
    placement.remove("x")  # the other key's bucket is idle
    placement.begin_compaction(name)
    assert placement.request("m2", KEY, 4) is None and len(placement.buckets) == 2
