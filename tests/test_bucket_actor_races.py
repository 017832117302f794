"""The bucket actor's membership changes that interleave with a running iteration.

A bucket actor answers leaves, parks, joins and compactions while an iteration
runs in its worker thread; each of those waits for the bucket's lock. These
tests drive a ``ChorusBucket`` directly (in this process, on one event loop) and
hold the worker thread at a chosen point, so each interleaving happens every
time rather than once in a long sweep. Each was seen in a benchmark sweep of
slow CNN epochs: a trial failed with "left bucket during its iteration" and
another hung.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
import ray.cloudpickle as cloudpickle

from chorus_tune import reference
from chorus_tune.tune.bucket_actor import ChorusBucket, MemberError
from chorus_tune.tune.options import BucketOptions, Join
from tune_support import digits_task, local_ray  # noqa: F401  (module-scoped Ray: metrics need one)

CONFIGS = {m: {"lr": 0.05 * (i + 1), "seed": i} for i, m in enumerate("abcd")}


class Gate:
    """Wraps a function the bucket calls in its worker thread; holds each call until opened."""

    def __init__(self, fn):
        self.fn = fn
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __call__(self, *args):
        self.entered.set()
        assert self.opened.wait(30), "gate never opened"
        return self.fn(*args)

    async def reached(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 30), "the bucket never reached the gate"


def make_bucket(capacity: int) -> ChorusBucket:
    # No watchdog interference: nothing is parked or reaped unless a test asks.
    options = BucketOptions(bucket_size=capacity, gather_s=0.0, park_after_s=None, reap_interval_s=60.0)
    return ChorusBucket("race-bucket", cloudpickle.dumps(digits_task()), options, "Sequential")


async def settle() -> None:
    """Let every task that can run reach its next wait."""
    for _ in range(5):
        await asyncio.sleep(0)


async def join_all(bucket: ChorusBucket, members: str) -> None:
    for m in members:
        await bucket.expect(m)
    await asyncio.gather(*(bucket.step(m, Join(CONFIGS[m], CONFIGS[m]["seed"])) for m in members))


def reference_val_loss(member: str, iterations: int) -> float:
    history, _ = reference.train(digits_task(), CONFIGS[member], seed=CONFIGS[member]["seed"],
                                 iterations=iterations)
    return history[-1]["val_loss"]


def test_a_leave_queued_behind_a_compaction_retires_its_own_slot():
    async def scenario():
        bucket = make_bucket(4)
        await join_all(bucket, "abcd")                      # iteration 1, slots a=0 b=1 c=2 d=3
        await bucket.leave("a")
        gate = Gate(bucket.core.run_iteration)
        bucket.core.run_iteration = gate
        second = [asyncio.create_task(bucket.step(m)) for m in "bcd"]
        await gate.reached()                                # iteration 2 holds the lock
        compaction = asyncio.create_task(bucket.compact())  # queued first...
        await settle()
        leave_c = asyncio.create_task(bucket.leave("c"))    # ...then c leaves
        await settle()
        gate.opened.set()
        await asyncio.gather(*second, compaction, leave_c)
        assert await bucket.compact() == 2                  # the pool asks again after c's leave
        third = await asyncio.gather(bucket.step("b"), bucket.step("d"))
        return bucket, third

    bucket, (b3, d3) = asyncio.run(scenario())
    assert sorted(bucket.slots) == ["b", "d"] and len(bucket.core.live_slots) == 2
    assert b3["iteration"] == d3["iteration"] == 3
    assert d3["val_loss"] == pytest.approx(reference_val_loss("d", 3), rel=1e-5)
    assert b3["val_loss"] == pytest.approx(reference_val_loss("b", 3), rel=1e-5)


def test_a_member_that_asks_while_being_parked_stays_and_gets_its_iteration():
    async def scenario():
        bucket = make_bucket(2)
        await join_all(bucket, "ab")
        b2 = asyncio.create_task(bucket.step("b"))          # a is late: the watchdog would park it
        await settle()
        gate = Gate(bucket._dump)
        bucket._dump = gate
        park = asyncio.create_task(bucket._park("a"))
        await gate.reached()                                # a's state is being saved...
        a2 = asyncio.create_task(bucket.step("a"))          # ...when a asks after all
        await settle()
        gate.opened.set()
        await park
        return bucket, await asyncio.wait_for(asyncio.gather(a2, b2), timeout=60)

    bucket, (a2, b2) = asyncio.run(scenario())
    assert bucket.parked == {}
    assert a2["iteration"] == b2["iteration"] == 2 and a2["chorus/live"] == 2
    assert a2["val_loss"] == pytest.approx(reference_val_loss("a", 2), rel=1e-5)


def test_a_member_that_leaves_while_joining_leaves_no_slot_behind():
    async def scenario():
        bucket = make_bucket(2)
        for m in "ab":
            await bucket.expect(m)
        gate = Gate(bucket.core.add)
        bucket.core.add = gate
        join_a = asyncio.create_task(bucket.step("a", Join(CONFIGS["a"], 0)))
        await gate.reached()                                # a's model is being built...
        assert await bucket.leave("a")                      # ...when its trial goes away
        gate.opened.set()
        with pytest.raises(MemberError, match="left bucket race-bucket while joining"):
            await join_a
        b1 = await bucket.step("b", Join(CONFIGS["b"], CONFIGS["b"]["seed"]))
        return bucket, b1

    bucket, b1 = asyncio.run(scenario())
    assert list(bucket.slots) == ["b"] and len(bucket.core.live_slots) == 1
    assert b1["chorus/live"] == 1
    assert b1["val_loss"] == pytest.approx(reference_val_loss("b", 1), rel=1e-5)


def test_a_second_request_before_the_first_is_answered_fails_the_first_rather_than_orphaning_it():
    async def scenario():
        bucket = make_bucket(2)
        await join_all(bucket, "ab")
        first = asyncio.create_task(bucket.step("a"))       # waits for b
        await settle()
        second = asyncio.create_task(bucket.step("a"))
        await settle()
        with pytest.raises(MemberError, match="again before its last request was answered"):
            await asyncio.wait_for(first, timeout=30)
        b2 = await bucket.step("b")
        return await asyncio.wait_for(second, timeout=60), b2

    a2, b2 = asyncio.run(scenario())
    assert a2["iteration"] == b2["iteration"] == 2
