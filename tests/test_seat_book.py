"""Seated members, failures and homes (chorus_tune.tune.rules.seat_book), no Ray."""
from chorus_tune.tune.rules.seat_book import SeatBook
from chorus_tune.tune.values.options import Join

JOIN = Join(config={"lr": 0.1}, seed=7)


def seated(*members):
    book = SeatBook()
    for member in members:
        book.seat(member, JOIN)
    return book


def housed(member="m1", bucket="b0"):
    """A book with ``member`` seated and at home in ``bucket``."""
    book = seated(member)
    book.house(member, bucket)
    return book


def test_a_seated_member_seated_again_is_kept():
    assert seated("m1").is_kept("m1")


def test_a_member_with_a_home_but_no_seat_is_kept():
    book = SeatBook()
    book.house("t1", "b0")  # a trial's own member
    assert book.is_kept("t1")


def test_a_member_that_cannot_be_built_is_kept():
    book = SeatBook()
    book.fail("m1", ValueError("bad config"))
    assert book.is_kept("m1")


def test_a_member_never_seen_is_not_kept():
    assert not seated("m1").is_kept("m2")


def test_a_member_that_cannot_be_built_is_reported_failed_even_with_a_home():
    book = housed()
    book.fail("m1", ValueError("bad config"))
    assert book.status("m1") == "failed"


def test_a_member_with_a_home_is_reported_seated():
    book = housed()
    assert book.status("m1") == "seated"


def test_a_member_waiting_for_a_slot_is_reported_queued():
    assert seated("m1").status("m1") == "queued"


def test_a_member_that_cannot_be_built_stays_seated_for_its_trial():
    book = SeatBook()
    book.fail("m1", ValueError("bad config"))
    assert book.is_seated("m1") and isinstance(book.failure("m1"), ValueError)


def test_a_trials_own_member_with_a_home_is_not_seated():
    book = SeatBook()
    book.house("t1", "b0")
    assert not book.is_seated("t1")


def test_a_scout_member_seated_with_its_cohort_is_seated_afresh():
    book = seated("m1")
    book.unseat("m1")
    assert not book.is_kept("m1")


def test_a_member_that_leaves_loses_its_seat_failure_and_home_and_names_its_home():
    book = seated("m1")
    book.fail("m1", ValueError("bad config"))
    book.house("m1", "b0")
    assert book.leave("m1") == "b0"
    assert not book.is_kept("m1")


def test_a_member_that_leaves_without_a_home_names_none():
    assert seated("m1").leave("m1") is None


def test_a_finished_member_keeps_its_home_for_its_results_to_drain():
    book = housed()
    book.out("m1", "finished")
    assert book.home("m1") == "b0"


def test_a_failed_member_loses_its_home_but_keeps_its_seat():
    book = housed()
    book.out("m1", "failed")
    assert book.home("m1") is None and book.join_of("m1") == JOIN


def test_a_reaped_member_loses_its_home_and_its_seat():
    book = housed()
    book.out("m1", "reaped")
    assert not book.is_kept("m1")


def test_an_evicted_member_loses_its_home_in_that_bucket():
    book = housed()
    book.evicted("m1", "b0")
    assert book.home("m1") is None


def test_an_eviction_from_another_bucket_leaves_a_members_home_alone():
    book = housed(bucket="b1")
    book.evicted("m1", "b0")
    assert book.home("m1") == "b1"


def test_a_lost_bucket_takes_its_members_homes_and_seats_and_names_them():
    book = seated("m1", "m2", "m3")
    book.house("m1", "b0")
    book.house("m2", "b0")
    book.house("m3", "b1")
    assert book.bucket_lost("b0") == ["m1", "m2"]
    assert not book.is_kept("m1") and not book.is_kept("m2")


def test_a_lost_bucket_leaves_other_buckets_members_alone():
    book = seated("m1", "m3")
    book.house("m1", "b0")
    book.house("m3", "b1")
    book.bucket_lost("b0")
    assert book.home("m3") == "b1" and book.join_of("m3") == JOIN


def test_the_unread_members_are_the_seated_ones_no_trial_reads_oldest_first():
    book = seated("m1", "m2", "m3")
    book.house("m2", "b0")
    assert book.unread(read={"m2"}, spare="new_") == ["m1", "m3"]


def test_a_member_that_cannot_be_built_and_is_unread_is_unread_too():
    book = seated("m1")
    book.fail("m2", ValueError("bad config"))
    assert book.unread(read=set(), spare="new_") == ["m1", "m2"]


def test_a_trial_s_own_member_is_never_unread():
    book = SeatBook()
    book.house("t1", "b0")  # a trial's own member: no seat, it leaves with its trial
    assert book.unread(read=set(), spare="new_") == []


def test_the_new_run_s_own_seats_are_never_unread():
    # Its new_run may reach the pool after its first seats (Ray does not keep
    # the order of an async actor's calls).
    book = seated("old_00000", "new_00000")
    assert book.unread(read=set(), spare="new_") == ["old_00000"]
