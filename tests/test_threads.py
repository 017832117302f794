"""A bucket trains on one thread or on all it is offered, whichever its own
iterations measured faster a step (chorus_tune.tune.rules.threads), no Ray."""
from __future__ import annotations

import pytest

from chorus_tune.tune.rules.threads import ThreadChoice

SLOW_MANY = {1: 1e-3, 2: 2e-3}  # the other core busy: OpenMP's threads wait on each other
FAST_MANY = {1: 1e-3, 2: 0.6e-3}


def run(choice: ThreadChoice, iterations: int, per_step: dict[int, float], rows: int = 16) -> list[int]:
    """The counts ``iterations`` iterations ran on, each at its cost in ``per_step``."""
    counts = []
    for _ in range(iterations):
        threads = choice.choose(rows)
        choice.observe(threads, rows, per_step[threads])
        counts.append(threads)
    return counts


def test_a_bucket_offered_one_thread_trains_on_one():
    assert run(ThreadChoice(offered=1), 3, SLOW_MANY) == [1, 1, 1]


def test_a_bucket_offered_more_measures_both_counts_back_to_back_and_keeps_the_faster():
    assert run(ThreadChoice(offered=2), 6, SLOW_MANY) == [1, 2, 1, 1, 1, 1]
    assert run(ThreadChoice(offered=2), 6, FAST_MANY) == [1, 2, 2, 2, 2, 2]


def test_one_thread_is_measured_first():
    # A bucket's first iteration holds back the run's first result, while the
    # other cores are busy starting the run: one thread is the safe count there.
    assert ThreadChoice(offered=2).choose(16) == 1


def test_more_threads_are_kept_only_when_clearly_faster():
    assert run(ThreadChoice(offered=2, gain=0.9), 4, {1: 1e-3, 2: 0.95e-3}) == [1, 2, 1, 1]


def test_the_slower_count_is_measured_again_after_reprobe_after_then_ever_less_often_while_it_loses():
    counts = run(ThreadChoice(offered=2, reprobe_after=2), 30, SLOW_MANY)
    probes = [i for i, c in enumerate(counts) if c == 2]
    assert probes == [1, 4, 9, 18, 27]  # after 2, 4, 8 and 8 iterations on one thread


def test_a_count_that_becomes_faster_is_switched_to_at_its_next_measurement():
    choice = ThreadChoice(offered=2, reprobe_after=2)
    assert run(choice, 4, SLOW_MANY) == [1, 2, 1, 1]
    assert run(choice, 3, FAST_MANY) == [2, 2, 2]  # measured again: faster now


def test_more_threads_that_run_slower_than_one_thread_did_twice_in_a_row_are_measured_against_one_again():
    choice = ThreadChoice(offered=2)
    assert run(choice, 3, FAST_MANY) == [1, 2, 2]
    assert run(choice, 1, {1: 1e-3, 2: 1.5e-3}) == [2]  # once: a burst elsewhere
    assert run(choice, 2, FAST_MANY) == [2, 2]
    assert run(choice, 2, {1: 1e-3, 2: 1.5e-3}) == [2, 2]  # twice in a row
    assert run(choice, 3, {1: 1e-3, 2: 1.5e-3}) == [1, 1, 1]  # measured again: one thread is faster now


def test_rows_doubled_since_the_measurement_measure_both_counts_again():
    choice = ThreadChoice(offered=2)
    run(choice, 3, SLOW_MANY, rows=4)
    assert run(choice, 1, SLOW_MANY, rows=6) == [1]  # fewer than twice: what was measured holds
    assert run(choice, 3, SLOW_MANY, rows=8) == [2, 1, 1]
    assert run(choice, 1, SLOW_MANY, rows=2) == [1]  # fewer rows: a count that lost loses more


def test_a_new_offer_is_measured_afresh():
    choice = ThreadChoice(offered=2)
    run(choice, 3, SLOW_MANY)
    choice.offer(1)
    assert run(choice, 1, SLOW_MANY) == [1]
    choice.offer(2)
    assert run(choice, 2, SLOW_MANY) == [1, 2]


def test_a_new_offer_never_pairs_with_an_iteration_timed_before_it():
    # Timed under the old offer, an iteration ran beside other buckets' threads
    # (the pool offers fewer while more buckets train): its cost a step is not
    # this offer's, and paired with the next iteration it chose the count unmeasured.
    choice = ThreadChoice(offered=1)
    run(choice, 1, SLOW_MANY)
    choice.offer(2)
    assert run(choice, 3, FAST_MANY) == [1, 2, 2]


def test_reprobe_after_must_be_positive():
    with pytest.raises(ValueError, match="reprobe_after"):
        ThreadChoice(reprobe_after=0)


def test_an_iteration_that_ran_several_routes_measures_no_thread_count():
    # A route probe's iteration times eager among its candidates: its cost a
    # step says nothing of the route the bucket then trains on.
    choice = ThreadChoice(offered=2)
    choice.observe(choice.choose(16), 16, 0.5e-3, routes=3)  # one thread, probing: fast as two
    assert choice.ratio is None
    counts = [choice.choose(16)]
    choice.observe(counts[-1], 16, FAST_MANY[counts[-1]])
    counts.append(choice.choose(16))
    choice.observe(counts[-1], 16, FAST_MANY[counts[-1]])
    assert counts == [1, 2] and choice.choose(16) == 2
