"""Every wait ends (docs/design.md "Faults"): the Ray-free rules of tune/rules/waits.py and the placement queue."""
from __future__ import annotations

import pytest

from chorus_tune.tune.rules.placement import Placement
from chorus_tune.tune.rules.waits import Stall, StalledWait, asks_to_evict, fits_a_node, idle_members


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_lasts_as_long_as_the_sweep_moves():
    clock = Clock()
    stall = Stall(60.0, "trial t1 waited for a bucket", clock=clock)
    for step in range(100):  # 100 readings over 1000 s, progress every time
        clock.now = 10.0 * step
        stall.seen(step, "a slot")


def test_a_wait_ends_in_an_error_naming_what_it_waited_for_once_nothing_moves():
    clock = Clock()
    stall = Stall(60.0, "trial t1 waited for a bucket for member t1", clock=clock)
    stall.seen(5, "bucket b2 to start")
    clock.now = 59.0
    stall.seen(5, "bucket b2 to start")
    clock.now = 61.0
    with pytest.raises(StalledWait, match=r"trial t1 waited .* for 60s with nothing moving.*bucket b2 to start"):
        stall.seen(5, "bucket b2 to start")


def test_an_unreadable_progress_is_not_progress():
    clock = Clock()
    stall = Stall(30.0, "w", clock=clock)
    stall.seen(1)
    clock.now = 31.0
    with pytest.raises(StalledWait, match="an answer from the pool"):
        stall.seen(None)


def test_a_bucket_no_alive_node_can_hold_is_hopeless():
    nodes = [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0}]
    assert fits_a_node({"GPU": 1.0}, nodes)
    assert not fits_a_node({"GPU": 2.0}, nodes)  # two GPUs on one node: none has them
    assert not fits_a_node({"GPU": 1.0}, [{"CPU": 1.0}])  # the GPU node is gone
    assert fits_a_node({"GPU": 0.0}, [{"CPU": 1.0}])  # claims nothing


def test_the_queue_says_how_many_of_a_key_wait_before_a_trial():
    p = Placement(max_buckets=1)
    assert p.request("a", "k1", 1) is not None
    for t, key in (("b", "k1"), ("c", "k2"), ("d", "k1")):
        assert p.request(t, key, 1) is None
    assert p.waiting_ahead("b") == ("k1", 0)
    assert p.waiting_ahead("c") == ("k2", 0)
    assert p.waiting_ahead("d") == ("k1", 1)
    assert p.waiting_ahead("a") is None  # placed


def test_members_whose_trials_stopped_asking_give_their_slots_up_oldest_first():
    asked = {"a": 0.0, "b": 50.0, "c": 10.0, "d": 95.0}
    # "c" is waiting for a result now (busy); "d" asked 5 s ago; "e" was never read.
    assert idle_members(asked, ["a", "b", "c", "d", "e"], busy={"c"}, now=100.0, idle_s=30.0) == ["a", "b"]
    assert idle_members(asked, ["a", "b"], busy=set(), now=20.0, idle_s=30.0) == []


def test_a_full_bucket_of_the_waiting_members_key_is_asked_to_evict():
    assert asks_to_evict(free=0, same_key=True, budget_used=False)


def test_a_bucket_of_the_waiting_members_key_with_a_free_slot_is_not_asked():
    assert not asks_to_evict(free=1, same_key=True, budget_used=True)


def test_a_bucket_of_another_key_is_asked_only_when_the_budget_is_used_up():
    assert asks_to_evict(free=0, same_key=False, budget_used=True)
    assert asks_to_evict(free=3, same_key=False, budget_used=True)
    assert not asks_to_evict(free=0, same_key=False, budget_used=False)
