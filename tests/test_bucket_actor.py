"""The bucket actor, driven directly (in this process, on one event loop).

A bucket trains its members ahead of their trials and answers joins, leaves,
saves and compactions while an iteration runs in its worker thread. These
tests hold the worker thread at a chosen point (a ``Gate``) so that each
interleaving happens every time, and compare every result with
``reference.train``.
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading

import pytest
import ray.cloudpickle as cloudpickle

from chorus_tune import reference
from chorus_tune.tune.actors.bucket_actor import ChorusBucket, MemberError
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values import state_io
from chorus_tune.tune.values.options import BucketOptions, Join
from chorus_tune.tune.values.plan import Plan

from tune_support import digits_task

pytestmark = pytest.mark.usefixtures("local_ray")  # the bucket's metrics need a Ray instance

CONFIGS = {m: {"lr": 0.05 * (i + 1), "seed": i} for i, m in enumerate("abcd")}
RTOL = 1e-5


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


def make_bucket(capacity: int, **options) -> ChorusBucket:
    options = BucketOptions(bucket_size=capacity, **{"gather_s": 0.0, "reap_interval_s": 60.0, **options})
    return ChorusBucket("test-bucket", cloudpickle.dumps(digits_task()), options, "Sequential")


def join(member: str, plan: Plan) -> Join:
    return Join(CONFIGS[member], CONFIGS[member]["seed"], plan=plan)


async def seat(bucket: ChorusBucket, members: str, plan: Plan) -> None:
    """Members seated ahead of any trial, as the pool seats ChorusSearch's."""
    await asyncio.gather(*(bucket.expect(m, None, join(m, plan)) for m in members))


async def until(predicate, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def reference_history(member: str, iterations: int) -> list[dict]:
    history, _ = reference.train(digits_task(), CONFIGS[member], seed=CONFIGS[member]["seed"],
                                 iterations=iterations)
    return history


def test_members_train_to_their_budget_before_any_trial_reads_them():
    async def scenario():
        bucket = make_bucket(2)
        await seat(bucket, "ab", Plan(budget=4, bucket_decides=True))
        await until(lambda: all(r.produced == 4 for r in bucket.book.records.values()))
        return bucket, [await bucket.next_result("a") for _ in range(4)]

    bucket, results = asyncio.run(scenario())
    assert bucket.iterations == 4
    assert [r[rk.AHEAD] for r in results] == [3, 2, 1, 0]
    assert results[-1]["done"] is True
    for ours, theirs in zip(results, reference_history("a", 4)):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=RTOL)


def test_members_expected_in_one_call_train_every_iteration_together():
    # The pool tells a bucket of the members placed in it together in one call:
    # told one by one, a new bucket trained the first ones alone while the rest were on their way.
    async def scenario():
        bucket = make_bucket(4)
        await bucket.expect_all([(m, None, join(m, Plan(budget=2, bucket_decides=True))) for m in "abcd"])
        await until(lambda: all(r.produced == 2 for r in bucket.book.records.values()))
        return bucket

    bucket = asyncio.run(scenario())
    assert bucket.iterations == 2  # two iterations, each of all four


def test_a_save_after_result_t_holds_the_member_at_t_though_the_bucket_is_ahead():
    async def scenario():
        bucket = make_bucket(2)
        await seat(bucket, "ab", Plan(budget=5, bucket_decides=True))
        await until(lambda: bucket.book.get("a").produced == 5)
        await bucket.next_result("a")
        second = await bucket.next_result("a")
        return second, state_io.loads(await bucket.save("a"))

    second, state = asyncio.run(scenario())
    assert second["iteration"] == 2 and second[rk.AHEAD] == 3
    assert state["iteration"] == 2
    # Resumed from that state, the member continues the reference trajectory.
    from chorus_tune import Bucket

    resumed = Bucket(digits_task(), 1)
    slot = resumed.restore(state)
    out = resumed.run_iteration()[slot]
    assert out["iteration"] == 3
    assert out["val_loss"] == pytest.approx(reference_history("a", 3)[-1]["val_loss"], rel=RTOL)


def test_run_ahead_bounds_how_far_a_member_trains_past_what_its_trial_read():
    def parked(bucket):
        """What the training loop sees once it stopped: no iteration running (it
        holds the lock), and nobody it may train, so it waits, with no timeout,
        for a request or a membership change to wake it."""
        return not bucket._lock.locked() and bucket.book.next_iteration(0.0, gather=False) == ([], None)

    async def scenario():
        bucket = make_bucket(1)
        await seat(bucket, "a", Plan(run_ahead=2))
        await until(lambda: bucket.book.get("a").produced >= 2)
        seen = [(bucket.book.get("a").produced, parked(bucket))]  # nothing read: 2 ahead, no more
        await bucket.next_result("a")
        await until(lambda: bucket.book.get("a").produced >= 3)
        seen.append((bucket.book.get("a").produced, parked(bucket)))  # 1 read: 3, no more
        return seen

    assert asyncio.run(scenario()) == [(2, True), (3, True)]


def test_a_straggler_is_masked_and_its_bucket_mates_go_on():
    async def scenario():
        bucket = make_bucket(3, gather_s=0.05)
        await seat(bucket, "abc", Plan(run_ahead=0))
        reads = {m: [] for m in "abc"}
        for _ in range(4):  # "c"'s trial never asks
            for m, result in zip("ab", await asyncio.gather(bucket.next_result("a"), bucket.next_result("b"))):
                reads[m].append(result)
        assert bucket.book.get("c").produced == 0
        reads["c"].append(await bucket.next_result("c"))  # the straggler catches up, on its own trajectory
        return reads

    reads = asyncio.run(scenario())
    for m in "ab":
        assert [r["iteration"] for r in reads[m]] == [1, 2, 3, 4]
        assert all(r[rk.LIVE] == 2 for r in reads[m])
        for ours, theirs in zip(reads[m], reference_history(m, 4)):
            assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=RTOL)
    assert reads["c"][0]["iteration"] == 1
    assert reads["c"][0]["val_loss"] == pytest.approx(reference_history("c", 1)[0]["val_loss"], rel=RTOL)


def test_a_cohort_at_a_rung_is_halved_in_the_bucket_and_the_stopped_train_no_further():
    plan = Plan(budget=3, bucket_decides=True, rungs=(1,), reduction_factor=4, metric="val_loss", sign=-1.0)

    async def scenario():
        bucket = make_bucket(4)
        await seat(bucket, "abcd", plan)
        await until(lambda: all(r.produced in (1, 3) for r in bucket.book.records.values())
                    and any(r.produced == 3 for r in bucket.book.records.values()))
        return bucket, {m: await bucket.next_result(m) for m in "abcd"}

    bucket, first = asyncio.run(scenario())
    losses = {m: reference_history(m, 1)[0]["val_loss"] for m in "abcd"}
    best = min(losses, key=losses.get)
    assert {m for m, r in first.items() if r[rk.DECISION] == "CONTINUE"} == {best}
    assert all(r[rk.COHORT_SIZE] == 4 for r in first.values())
    assert {m: bucket.book.get(m).produced for m in "abcd"} == {m: 3 if m == best else 1 for m in "abcd"}
    assert bucket.book.wasted == 0


@pytest.mark.parametrize("rows_cost_alike", [False, True], ids=["vmap_gathers", "every_row_runs"])
def test_members_held_at_a_learnt_decision_point_ride_only_where_every_row_runs_and_stay_on_their_reference(
        monkeypatch, rows_cost_alike):
    # Tune decides (speculate), the cap is 4. Trial d is stopped after
    # iteration 1: the bucket learns the decision point 1. a, b and c train
    # to it and wait for their trials; a's is continued. On vmap an iteration
    # gathers the rows it trains, so b and c (held, short of the cap) do not
    # ride along: a row would cost. Where every row of the stack runs anyway
    # (the compiled route's full-stack call, simulated here on vmap) they do.
    monkeypatch.setattr(ChorusBucket, "_rows_cost_alike", lambda self: rows_cost_alike)
    plan = Plan(run_ahead=1, budget=4, speculate=True)

    def held(bucket) -> bool:
        return not bucket._lock.locked() and bucket.book.next_iteration(0.0, gather=False, ride=True) == ([], None)

    async def scenario():
        bucket = make_bucket(4, route="vmap")
        reads = {m: [] for m in "abcd"}
        await seat(bucket, "d", plan)
        reads["d"].append(await bucket.next_result("d"))
        await bucket.leave("d")                    # Tune stopped d at 1
        learnt = bucket.book.stops.points
        await seat(bucket, "abc", plan)
        await until(lambda: held(bucket) and all(bucket.book.get(m).produced >= 1 for m in "abc"))
        at_point = {m: bucket.book.get(m).produced for m in "abc"}
        for _ in range(4):                         # Tune continues a past 1, to the cap
            reads["a"].append(await bucket.next_result("a"))
        ridden = {m: bucket.book.get(m).produced for m in "bc"}  # b's and c's trials have read nothing
        for m in "bc":
            reads[m] += [await bucket.next_result(m) for _ in range(4)]
        return bucket, learnt, at_point, ridden, reads

    bucket, learnt, at_point, ridden, reads = asyncio.run(scenario())
    assert learnt == (1,)
    assert at_point == {"a": 1, "b": 1, "c": 1}
    if rows_cost_alike:
        assert ridden == {"b": 4, "c": 4}
        # One iteration of a, b and c, then three in which b and c rode along (none of b or c alone).
        assert [r[rk.LIVE] for r in reads["b"]] == [3, 3, 3, 3]
    else:
        assert ridden == {"b": 1, "c": 1}
        assert all(r[rk.ROWS] == r[rk.LIVE] for results in reads.values() for r in results)
    for m, results in reads.items():
        assert all(r[rk.ROUTE] == "vmap" for r in results), m
        assert [r["iteration"] for r in results] == list(range(1, len(results) + 1)), m
        for ours, theirs in zip(results, reference_history(m, len(results))):
            assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=RTOL), (m, ours["iteration"])
    assert reads["a"][-1]["done"] and reads["b"][-1]["done"] and reads["c"][-1]["done"]


def test_leaving_counts_the_results_nobody_read_as_wasted():
    async def scenario():
        bucket = make_bucket(1)
        await seat(bucket, "a", Plan(run_ahead=2))
        await until(lambda: bucket.book.get("a").produced == 2)
        await bucket.next_result("a")
        await until(lambda: bucket.book.get("a").produced == 3)
        await bucket.leave("a")
        return bucket

    bucket = asyncio.run(scenario())
    assert bucket.book.wasted == 2 and (await_describe(bucket))["wasted"] == 2


def await_describe(bucket: ChorusBucket) -> dict:
    return asyncio.run(bucket.describe())


def test_a_leave_during_an_iteration_frees_its_slot_after_it_and_harms_nobody():
    async def scenario():
        bucket = make_bucket(2)
        gate = Gate(bucket._train)
        bucket._train = gate
        await seat(bucket, "ab", Plan(budget=2, bucket_decides=True))
        await gate.reached()                       # iteration 1 holds the lock
        leaving = asyncio.create_task(bucket.leave("a"))
        await asyncio.sleep(0)                     # the leave runs up to the lock the iteration holds
        assert not leaving.done() and bucket.book.get("a").phase.value != "left"
        gate.opened.set()
        await leaving
        return bucket, [await bucket.next_result("b") for _ in range(2)]

    bucket, results = asyncio.run(scenario())
    assert len(bucket.core.live_slots) == 0 and bucket.book.get("a").phase.value == "left"
    assert [r[rk.LIVE] for r in results] == [2, 1]
    for ours, theirs in zip(results, reference_history("b", 2)):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=RTOL)


def test_a_trial_stopped_while_an_iteration_runs_teaches_its_point_before_the_iteration_ends():
    # Tune continues trials at once (their next fetch counts), but a stopped
    # trial's leave waits for the running iteration to free the slot. Counted
    # only then, the continues that came meanwhile cleared the point first, and
    # every member speculated past it (a 128-trial stock-ASHA run wasted 340 of
    # 648 member-epochs so).
    async def scenario():
        bucket = make_bucket(2)
        bucket._pool = notices = _NoticesTaken()
        gate = Gate(bucket._train)
        gate.opened.set()  # iteration 1 runs freely
        bucket._train = gate
        await seat(bucket, "ab", Plan(run_ahead=2, budget=10, speculate=True, clear_after=1))
        await bucket.next_result("a")
        await bucket.next_result("b")              # both trials read iteration 1
        gate.opened.clear()
        gate.entered.clear()
        asking = asyncio.create_task(bucket.next_result("b"))  # continued past 1: iteration 2 runs for b
        await gate.reached()                       # ... and holds the lock
        leaving = asyncio.create_task(bucket.leave("a", read=1))  # Tune stopped a's trial at 1
        await asyncio.sleep(0)
        learnt_during = bucket.book.stops.points
        told_during = [sent for sent in notices.sent if len(sent) == 3 and sent[1]]  # stops_seen with a stop
        gate.opened.set()
        await leaving
        await asking
        return bucket, learnt_during, told_during

    bucket, learnt_during, told_during = asyncio.run(scenario())
    assert learnt_during == (1,)
    assert [stopped for _, stopped, _ in told_during] == [{1: 1}]  # the run's other buckets hear it then
    assert bucket.book.stops.stopped == {1: 1}  # counted once, not again when the slot was freed


def test_a_member_watched_while_it_leaves_is_not_reaped_once_it_has_left(monkeypatch, caplog):
    # The pool binds a trial (watch) while that trial's leave waits for the
    # running iteration: the leave must not keep the watch. Seen before: once
    # the trial actor ended, every reap interval "dropped" the member again.
    from chorus_tune.tune.actors import liveness

    monkeypatch.setattr(liveness, "dead_among", lambda ids: set(ids))  # every trial actor is gone
    caplog.set_level(logging.INFO, logger="chorus_tune")

    async def scenario():
        bucket = make_bucket(2, reap_interval_s=0.02)
        reaps = []
        bucket.metrics.refresh = lambda: reaps.append(1)  # once per reap interval
        gate = Gate(bucket._train)
        bucket._train = gate
        await seat(bucket, "ab", Plan(budget=2, bucket_decides=True))
        await gate.reached()                       # iteration 1 holds the lock
        leaving = asyncio.create_task(bucket.leave("a"))
        await asyncio.sleep(0)                     # the leave runs up to the lock the iteration holds
        assert not leaving.done() and bucket.book.get("a").phase.value != "left"
        await bucket.watch("a", "trial-actor-of-a")
        gate.opened.set()
        await leaving
        seen = len(reaps)
        await until(lambda: len(reaps) >= seen + 3, timeout=10)
        await bucket.close()
        return bucket

    bucket = asyncio.run(scenario())
    assert "a" not in bucket.clients
    assert bucket.reaped == []
    assert not [m for m in caplog.messages if "dropped a" in m]


def test_threads_offered_reach_the_thread_that_trains_which_measures_each_count_first():
    # The pool shares a CPU machine's cores among the open buckets, changing a
    # bucket's threads as buckets open and close. A thread's OpenMP count is its
    # own: set on the event loop's thread alone, it never reached the iterations.
    # Each iteration sets it in the training thread, to the count rules/threads.py
    # chooses: one first, then all it is offered, then the faster of the two.
    import torch

    before = torch.get_num_threads()

    async def scenario():
        # One route: under "auto" an iteration that times candidate routes measures
        # no thread count (ThreadChoice.observe skips it), which shifts the sequence
        # by an iteration whenever the route probe runs past the first one.
        bucket = make_bucket(2, route="vmap")
        seen = []
        run_iteration = bucket.core.run_iteration

        def counting(*args, **kwargs):
            seen.append(torch.get_num_threads())  # in the thread that trains
            return run_iteration(*args, **kwargs)

        bucket.core.run_iteration = counting
        await seat(bucket, "a", Plan(budget=1, bucket_decides=True))
        await bucket.next_result("a")  # the thread that trains exists now, on one thread
        await bucket.set_threads(2)
        await seat(bucket, "b", Plan(budget=3, bucket_decides=True))
        for _ in range(3):
            await bucket.next_result("b")
        await bucket.close()
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        torch.set_num_threads(before)
    assert seen[:3] == [1, 1, 2] and seen[3] in (1, 2)


def test_a_member_whose_trial_leaves_while_it_is_built_leaves_no_slot_behind():
    async def scenario():
        bucket = make_bucket(2)
        gate = Gate(bucket.core.add)
        bucket.core.add = gate
        await bucket.expect("a")
        reading = asyncio.create_task(bucket.next_result("a", join("a", Plan(run_ahead=1))))
        await gate.reached()                       # a's model is being built...
        # ...when its trial goes away: a member with no slot yet leaves at once, not after the build.
        assert await asyncio.wait_for(bucket.leave("a"), timeout=10)
        gate.opened.set()
        return bucket, await reading

    bucket, result = asyncio.run(scenario())
    assert result[rk.RETIRED] and result["done"]
    assert bucket.core.live_slots == []


def test_a_compaction_waits_for_the_running_iteration_and_renumbers_slots():
    async def scenario():
        bucket = make_bucket(4)
        await seat(bucket, "abcd", Plan(run_ahead=0))
        await asyncio.gather(*(bucket.next_result(m) for m in "abcd"))
        await bucket.leave("a")
        await bucket.leave("c")
        gate = Gate(bucket._train)
        bucket._train = gate
        second = asyncio.gather(bucket.next_result("b"), bucket.next_result("d"))
        await gate.reached()
        compaction = asyncio.create_task(bucket.compact())
        await asyncio.sleep(0)                     # the compaction runs up to the lock the iteration holds
        assert not compaction.done() and bucket.core.capacity == 4
        gate.opened.set()
        b2, d2 = await second
        capacity = await compaction
        b3, d3 = await asyncio.gather(bucket.next_result("b"), bucket.next_result("d"))
        return bucket, capacity, b3, d3

    bucket, capacity, b3, d3 = asyncio.run(scenario())
    assert capacity == 2 and bucket.core.capacity == 2
    assert sorted(r.slot for r in bucket.book.in_slots()) == [0, 1]
    assert b3["iteration"] == d3["iteration"] == 3 and b3[rk.CAPACITY] == 2
    assert b3["val_loss"] == pytest.approx(reference_history("b", 3)[-1]["val_loss"], rel=RTOL)
    assert d3["val_loss"] == pytest.approx(reference_history("d", 3)[-1]["val_loss"], rel=RTOL)


async def _two_trained_members_of_four_slots():
    """A bucket of 4 slots whose members a and b have trained an iteration."""
    bucket = make_bucket(4)
    await seat(bucket, "ab", Plan(run_ahead=1))
    await asyncio.gather(bucket.next_result("a"), bucket.next_result("b"))
    return bucket


def test_a_compaction_goes_ahead_when_the_pool_holds_the_members_in_slots():
    async def scenario():
        bucket = await _two_trained_members_of_four_slots()
        return await bucket.compact(["b", "a"]), bucket

    capacity, bucket = asyncio.run(scenario())
    assert capacity == 2 and bucket.core.capacity == 2


def test_a_compaction_is_refused_while_a_leave_the_pool_sent_is_on_its_way():
    # The pool let b go and offers its slot; shrunk to a and b, the bucket
    # would have no slot for the member the pool places there next.
    async def scenario():
        bucket = await _two_trained_members_of_four_slots()
        return await bucket.compact(["a"]), bucket

    capacity, bucket = asyncio.run(scenario())
    assert capacity is None and bucket.core.capacity == 4


def test_a_compaction_is_refused_while_a_join_the_pool_sent_is_on_its_way():
    async def scenario():
        bucket = await _two_trained_members_of_four_slots()
        return await bucket.compact(["a", "b", "c"]), bucket

    capacity, bucket = asyncio.run(scenario())
    assert capacity is None and bucket.core.capacity == 4


def test_a_member_whose_model_cannot_be_built_fails_alone_with_the_factorys_error():
    async def scenario():
        bucket = make_bucket(2)
        await seat(bucket, "a", Plan(budget=2, bucket_decides=True))
        bad = Join({"lr": 0.1, "width": -3}, 0, plan=Plan(budget=2, bucket_decides=True))
        await bucket.expect("x", None, bad)
        with pytest.raises(RuntimeError, match="negative dimension|-3"):
            await bucket.next_result("x")
        return [await bucket.next_result("a") for _ in range(2)]

    results = asyncio.run(scenario())
    for ours, theirs in zip(results, reference_history("a", 2)):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=RTOL)


class _NoticesTaken:
    """Stands in for the pool's handle: keeps what ``member_out.remote`` was sent."""

    def __init__(self):
        self.sent = []
        self.member_out = self
        self.stops_seen = self  # the bucket tells the pool its decision points too

    def remote(self, *args):
        self.sent.append(args)


def test_a_member_that_fails_tells_the_pool_its_error_for_a_trial_that_asks_later():
    async def scenario():
        bucket = make_bucket(2)
        bucket._pool = notices = _NoticesTaken()
        bad = Join({"lr": 0.1, "width": -3}, 0, plan=Plan(budget=2, bucket_decides=True))
        await bucket.expect("x", None, bad)
        await until(lambda: notices.sent)
        return notices.sent

    ((name, member, reason, error),) = asyncio.run(scenario())
    assert (name, member, reason) == ("test-bucket", "x", "failed")
    assert re.search("negative dimension|-3", str(error))


def test_a_continue_that_may_clear_an_iteration_reaches_the_pool_and_evidence_from_elsewhere_frees_members():
    # Speculation on evidence (docs/design.md D4): a, b and c train to 1 at
    # once; past it they wait for two of the run's trials continued past each
    # iteration. a's trial is continued past 1 here (news for the run's other
    # buckets); another bucket's trials clear 1 and 2: b and c train to the cap.
    plan = Plan(run_ahead=2, budget=3, speculate=True, clear_after=2)

    async def scenario():
        bucket = make_bucket(3, route="vmap")
        bucket._pool = notices = _NoticesTaken()
        await seat(bucket, "abc", plan)
        reads = {m: [] for m in "abc"}
        reads["a"].append(await bucket.next_result("a"))
        await until(lambda: all(bucket.book.get(m).produced == 1 for m in "abc"))
        second = asyncio.create_task(bucket.next_result("a"))  # Tune continued a past 1
        await until(lambda: any(len(sent) == 3 for sent in notices.sent))
        held = {m: bucket.book.get(m).produced for m in "bc"}
        await bucket.stops_elsewhere({}, {1: 1, 2: 2})
        reads["a"].append(await second)
        await until(lambda: all(bucket.book.get(m).produced == 3 for m in "bc"))
        for m in "bc":
            reads[m] += [await bucket.next_result(m) for _ in range(3)]
        return [sent for sent in notices.sent if len(sent) == 3], held, reads

    news, held, reads = asyncio.run(scenario())
    assert news[0] == ("test-bucket", {}, {1: 1})
    assert held == {"b": 1, "c": 1}
    for m, results in reads.items():
        assert [r["iteration"] for r in results] == list(range(1, len(results) + 1)), m
        for ours, theirs in zip(results, reference_history(m, len(results))):
            assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=RTOL), (m, ours["iteration"])


def test_an_error_that_does_not_pickle_reaches_the_pool_as_its_type_and_message():
    from chorus_tune.tune.actors.bucket_actor_values import portable as _portable

    class HoldsALock(Exception):
        def __init__(self, message):
            super().__init__(message)
            self.lock = threading.Lock()

    sent = _portable(HoldsALock("the factory's own words"))
    assert type(sent) is RuntimeError and str(sent) == "HoldsALock: the factory's own words"
    plain = ValueError("as it is")
    assert _portable(plain) is plain and _portable(None) is None


def test_a_second_request_before_the_first_is_answered_fails_the_first_rather_than_orphaning_it():
    async def scenario():
        bucket = make_bucket(1)
        await seat(bucket, "a", Plan(run_ahead=0))
        gate = Gate(bucket._train)
        bucket._train = gate
        first = asyncio.create_task(bucket.next_result("a"))
        await gate.reached()
        second = asyncio.create_task(bucket.next_result("a"))
        await asyncio.sleep(0)                     # the second request is in: it fails the first
        assert not second.done()
        gate.opened.set()
        with pytest.raises(MemberError, match="again before its last request was answered"):
            await asyncio.wait_for(first, timeout=30)
        return await asyncio.wait_for(second, timeout=30)

    assert asyncio.run(scenario())["iteration"] == 1


def test_the_repr_ray_captures_at_creation_stays_true_while_the_bucket_trains_and_shrinks():
    async def scenario():
        bucket = make_bucket(4)
        captured = repr(bucket)  # what Ray shows in the dashboard, for the actor's whole life
        await seat(bucket, "ab", Plan(run_ahead=1))
        await asyncio.gather(bucket.next_result("a"), bucket.next_result("b"))
        assert await bucket.compact() == 2
        return captured, bucket

    captured, bucket = asyncio.run(scenario())
    assert captured == "ChorusBucket(Sequential, bucket_size=4, cpu)"
    assert repr(bucket) == captured


STATUS = re.compile(r"test-bucket: iteration (\d+), live (\d+)/(\d+), trained (\d+), rows (\d+), route (\w+), "
                    r"threads \d+, [\d.]+ s, step ([\d.]+) ms, (\d+) samples/s, wasted (\d+)$")


def test_each_iteration_writes_one_status_line_saying_what_its_results_say(caplog):
    caplog.set_level(logging.INFO, logger="chorus_tune.tune.actors.bucket_actor")

    async def scenario():
        bucket = make_bucket(3)
        await seat(bucket, "ab", Plan(budget=2, bucket_decides=True))
        return [await bucket.next_result("a") for _ in range(2)]

    results = asyncio.run(scenario())
    lines = [m.group(1, 2, 3, 4, 5, 6, 9) for m in (STATUS.search(r.getMessage()) for r in caplog.records) if m]
    assert lines == [(str(r[rk.BUCKET_ITERATION]), "2", "3", str(r[rk.LIVE]), str(r[rk.ROWS]), r[rk.ROUTE], "0")
                     for r in results]
    # Two members of three slots: the iterations gathered their two rows.
    assert [r[rk.ROWS] for r in results] == [2, 2]


def test_a_status_line_counts_every_trained_member_s_batches_the_last_iteration_included(caplog):
    caplog.set_level(logging.INFO, logger="chorus_tune.tune.actors.bucket_actor")

    async def scenario():
        bucket = make_bucket(2)
        # The members finish (and free their slots) in the iteration of their budget.
        await seat(bucket, "ab", Plan(budget=2, bucket_decides=True))
        await until(lambda: bucket.iterations == 2)

    asyncio.run(scenario())
    lines = [m for m in (STATUS.search(r.getMessage()) for r in caplog.records) if m]
    assert len(lines) == 2
    batch = digits_task().batch_size
    for line in lines:
        step_s = float(line.group(7)) / 1000
        # As printed: step time to 0.01 ms, samples/s to 1.
        assert float(line.group(8)) == pytest.approx(int(line.group(4)) * batch / step_s, rel=0.02, abs=1)


def test_a_member_that_leaves_with_unread_results_is_logged_as_wasted(caplog):
    caplog.set_level(logging.INFO, logger="chorus_tune.tune.actors.bucket_actor")

    async def scenario():
        bucket = make_bucket(1)
        await seat(bucket, "a", Plan(run_ahead=2))
        await until(lambda: bucket.book.get("a").produced == 2)
        await bucket.leave("a")
        return bucket

    bucket = asyncio.run(scenario())
    assert bucket.book.wasted == 2
    assert "test-bucket: member a left with 2 result(s) unread, wasted 2" in caplog.messages


def test_an_idle_bucket_sets_its_gauges_again_every_reap_interval():
    # Ray drops a gauge it does not hear again within seconds (metrics.BucketMetrics.refresh):
    # an idle bucket must keep saying what it holds.
    async def scenario():
        bucket = make_bucket(2, reap_interval_s=0.05)
        refreshed = []
        bucket.metrics.refresh = lambda: refreshed.append(1)
        await bucket.expect("a", None, None)  # starts the bucket's loops; nothing trains
        await until(lambda: len(refreshed) >= 3, timeout=10)
        await bucket.close()
        return refreshed

    assert len(asyncio.run(scenario())) >= 3


def test_one_fetch_brings_every_queued_result_and_a_save_holds_the_member_at_the_iteration_tune_read():
    # A trial fetches its member's queued results in one call and hands them to
    # Tune one per step; a checkpoint after the 2nd must hold the member at 2.
    async def scenario():
        bucket = make_bucket(2)
        await seat(bucket, "ab", Plan(budget=5, bucket_decides=True))
        await until(lambda: bucket.book.get("a").produced == 5)
        fetched = await bucket.next_results("a")
        return fetched, state_io.loads(await bucket.save("a", at=2))

    fetched, state = asyncio.run(scenario())
    assert [r["iteration"] for r in fetched] == [1, 2, 3, 4, 5]
    assert [r[rk.AHEAD] for r in fetched] == [4, 3, 2, 1, 0] and fetched[-1]["done"] is True
    for ours, theirs in zip(fetched, reference_history("a", 5)):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=RTOL)
    assert state["iteration"] == 2
    from chorus_tune import Bucket

    resumed = Bucket(digits_task(), 1)
    slot = resumed.restore(state)
    out = resumed.run_iteration()[slot]
    assert out["iteration"] == 3
    assert out["val_loss"] == pytest.approx(reference_history("a", 3)[-1]["val_loss"], rel=RTOL)


def test_a_trial_that_leaves_holding_fetched_results_wastes_those_tune_never_read():
    async def scenario():
        bucket = make_bucket(1)
        # Iterations 1-6 known clear (the run's other buckets saw trials
        # continued past each, docs/design.md D4): the member trains to 6.
        bucket.book.stops.seen_elsewhere({}, {t: 4 for t in range(1, 7)})
        await seat(bucket, "a", Plan(budget=6, speculate=True, clear_after=4))
        await until(lambda: bucket.book.get("a").produced == 6)
        assert len(await bucket.next_results("a")) == 6
        await bucket.leave("a", read=2)  # Tune stopped it after its 2nd result
        return bucket

    bucket = asyncio.run(scenario())
    assert bucket.book.wasted == 4
    assert bucket.book.stops.points == (2,)  # where Tune stopped it, not where the fetch reached


def test_an_evicted_member_still_saves_at_each_iteration_its_trial_fetched_and_at_no_other():
    async def scenario():
        bucket = make_bucket(1)
        await seat(bucket, "a", Plan(run_ahead=3))
        await until(lambda: bucket.book.get("a").produced == 3)
        fetched = await bucket.next_results("a")
        await until(lambda: bucket.book.get("a").produced == 4)  # one more, not fetched
        assert await bucket.evict_idle(0.0) == ["a"]
        saved = {t: state_io.loads(await bucket.save("a", at=t))["iteration"] for t in (1, 2, 3)}
        with pytest.raises(MemberError, match="at iteration 4"):
            await bucket.save("a", at=4)
        return fetched, saved

    fetched, saved = asyncio.run(scenario())
    assert [r["iteration"] for r in fetched] == [1, 2, 3]
    assert saved == {1: 1, 2: 2, 3: 3}


def test_a_bucket_warms_its_unfused_path_once_while_members_wait_after_their_first_iteration():
    # Warmed before the first iteration, it would delay the first results; warmed
    # on every wait, it would take CPU from the trials each time.
    async def scenario():
        bucket = make_bucket(2)
        bucket.book.stops.stop(1)  # Tune stopped a trial of the run: a stock scheduler decides
        calls = []
        warm = bucket.core.warm_unfused
        bucket.core.warm_unfused = lambda: calls.append(bucket.iterations) or warm()
        await seat(bucket, "ab", Plan(run_ahead=1))
        await until(lambda: bucket.book.get("a").produced >= 1 and bucket.book.get("b").produced >= 1)
        await until(lambda: bool(calls))
        for _ in range(2):  # reads wake the bucket, which trains and waits again
            await asyncio.gather(bucket.next_result("a"), bucket.next_result("b"))
        await until(lambda: bucket.book.get("a").produced >= 3)
        await asyncio.sleep(0.1)
        return calls

    calls = asyncio.run(scenario())
    assert len(calls) == 1 and calls[0] >= 1


def test_a_bucket_does_not_warm_its_unfused_path_while_no_trial_of_the_run_was_stopped():
    # Under FIFO a bucket waits only for its trials' round trip; a warming in
    # its training thread would hold up the next fused iteration.
    async def scenario():
        bucket = make_bucket(2)
        calls = []
        bucket.core.warm_unfused = lambda: calls.append(bucket.iterations)
        await seat(bucket, "ab", Plan(run_ahead=1))
        for _ in range(2):
            await asyncio.gather(bucket.next_result("a"), bucket.next_result("b"))
        await until(lambda: bucket.book.get("a").produced >= 3)
        await asyncio.sleep(0.1)
        return calls

    assert asyncio.run(scenario()) == []


class _RefillingPool:
    """Stands in for the pool: a member that finishes frees its slot, and the
    pool places ``refill`` there, whose expect reaches the bucket ``delay_s``
    after the pool's answer (as the pool's realize task sends it)."""

    def __init__(self, bucket: ChorusBucket, refill: str, plan: Plan, delay_s: float = 0.05):
        self.bucket, self.refill, self.plan, self.delay_s = bucket, refill, plan, delay_s
        self.placed = False

    def __getattr__(self, name):
        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                return self._call(name, *args)
        return _Method()

    def _call(self, name, *args):
        if name != "member_out":
            return None  # the bucket's other calls to the pool are not waited for

        async def answer():
            if self.placed:
                return []
            self.placed = True

            async def expect_later():
                await asyncio.sleep(self.delay_s)
                await self.bucket.expect_all([(self.refill, None, join(self.refill, self.plan))])

            asyncio.get_running_loop().create_task(expect_later())
            return [self.refill]
        return answer()


def test_a_refill_the_pool_placed_trains_with_the_members_in_slots_not_an_iteration_later():
    async def scenario():
        bucket = make_bucket(2, gather_s=1.0)  # a refill is waited for at most gather_s
        bucket._pool = _RefillingPool(bucket, "c", Plan(budget=3))
        await bucket.expect_all([("a", None, join("a", Plan(budget=1))), ("b", None, join("b", Plan(budget=3)))])
        await until(lambda: bucket.book.get("c") is not None and bucket.book.get("c").produced >= 1)
        b = [await bucket.next_result("b") for _ in range(2)]
        c = await bucket.next_result("c")
        return b, c

    b, c = asyncio.run(scenario())
    assert c[rk.BUCKET_ITERATION] == b[1][rk.BUCKET_ITERATION] == 2
    expected = reference_history("c", 1)
    assert c["val_loss"] == pytest.approx(expected[0]["val_loss"], rel=RTOL)


RANKED = Plan(run_ahead=2, budget=3, speculate=True, metric="val_loss", sign=-1.0)


async def _first_and_second(bucket: ChorusBucket) -> tuple[str, str, asyncio.Task]:
    """Two trials wait for iteration 1 of an unsettled run: who read first, and the other's pending read."""
    reads = {m: asyncio.create_task(bucket.next_result(m)) for m in "ab"}
    done, _ = await asyncio.wait(reads.values(), return_when=asyncio.FIRST_COMPLETED)
    first = next(m for m, task in reads.items() if task in done)
    second = "b" if first == "a" else "a"
    return first, second, reads[second]


def test_a_held_read_is_answered_when_the_first_readers_trial_asks_again():
    # rules/read_order.py: the lowest waiting trial reads after Tune decided the first.
    async def scenario():
        bucket = make_bucket(2, gather_s=2.0)  # the first's next iteration waits for the second: no answer from it
        await seat(bucket, "ab", RANKED)
        first, second, pending = await _first_and_second(bucket)
        await asyncio.sleep(0.1)
        held = not pending.done()
        asking = asyncio.create_task(bucket.next_result(first))  # Tune continued the first
        result = await asyncio.wait_for(pending, timeout=0.3)  # before the hold (0.5 s) ends
        asking.cancel()
        await bucket.close()
        return held, result, first

    held, result, first = asyncio.run(scenario())
    assert held and result[rk.ITERATION] == 1 and first != result[rk.MEMBER]


def test_a_held_read_is_answered_when_its_hold_ends_without_a_decision():
    async def scenario():
        bucket = make_bucket(2)
        await seat(bucket, "ab", RANKED)
        _, _, pending = await _first_and_second(bucket)
        result = await asyncio.wait_for(pending, timeout=5)  # the first's trial never asks again
        await bucket.close()
        return result

    assert asyncio.run(scenario())[rk.ITERATION] == 1
