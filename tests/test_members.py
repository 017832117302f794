"""The bucket's member rules (Ray-free): run-ahead bounds, rungs, holds, waste, gathering."""
from __future__ import annotations

import math

import pytest

from chorus_tune.tune.rules.members import MemberBook, Phase
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values.plan import Plan


def book_with(plan: Plan, n: int, max_queue: int = 64, gather_s: float = 0.0) -> MemberBook:
    book = MemberBook(max_queue=max_queue, gather_s=gather_s)
    for i in range(n):
        book.reserve(f"m{i}", plan)
        book.place(f"m{i}", slot=i, iteration=0)
    return book


def run(book: MemberBook, scores: dict[str, float] | None = None, now: float = 0.0) -> list[str]:
    """One fused iteration of whoever may train; returns who trained."""
    chosen, wait = book.next_iteration(now)
    assert wait is None
    book.started(chosen)
    outputs = {}
    for r in chosen:
        value = (scores or {}).get(r.member, 0.5)
        outputs[r.member] = ({"val_loss": value, "iteration": r.produced + 1}, f"state-{r.member}-{r.produced + 1}")
    book.record(outputs)
    return sorted(outputs)


def run_until_idle(book: MemberBook, scores=None, limit: int = 100) -> int:
    n = 0
    while book.runnable() and n < limit:
        run(book, scores)
        n += 1
    return n


def test_without_a_trial_a_member_runs_at_most_run_ahead_iterations():
    book = book_with(Plan(run_ahead=2), 2)
    assert run_until_idle(book) == 2
    assert [book.get(m).produced for m in ("m0", "m1")] == [2, 2]


def test_run_ahead_zero_computes_only_what_the_trial_asked_for():
    book = book_with(Plan(run_ahead=0), 1)
    assert run_until_idle(book) == 0
    assert book.ask("m0") is None
    assert run(book) == ["m0"]
    entry = book.deliver("m0")
    assert entry.iteration == 1 and not book.runnable()


def test_each_read_lets_a_bounded_member_compute_one_more():
    book = book_with(Plan(run_ahead=2), 1)
    run_until_idle(book)
    entry = book.ask("m0")
    assert entry.iteration == 1
    assert run_until_idle(book) == 1
    assert book.get("m0").produced == 3


def test_a_known_budget_runs_to_the_end_without_a_trial_and_frees_the_slot():
    book = book_with(Plan(budget=5, bucket_decides=True), 2)
    assert run_until_idle(book) == 5
    record = book.get("m0")
    assert record.phase is Phase.FINISHED and record.slot is None
    assert [e.iteration for e in record.queue] == [1, 2, 3, 4, 5]
    assert record.queue[-1].result["done"] is True
    assert all("done" not in e.result for e in list(record.queue)[:-1])


def test_budget_caps_a_bounded_member_too():
    book = book_with(Plan(run_ahead=10, budget=3), 1)
    assert run_until_idle(book) == 3
    assert book.get("m0").phase is Phase.FINISHED


def test_a_cohort_reaching_a_rung_together_is_halved_there():
    plan = Plan(budget=8, bucket_decides=True, rungs=(2,), reduction_factor=4, metric="val_loss", sign=-1.0)
    book = book_with(plan, 8)
    scores = {f"m{i}": float(i) for i in range(8)}  # m0 best (lowest loss)
    run_until_idle(book, scores)
    survivors = [m for m, r in book.records.items() if r.produced == 8]
    assert survivors == ["m0", "m1"]
    for i in range(2, 8):
        record = book.get(f"m{i}")
        assert record.produced == 2 and record.phase is Phase.FINISHED
        assert record.queue[-1].result[rk.DECISION] == "STOP"
    rung_results = [book.get(f"m{i}").queue[1].result for i in range(8)]
    assert [r[rk.COHORT_RANK] for r in rung_results] == list(range(1, 9))
    assert all(r[rk.COHORT_SIZE] == 8 for r in rung_results)
    assert rung_results[0][rk.DECISION] == "CONTINUE"


def test_nan_ranks_last_in_a_cohort():
    plan = Plan(budget=4, bucket_decides=True, rungs=(1,), reduction_factor=2, metric="val_loss", sign=-1.0)
    book = book_with(plan, 2)
    run(book, {"m0": math.nan, "m1": 3.0})
    assert book.get("m0").phase is Phase.FINISHED
    assert book.get("m1").phase is Phase.TRAINING


def test_a_member_alone_at_a_rung_is_held_until_its_trial_asks_beyond_it():
    plan = Plan(budget=6, bucket_decides=True, rungs=(2,), metric="val_loss", sign=-1.0)
    book = book_with(plan, 1)
    assert run_until_idle(book) == 2
    record = book.get("m0")
    assert record.phase is Phase.HELD and record.queue[-1].result[rk.DECISION] == rk.HELD
    assert book.ask("m0").iteration == 1
    assert book.ask("m0").iteration == 2
    assert record.phase is Phase.HELD and not book.runnable()  # its trial read the rung result: Tune decides
    assert book.ask("m0") is None  # Tune continued it: it asks for iteration 3
    assert record.phase is Phase.TRAINING
    assert run_until_idle(book) == 4 and record.produced == 6


def test_a_member_moved_in_while_held_at_a_rung_stays_held_until_its_trial_asks_beyond_it():
    plan = Plan(budget=6, bucket_decides=True, rungs=(2,), metric="val_loss", sign=-1.0)
    book = MemberBook(gather_s=0.0)
    book.reserve("m0", plan)
    record = book.place("m0", slot=0, iteration=2, held_at=2)  # its rung result waits in its old bucket
    assert record.phase is Phase.HELD and not book.runnable()
    assert book.ask("m0") is None  # read there, continued by Tune: it asks here for iteration 3
    assert record.phase is Phase.TRAINING
    assert run_until_idle(book) == 4 and record.produced == 6


def test_a_member_cannot_be_placed_held_at_another_iteration_than_its_state():
    book = MemberBook()
    book.reserve("m0", Plan(budget=6, bucket_decides=True, rungs=(2,), metric="val_loss", sign=-1.0))
    with pytest.raises(ValueError, match="held at iteration 2"):
        book.place("m0", slot=0, iteration=3, held_at=2)


def test_leaving_counts_what_was_computed_and_never_read_as_wasted():
    book = book_with(Plan(run_ahead=2), 2)
    run_until_idle(book)
    book.ask("m0")
    assert book.leave("m0") == 0
    assert book.get("m0").wasted == 1 and book.wasted == 1
    assert book.leave("m0") is None and book.wasted == 1  # idempotent


def test_a_member_whose_trial_reads_everything_wastes_nothing():
    book = book_with(Plan(budget=3, bucket_decides=True), 1)
    run_until_idle(book)
    while book.get("m0").queue:
        book.ask("m0")
    book.leave("m0")
    assert book.wasted == 0


def test_the_state_saved_is_the_one_of_the_last_result_read():
    book = book_with(Plan(budget=5, bucket_decides=True), 1)
    run_until_idle(book)
    book.ask("m0"), book.ask("m0")
    assert book.get("m0").taken == 2
    assert book.get("m0").state_at_taken == "state-m0-2"


def test_queued_results_never_exceed_max_queue():
    book = book_with(Plan(budget=50, bucket_decides=True), 1, max_queue=3)
    assert run_until_idle(book) == 3
    book.ask("m0")
    assert run_until_idle(book) == 1


def test_gathering_waits_for_a_trial_about_to_ask_but_not_for_a_lagging_one():
    book = book_with(Plan(run_ahead=0), 2, gather_s=1.0)
    for m in ("m0", "m1"):
        book.attach(m)
    book.ask("m0")
    chosen, wait = book.next_iteration(now=0.0)
    assert chosen == [] and wait == pytest.approx(1.0)
    chosen, wait = book.next_iteration(now=1.5)  # m1 never asked: go without it
    assert [r.member for r in chosen] == ["m0"]
    book.started(chosen)
    assert book.get("m1").lagging
    book.record({"m0": ({"iteration": 1}, None)})
    book.deliver("m0")
    book.ask("m0")
    chosen, wait = book.next_iteration(now=2.0)  # a lagging member is not waited for
    assert [r.member for r in chosen] == ["m0"] and wait is None


def test_members_asking_together_train_in_one_iteration():
    book = book_with(Plan(run_ahead=0), 2, gather_s=1.0)
    for m in ("m0", "m1"):
        book.attach(m)
        book.ask(m)
    chosen, wait = book.next_iteration(now=0.0)
    assert sorted(r.member for r in chosen) == ["m0", "m1"]


def test_a_failed_member_raises_its_error_to_its_trial():
    book = MemberBook()
    book.reserve("m0", Plan())
    book.fail("m0", ValueError("factory refused"))
    with pytest.raises(ValueError, match="factory refused"):
        book.ask("m0")


def test_compaction_renumbers_slots():
    book = book_with(Plan(), 3)
    book.leave("m1")
    book.renumber({0: 0, 2: 1})
    assert book.get("m2").slot == 1 and book.get("m0").slot == 0


def test_plan_refuses_nonsense():
    with pytest.raises(ValueError, match="run_ahead"):
        Plan(run_ahead=-1)
    with pytest.raises(ValueError, match="budget"):
        Plan(bucket_decides=True)
    with pytest.raises(ValueError, match="metric"):
        Plan(rungs=(1,), budget=4, bucket_decides=True)


def test_a_member_reserved_for_a_starting_trial_is_waited_for_once():
    book = book_with(Plan(run_ahead=0), 1, gather_s=1.0)
    book.attach("m0")
    book.ask("m0")
    book.reserve("late", Plan(run_ahead=0))  # its trial is starting: it will join any moment
    chosen, wait = book.next_iteration(now=0.0)
    assert chosen == [] and wait == pytest.approx(1.0)
    chosen, _ = book.next_iteration(now=1.0)
    book.started(chosen)
    assert book.get("late").lagging  # it never came: not waited for again
    book.record({"m0": ({"iteration": 1}, None)})
    book.deliver("m0")
    book.ask("m0")
    assert [r.member for r in book.next_iteration(now=1.1)[0]] == ["m0"]


def test_a_member_that_left_keeps_no_state_in_the_book():
    # The bucket keeps a bounded few states of members that left; the book's
    # record of each member that ever left must not hold one too.
    book = book_with(Plan(budget=3, bucket_decides=True), 1)
    run_until_idle(book)
    book.ask("m0")
    assert book.get("m0").state_at_taken == "state-m0-1"
    book.leave("m0")
    assert book.get("m0").state_at_taken is None


def test_a_finished_member_read_to_the_end_is_drained_only_once_its_trial_leaves():
    # Tune saves a trial's checkpoint after its last result: the bucket must
    # stay open (not "drained") until the trial has left.
    book = book_with(Plan(run_ahead=2, budget=2, bucket_decides=True), 1)
    run_until_idle(book)
    assert book.get("m0").phase is Phase.FINISHED
    assert [book.ask("m0").iteration for _ in range(2)] == [1, 2]
    assert not book.get("m0").queue and not book.get("m0").drained
    book.leave("m0")
    assert book.get("m0") is None or book.get("m0").drained


def test_the_next_iteration_waits_for_a_refill_the_pool_placed_until_it_arrives():
    # Under ChorusASHA a halved cohort frees its slots at an iteration's end;
    # without the wait, the survivors trained an iteration alone before the refill came.
    book = book_with(Plan(), 1)
    book.expect_refill(["new"], until=0.5)
    chosen, wait = book.next_iteration(now=0.0)
    assert chosen == [] and wait == pytest.approx(0.5)
    book.reserve("new", Plan())  # the pool's expect arrived
    book.place("new", slot=1, iteration=0)
    chosen, wait = book.next_iteration(now=0.1)
    assert sorted(r.member for r in chosen) == ["m0", "new"] and wait is None


def test_a_refill_that_never_comes_is_waited_for_only_until_its_deadline():
    book = book_with(Plan(), 1)
    book.expect_refill(["lost"], until=0.5)
    chosen, wait = book.next_iteration(now=0.6)
    assert [r.member for r in chosen] == ["m0"] and wait is None
    assert book.next_iteration(now=0.0)[0]  # not waited for again, whatever the clock says


def test_a_refill_already_here_is_not_waited_for():
    book = book_with(Plan(), 2)
    book.expect_refill(["m1"], until=5.0)
    chosen, wait = book.next_iteration(now=0.0)
    assert sorted(r.member for r in chosen) == ["m0", "m1"] and wait is None


def test_only_an_iteration_that_gathers_waits_for_a_refill():
    book = book_with(Plan(), 1)
    book.expect_refill(["new"], until=0.5)
    chosen, wait = book.next_iteration(now=0.0, gather=False)
    assert [r.member for r in chosen] == ["m0"]
