"""Survivors move together, in the bucket actors (driven directly, in this process).

A member taken out of one bucket between iterations goes on, built from its
state, in another bucket of its structure; the results it had queued stay
in the old bucket for its trial to read first, and then the trial hears
``Moved`` and reads on in the new one. Every result follows
``reference.train`` on the route the test pins (docs/design.md D3, D12).
"""
from __future__ import annotations

import asyncio
import time

import pytest
import ray.cloudpickle as cloudpickle
from test_bucket_actor import RTOL, Gate, join, reference_history, until

from chorus_tune import reference
from chorus_tune.tune.actors.bucket_actor import ChorusBucket
from chorus_tune.tune.rules.members import Phase
from chorus_tune.tune.rules.regrouping import Moved
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values import state_io
from chorus_tune.tune.values.options import BucketOptions
from chorus_tune.tune.values.plan import Plan

from tune_support import digits_task

pytestmark = pytest.mark.usefixtures("local_ray")  # the buckets' metrics need a Ray instance

BUDGET = 5
PLAN = Plan(budget=BUDGET, bucket_decides=True)


def make(name: str, capacity: int, route: str = "vmap") -> ChorusBucket:
    options = BucketOptions(bucket_size=capacity, route=route, gather_s=0.0, reap_interval_s=60.0)
    return ChorusBucket(name, cloudpickle.dumps(digits_task()), options, "Sequential")


async def take_out_waiting(bucket: ChorusBucket) -> None:
    """Until a call waits for ``bucket``'s lock (held by its running iteration)."""
    await until(lambda: bool(getattr(bucket._lock, "_waiters", None)))


async def moved_after_first_iteration(source: ChorusBucket, dest: ChorusBucket, members: str,
                                      reserved: bool = False, stay: str = "") -> list[dict]:
    """Move ``members`` from ``source`` to ``dest`` as the pool does, right after
    the source's first iteration (held at a gate until the take-out waits for it).
    ``reserved``: ``dest`` holds their slots already; ``stay``: members seated
    with them that stay in ``source``."""
    if not reserved:
        assert await dest.reserve_moved(list(members), list(dest._holds()))
    gate = Gate(source._train)
    source._train = gate
    await source.expect_all([(m, None, join(m, PLAN)) for m in members + stay])
    await gate.reached()
    taking = asyncio.ensure_future(source.take_out(dict.fromkeys(members), list(members + stay), dest.name))
    await take_out_waiting(source)
    gate.opened.set()
    items = await taking
    assert items is not None
    await dest.move_in(items)
    return items


async def read_through(member: str, source: ChorusBucket, dest: ChorusBucket) -> list[dict]:
    """What the member's trial reads: the source's queue, then (after Moved) the new bucket's."""
    results, bucket = [], source
    while len(results) < BUDGET:
        try:
            results.append(await bucket.next_result(member))
        except Moved:
            assert bucket is source
            bucket = dest
    return results


@pytest.mark.parametrize("route", ["vmap", "eager"])
def test_a_moved_member_reads_on_in_its_new_bucket_on_its_reference_trajectory(route):
    async def scenario():
        source, dest = make("src", 4, route), make("dst", 4, route)
        # The slots held first: c then waits for them (a bucket trains members moving in
        # with its own from their first iteration there).
        assert await dest.reserve_moved(["a", "b"], [])
        await dest.expect("c", None, join("c", PLAN))
        # Built one after the other: models are built under the global RNG's seed, and
        # two buckets in one process (unlike two actors) would build at once.
        await until(lambda: dest.book.get("c").phase is not Phase.RESERVED)
        await moved_after_first_iteration(source, dest, "ab", reserved=True, stay="d")
        reads = {m: await read_through(m, source, dest) for m in "ab"}
        reads["c"] = [await dest.next_result("c") for _ in range(BUDGET)]
        reads["d"] = [await source.next_result("d") for _ in range(BUDGET)]  # trains on where it was
        return reads, source, dest

    reads, source, dest = asyncio.run(scenario())
    for member, results in reads.items():
        history = reference_history(member, BUDGET)
        assert [r["iteration"] for r in results] == list(range(1, BUDGET + 1))
        for ours, theirs in zip(results, history):
            assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=RTOL), (member, ours["iteration"])
    # Iteration 1 was computed (and read) in the old bucket, the rest in the new one.
    assert [r[rk.BUCKET] for r in reads["a"]] == ["src"] + ["dst"] * (BUDGET - 1)
    assert [r[rk.LIVE] for r in reads["c"]] == [3] * (BUDGET - 1) + [1]  # a and b finished one ahead of c
    assert [r[rk.LIVE] for r in reads["d"]] == [3] + [1] * (BUDGET - 1)


def test_an_old_bucket_keeps_a_moved_members_unread_results_and_drains_once_they_are_read():
    async def scenario():
        source, dest = make("src", 2), make("dst", 4)
        await moved_after_first_iteration(source, dest, "ab")
        before = await source.drained()
        record = source.book.get("a")
        queued = (record.phase, len(record.queue))
        for member in "ab":
            await read_through(member, source, dest)
        return before, queued, await source.drained(), source.book.get("a").phase

    before, queued, after, phase = asyncio.run(scenario())
    assert not before and queued == (Phase.FINISHED, 1)
    assert after and phase is Phase.LEFT


def test_a_checkpoint_after_a_move_holds_the_member_at_its_last_result_read():
    async def scenario():
        source, dest = make("src", 2), make("dst", 2)
        await moved_after_first_iteration(source, dest, "a")
        first = await source.next_result("a")
        at_one = state_io.loads(await source.save("a"))  # the old bucket still serves it: exact at 1
        with pytest.raises(Moved):
            await source.next_result("a")
        with pytest.raises(Moved):
            await source.save("a")  # gone from there: its new bucket has it
        second = await dest.next_result("a")
        return first, second, at_one, state_io.loads(await dest.save("a"))

    first, second, at_one, at_two = asyncio.run(scenario())
    assert (first["iteration"], second["iteration"]) == (1, 2)
    assert (at_one["iteration"], at_two["iteration"]) == (1, 2)
    from chorus_tune import Bucket

    resumed = Bucket(digits_task(), 1)
    slot = resumed.restore(at_two)
    out = resumed.run_iteration()[slot]
    assert out["val_loss"] == pytest.approx(reference_history("a", 3)[-1]["val_loss"], rel=RTOL)


def test_a_member_held_alone_at_a_rung_moves_held_and_trains_on_only_once_its_trial_asks_past_it():
    rung = Plan(budget=BUDGET, bucket_decides=True, rungs=(2,), reduction_factor=4.0, metric="val_loss", sign=-1.0)

    async def scenario():
        source, dest = make("src", 2), make("dst", 2)
        await source.expect("a", None, join("a", rung))
        await until(lambda: (r := source.book.get("a")) is not None and r.phase is Phase.HELD)
        assert await dest.reserve_moved(["a"], [])
        items = await source.take_out({"a": None}, ["a"], dest.name)
        await dest.move_in(items)
        await until(lambda: dest.book.get("a").phase is not Phase.RESERVED)
        await asyncio.sleep(0.5)  # time to train on, were it not held
        held = (dest.book.get("a").phase, dest.book.get("a").produced, dest.iterations)
        reads = await read_through("a", source, dest)
        return items[0]["held_at"], held, reads

    held_at, (phase, produced, iterations), reads = asyncio.run(scenario())
    assert held_at == 2 and (phase, produced, iterations) == (Phase.HELD, 2, 0)
    assert [r[rk.BUCKET] for r in reads] == ["src", "src"] + ["dst"] * (BUDGET - 2)
    for ours, theirs in zip(reads, reference_history("a", BUDGET)):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=RTOL), ours["iteration"]


def test_a_take_out_is_refused_while_the_pool_and_the_bucket_disagree_on_its_members():
    async def scenario():
        source = make("src", 4)
        gate = Gate(source._train)
        source._train = gate
        await source.expect_all([(m, None, join(m, PLAN)) for m in "ab"])
        await gate.reached()
        taking = asyncio.ensure_future(source.take_out({"a": None}, ["a"], "dst"))  # the pool thinks b left
        await take_out_waiting(source)
        gate.opened.set()
        return await taking, source.book.get("a").phase

    refused, phase = asyncio.run(scenario())
    assert refused is None and phase is Phase.TRAINING


def test_a_take_out_that_would_split_a_cohort_is_refused():
    rungs = Plan(budget=8, bucket_decides=True, rungs=(4,), reduction_factor=4.0, metric="val_loss", sign=-1.0)

    async def scenario():
        source = make("src", 4)
        gate = Gate(source._train)
        source._train = gate
        await source.expect_all([(m, None, join(m, rungs)) for m in "abcd"])
        await gate.reached()
        taking = asyncio.ensure_future(source.take_out({"a": None, "b": None}, list("abcd"), "dst"))
        await take_out_waiting(source)
        gate.opened.set()
        return await taking

    assert asyncio.run(scenario()) is None


def test_a_bucket_holds_no_slot_it_lacks_for_members_moving_in():
    async def scenario():
        dest = make("dst", 2)
        # Members that never finish: a finished member holds no slot, and under
        # load a short budget ran out before the last reserve (CI saw it).
        endless = Plan(budget=10_000, bucket_decides=True)
        await dest.expect_all([(m, None, join(m, endless)) for m in "ab"])
        await until(lambda: all(r.phase is not Phase.RESERVED for r in dest.book.records.values()))
        full = await dest.reserve_moved(["c"], ["a", "b"])
        await dest.leave("b")
        disagrees = await dest.reserve_moved(["c"], ["a", "b"])  # the pool has not heard b left
        agrees = await dest.reserve_moved(["c"], ["a"])
        return full, disagrees, agrees

    assert asyncio.run(scenario()) == (False, False, True)


def read_on(trial, results: list[dict], moved_away_from: str, limit: int = 300) -> None:
    """``trial`` steps (a ChorusTrainable, following its member if it moves) until
    three results came from a bucket other than ``moved_away_from``."""
    while sum(r[rk.BUCKET] != moved_away_from for r in results) < 3:
        assert len(results) < limit, f"{trial.trial_id}'s member never moved"
        results.append(trial.step())


def test_a_sparse_buckets_members_move_into_another_of_their_key_and_their_trials_follow_them(tmp_path):
    # End to end through the pool actor, two bucket actors and two
    # ChorusTrainables (stepped here, as Tune steps them): six members seated
    # in buckets of four (four and two); two of the first leave. The pool
    # moves the second bucket's two members into the first, and the second
    # closes once their unread results are read. One trial had read a result
    # there; the other starts only after the move and is sent there first.
    # Each reads the old bucket's queue, hears Moved, and reads on in the new
    # one, every result on its reference; a checkpoint then is exact.
    import ray

    from chorus_tune.tune import ChorusTrainable
    from chorus_tune.tune.client import get_pool

    trainable = ChorusTrainable.for_task(digits_task(), bucket_size=4, max_buckets=2, route="vmap", gather_s=0.0,
                                         idle_close_s=0.5)
    options = trainable.bucket_options()
    plan = Plan(budget=10_000, bucket_decides=True)  # trains on while the test reads: left at its end
    pool = get_pool(create=True)
    seats = [(f"rg{i}", {"lr": 0.05 * (i + 1), "seed": i}, i) for i in range(6)]
    seated = ray.get(pool.seat.remote(seats, trainable._task_id, trainable._task_blob, options, plan))
    assert set(seated.values()) == {"seated"}
    source, _ = ray.get(pool.await_placement.remote("rg4"), timeout=120)

    def trial_for(member: str):
        named = type(f"reads_{member}", (trainable,), {"trial_id": f"trial-{member}"})
        reader = named(config=dict(seats[int(member[2:])][1]))
        assert ray.get(pool.bind.remote(reader.trial_id, [member])) == member
        return reader

    early_trial = trial_for("rg4")
    early = [early_trial.step()]  # read before the move
    for member in ("rg1", "rg2"):
        ray.get(pool.leave.remote(member))
    read_on(early_trial, early, moved_away_from=source)
    late_trial = trial_for("rg5")  # starts only now
    late: list[dict] = []
    read_on(late_trial, late, moved_away_from=source)
    checkpoint = early_trial.save_checkpoint(str(tmp_path))
    stats = ray.get(pool.stats.remote())
    for trial in (early_trial, late_trial):
        trial.cleanup()
    for member in ("rg0", "rg3"):
        ray.get(pool.leave.remote(member))
    dest = early[-1][rk.BUCKET]
    assert dest != source and late[0][rk.BUCKET] == source and late[-1][rk.BUCKET] == dest
    assert stats[source]["moved_out"] == 2 and stats[source]["regroups"] == 1 and stats[dest]["moved_in"] == 2
    for member, results in (("rg4", early), ("rg5", late)):
        assert [r["iteration"] for r in results] == list(range(1, len(results) + 1))
        config, seed = seats[int(member[2:])][1:]
        history, _ = reference.train(digits_task(), config, seed=seed, iterations=len(results))
        for ours, theirs in zip(results, history):
            assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=RTOL), (member, ours["iteration"])
    assert state_io.loads(checkpoint["member"])["iteration"] == len(early)
    deadline = time.monotonic() + 60.0  # not a timing assertion: a wait that must end
    while not ray.get(pool.stats.remote())[source]["closed"]:
        assert time.monotonic() < deadline, "the emptied bucket never closed"
        time.sleep(0.2)
