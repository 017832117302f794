"""Stop counts shared across a run's buckets (chorus_tune.tune.rules.run_stops), no Ray."""
from chorus_tune.tune.rules.run_stops import RunStops


def test_a_bucket_hears_the_other_buckets_counts_added_up():
    stops = RunStops()
    stops.seen("b1", {3: 2}, {3: 1})
    stops.seen("b2", {3: 1, 9: 1}, {})
    stops.seen("b3", {9: 4}, {9: 2})
    assert stops.elsewhere("b3") == ({3: 3, 9: 1}, {3: 1})


def test_a_bucket_is_not_told_its_own_counts():
    stops = RunStops()
    stops.seen("b1", {3: 2}, {3: 1})
    assert stops.elsewhere("b1") is None


def test_a_bucket_opened_mid_run_hears_every_open_buckets_counts():
    stops = RunStops()
    stops.seen("b1", {3: 2}, {})
    assert stops.elsewhere("b2") == ({3: 2}, {})


def test_nothing_is_told_before_any_bucket_saw_a_stop():
    assert RunStops().elsewhere("b1") is None


def test_a_buckets_new_counts_replace_its_old_ones():
    stops = RunStops()
    stops.seen("b1", {3: 1}, {})
    stops.seen("b1", {3: 2}, {5: 1})  # its totals now, not news to add
    assert stops.elsewhere("b2") == ({3: 2}, {5: 1})


def test_the_counts_are_copied_when_seen():
    stops, stopped = RunStops(), {3: 1}
    stops.seen("b1", stopped, {})
    stopped[3] = 7  # the caller's dict changes later
    assert stops.elsewhere("b2") == ({3: 1}, {})


def test_a_gone_buckets_counts_are_forgotten():
    stops = RunStops()
    stops.seen("b1", {3: 2}, {})
    stops.seen("b2", {9: 1}, {})
    stops.forget("b1")
    assert stops.elsewhere("b3") == ({9: 1}, {})


def test_a_new_run_forgets_every_count():
    stops = RunStops()
    stops.seen("b1", {3: 2}, {})
    stops.clear()
    assert stops.elsewhere("b2") is None


def test_a_solo_trial_that_left_tells_every_bucket_where_tune_continued_and_stopped_it():
    stops = RunStops()
    stops.solo_left(read=3, finished=False)  # continued at 1 and 2, stopped at 3
    stops.solo_left(read=1, finished=False)
    assert stops.elsewhere("any bucket") == ({3: 1, 1: 1}, {1: 1, 2: 1})


def test_a_solo_trial_whose_last_result_ended_it_was_not_stopped():
    stops = RunStops()
    stops.solo_left(read=4, finished=True)  # its cap, or a stop criterion: no decision of Tune's
    assert stops.elsewhere("b") == ({}, {1: 1, 2: 1, 3: 1})
