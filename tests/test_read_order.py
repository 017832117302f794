"""Where trials wait together at an iteration Tune has not settled, one that is
not the lowest reads first and the lowest reads next, once Tune decided the
first (chorus_tune.tune.rules.read_order; docs/design.md D4), no Ray."""
from __future__ import annotations

from test_members import book_with, run

from chorus_tune.tune.rules.read_order import ReadOrder
from chorus_tune.tune.values.plan import Plan

RANKED = Plan(run_ahead=2, budget=10, speculate=True, metric="val_loss", sign=1.0)  # higher is better here


def undecided(member: str) -> bool:
    return False


def decided(member: str) -> bool:
    return True


# ----- the rule ---------------------------------------------------------------------------------
def test_a_trial_waiting_alone_reads_at_once():
    assert ReadOrder().hold("a", 1, 0.2, {}, undecided, now=0.0) is None


def test_the_lowest_of_the_trials_waiting_does_not_read_first():
    order = ReadOrder(hold_s=0.5)
    assert order.hold("low", 1, 0.2, {"high": 0.9}, undecided, now=0.0) == 0.5
    assert order.hold("high", 1, 0.9, {"low": 0.2}, undecided, now=0.0) is None


def test_the_next_read_waits_for_tunes_decision_on_the_first():
    order = ReadOrder(hold_s=0.5)
    order.hold("high", 1, 0.9, {"low": 0.2}, undecided, now=0.0)
    assert order.hold("low", 1, 0.2, {}, undecided, now=0.1) == 0.4
    assert order.hold("low", 1, 0.2, {}, decided, now=0.2) is None


def test_the_wait_for_that_decision_ends_at_hold_s():
    order = ReadOrder(hold_s=0.5)
    order.hold("high", 1, 0.9, {"low": 0.2}, undecided, now=0.0)
    assert order.hold("low", 1, 0.2, {}, undecided, now=0.5) is None


def test_after_the_first_the_lowest_reads_before_the_others():
    order = ReadOrder(hold_s=0.5)
    order.hold("lead", 1, 0.6, {"mid": 0.5, "low": 0.1}, undecided, now=0.0)
    assert order.hold("mid", 1, 0.5, {"low": 0.1}, decided, now=0.1) == 0.5
    assert order.hold("low", 1, 0.1, {"mid": 0.5}, decided, now=0.1) is None
    assert order.hold("mid", 1, 0.5, {}, undecided, now=0.1) is None  # the pair was read: any order now


def test_one_above_the_first_reads_when_none_below_it_waits():
    order = ReadOrder(hold_s=0.5)
    order.hold("lead", 1, 0.6, {}, undecided, now=0.0)
    assert order.hold("higher", 1, 0.8, {}, decided, now=0.1) is None


def test_each_iteration_has_its_own_order():
    order = ReadOrder(hold_s=0.5)
    order.hold("a", 1, 0.9, {}, undecided, now=0.0)
    assert order.hold("b", 2, 0.1, {}, undecided, now=0.0) is None


# ----- the book ---------------------------------------------------------------------------------
def ranked_book(n: int, plan: Plan = RANKED):
    book = book_with(plan, n)
    clock = [0.0]
    book.clock = lambda: clock[0]
    for i in range(n):
        book.attach(f"m{i}")
    return book, clock


def waiting_at_1(scores: dict[str, float], plan: Plan = RANKED):
    """A bucket whose members' trials all wait for iteration 1, computed with ``scores``."""
    book, clock = ranked_book(len(scores), plan)
    for member in scores:
        book.ask(member)
    run(book, scores)
    return book, clock


def test_the_lowest_waiting_trial_reads_only_after_the_first_was_decided():
    book, _ = waiting_at_1({"m0": 0.1, "m1": 0.9, "m2": 0.5})  # three trials wait for iteration 1
    assert book.deliver("m0") is None  # the lowest: not first
    assert book.deliver("m1").iteration == 1  # m1 leads
    assert book.deliver("m2") is None  # Tune has not decided m1 yet
    assert "m2" in book.held_until
    book.ask("m1")  # Tune continued m1
    assert book.deliver("m2") is None  # the lowest reads next
    assert book.deliver("m0").iteration == 1
    assert book.deliver("m2").iteration == 1
    assert book.held_until == {}


def test_a_stop_of_the_first_is_its_decision():
    book, _ = waiting_at_1({"m0": 0.9, "m1": 0.1})
    assert book.deliver("m0").iteration == 1
    assert book.deliver("m1") is None
    book.leave("m0")  # Tune stopped it
    assert book.deliver("m1").iteration == 1


def test_a_held_read_goes_ahead_once_its_hold_ends():
    book, clock = waiting_at_1({"m0": 0.9, "m1": 0.1})
    book.deliver("m0")
    assert book.deliver("m1") is None
    clock[0] = book.held_until["m1"]
    assert book.deliver("m1").iteration == 1


def test_reads_go_in_any_order_once_the_run_has_stopped_a_trial():
    book, _ = waiting_at_1({"m0": 0.1, "m1": 0.9, "m2": 0.5})
    book.stops.stop(4)  # a stop anywhere: the run is known to stop trials (D4's survivors' rule bounds waste)
    assert book.deliver("m0").iteration == 1


def test_reads_go_in_any_order_where_the_run_names_no_metric():
    book, _ = waiting_at_1({"m0": 0.1, "m1": 0.9}, Plan(run_ahead=2, budget=10, speculate=True))
    assert book.deliver("m0").iteration == 1


def test_reads_go_in_any_order_where_the_bucket_decides():
    book, _ = waiting_at_1({"m0": 0.1, "m1": 0.9}, Plan(budget=10, bucket_decides=True, metric="val_loss", sign=1.0))
    assert book.deliver("m0").iteration == 1


def test_results_a_trial_fetched_already_are_replayed_unordered():
    book, _ = waiting_at_1({"m0": 0.1, "m1": 0.9})
    book.read_to("m0", 1)  # its trial fetched iteration 1 before and says Tune read it
    assert book.get("m0").taken == 1


def test_a_minimised_metric_ranks_the_smallest_highest():
    book, _ = waiting_at_1({"m0": 0.1, "m1": 0.9},  # m1's loss is the worst
                           Plan(run_ahead=2, budget=10, speculate=True, metric="val_loss", sign=-1.0))
    assert book.deliver("m1") is None
    assert book.deliver("m0").iteration == 1


def test_reads_go_in_any_order_at_the_last_iteration():
    # Nothing trains past iteration 1: no order can spare anything.
    book, _ = waiting_at_1({"m0": 0.1, "m1": 0.9}, Plan(run_ahead=2, budget=1, speculate=True, metric="val_loss",
                                                        sign=1.0))
    assert book.deliver("m0").iteration == 1


def test_results_a_failed_member_fetched_are_replayed_unordered_and_the_replay_ends():
    # The replay of a failed member's fetched results delivered them ordered: held
    # behind a waiting rival, read_to looped for good.
    import threading

    book, _ = waiting_at_1({"m0": 0.1, "m1": 0.9})  # m0 is the lowest, m1 waits
    book.fail("m0", RuntimeError("its model broke"))
    replay = threading.Thread(target=book.read_to, args=("m0", 1), daemon=True)
    replay.start()
    replay.join(timeout=5)
    assert not replay.is_alive() and book.get("m0").taken == 1
