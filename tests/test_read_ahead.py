"""Reading results ahead of Tune (Ray-free): a trial fetches every result its
member has queued in one call and its steps return them one at a time
(``ReadAhead``); the bucket keeps them queued, with their states, until the
trial says how far Tune read (``MemberBook.read_to``). docs/design.md D3, D4."""
from __future__ import annotations

import pytest

from chorus_tune.tune.rules.members import MemberBook
from chorus_tune.tune.trial.read_ahead import ReadAhead
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values.plan import Plan


def results(*iterations: int, done_at: int | None = None) -> list[dict]:
    return [{rk.ITERATION: t, "val_loss": 1.0 / t, **({"done": True} if t == done_at else {})}
            for t in iterations]


# ----- the trial's side ------------------------------------------------------------------------------
def test_steps_return_the_fetched_results_one_at_a_time_in_order():
    reads = ReadAhead()
    reads.fill(results(1, 2, 3))
    assert [reads.take()[rk.ITERATION] for _ in range(3)] == [1, 2, 3]
    assert reads.take() is None and reads.empty


def test_read_is_the_iteration_of_the_last_result_handed_to_tune_not_the_last_fetched():
    reads = ReadAhead()
    assert reads.read is None
    reads.fill(results(4, 5, 6))
    reads.take()
    assert reads.read == 4 and len(reads) == 2


def test_dropping_forgets_what_was_fetched_and_says_where_tune_read():
    reads = ReadAhead()
    reads.fill(results(1, 2, 3))
    reads.take(), reads.take()
    assert reads.drop() == 2
    assert reads.empty and reads.read is None and reads.take() is None


def test_nothing_fetched_after_a_last_result_is_kept():
    reads = ReadAhead()
    reads.fill(results(1, 2, 3, done_at=2))
    assert [reads.take()[rk.ITERATION] for _ in range(2)] == [1, 2] and reads.take() is None


def test_a_fetch_while_fetched_results_are_still_held_is_refused():
    # The bucket learns what Tune read from the trial's reports, in order: a
    # second fetch would skip results the first one brought.
    reads = ReadAhead()
    reads.fill(results(1, 2))
    reads.take()
    with pytest.raises(RuntimeError, match="still held results"):
        reads.fill(results(3))


def test_a_retired_answer_leaves_what_was_read_as_it_was():
    # Not a result: it says the member trains no more, with the iteration its
    # bucket last delivered (0 for one whose trial left while it was built).
    reads = ReadAhead()
    reads.fill(results(3))
    reads.take()
    reads.fill([{rk.ITERATION: 0, rk.RETIRED: True, "done": True}])
    reads.take()
    assert reads.read == 3


# ----- the bucket's side -----------------------------------------------------------------------------
def book_with(plan: Plan, n: int = 1) -> MemberBook:
    """``n`` members of ``plan``. A speculating plan's iterations are known
    clear of Tune's decisions up to its budget, as if the run's other buckets
    had seen ``clear_after`` trials continued past each (docs/design.md D4),
    so its members train ahead to the budget and have results to fetch."""
    book = MemberBook(max_queue=64, gather_s=0.0)
    if plan.speculate and plan.budget:
        book.stops.seen_elsewhere({}, {t: plan.clear_after for t in range(1, plan.budget + 1)})
    for i in range(n):
        book.reserve(f"m{i}", plan)
        book.place(f"m{i}", slot=i, iteration=0)
        book.attach(f"m{i}")
    return book


def train(book: MemberBook, iterations: int) -> None:
    for _ in range(iterations):
        chosen, _ = book.next_iteration(0.0, gather=False)
        book.started(chosen)
        book.record({r.member: ({rk.ITERATION: r.produced + 1}, f"state-{r.member}-{r.produced + 1}")
                     for r in chosen})


def fetch(book: MemberBook, member: str, read: int | None) -> list[int]:
    """What ChorusBucket.next_results hands a trial: the next result, and every one queued behind it."""
    book.read_to(member, read)
    first = book.ask(member)
    return [first.iteration] + [e.iteration for e in book.get(member).queue]


def test_fetched_results_stay_queued_with_their_states_until_the_trial_says_tune_read_them():
    book = book_with(Plan(budget=5, bucket_decides=True))
    train(book, 5)
    assert fetch(book, "m0", None) == [1, 2, 3, 4, 5]
    record = book.get("m0")
    assert record.taken == 1 and len(record.queue) == 4
    book.read_to("m0", 3)
    assert record.taken == 3 and record.state_at_taken == "state-m0-3" and len(record.queue) == 2


def test_reading_to_an_iteration_counts_tune_continuing_each_result_as_asking_one_by_one_does():
    plan = Plan(budget=6, speculate=True)
    one_by_one, fetched = book_with(plan), book_with(plan)
    train(one_by_one, 6), train(fetched, 6)
    for _ in range(4):
        one_by_one.ask("m0")
    fetch(fetched, "m0", None)
    fetch(fetched, "m0", 3)  # Tune read 1-3 from the first fetch and asked for a 4th
    assert fetched.stops.continued == one_by_one.stops.continued == {1: 1, 2: 1, 3: 1}
    assert fetched.get("m0").asked == one_by_one.get("m0").asked == 4


def test_a_trial_stopped_holding_fetched_results_wastes_them_and_teaches_the_point_it_stopped_at():
    book = book_with(Plan(budget=10, speculate=True))
    train(book, 10)
    assert fetch(book, "m0", None) == list(range(1, 11))
    book.read_to("m0", 2)  # Tune stopped the trial after its 2nd result: its leave says so
    book.leave("m0")
    assert book.wasted == 8
    assert book.stops.stopped == {2: 1} and book.stops.points == (2,)


def test_a_trial_that_hands_tune_every_fetched_result_wastes_nothing_and_teaches_no_point():
    book = book_with(Plan(budget=4, speculate=True))
    train(book, 4)
    fetch(book, "m0", None)
    book.read_to("m0", 4)
    book.leave("m0")
    assert book.wasted == 0 and book.stops.points == ()


def test_reading_to_an_iteration_read_already_changes_nothing():
    book = book_with(Plan(budget=4, bucket_decides=True))
    train(book, 4)
    fetch(book, "m0", None)
    book.read_to("m0", 2)
    before = (book.get("m0").taken, book.get("m0").asked, dict(book.stops.continued))
    book.read_to("m0", 1), book.read_to("m0", None)
    assert (book.get("m0").taken, book.get("m0").asked, dict(book.stops.continued)) == before
