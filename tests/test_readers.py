"""Which member each trial reads (chorus_tune.tune.rules.readers), no Ray."""
from chorus_tune.tune.rules.readers import Readers


def among(*names):
    return set(names).__contains__


def test_a_trial_is_bound_to_a_placed_member_before_one_waiting_for_a_slot():
    readers = Readers()
    member = readers.bind("t1", ["m1", "m2", "m3"], seated=among("m1", "m2", "m3"), placed=among("m2", "m3"))
    assert member in ("m2", "m3") and readers.member_of("t1") == member


def test_trials_are_bound_to_placed_members_in_no_fixed_order():
    # A grid's first points taken in order looked like FIFO to the evidence rule
    # (docs/design.md D4, D10): the member a trial reads must not follow the draw order.
    members = [f"m{i}" for i in range(16)]
    firsts = [Readers(seed).bind("t1", members, seated=among(*members), placed=among(*members))
              for seed in range(400)]
    assert firsts.count("m0") < 60 and len(set(firsts)) == 16  # about 25 each


def test_the_same_seed_binds_the_same_members():
    members = [f"m{i}" for i in range(16)]

    def bindings(seed):
        readers, left = Readers(seed), list(members)
        chosen = []
        for t in range(4):
            chosen.append(readers.bind(f"t{t}", left, seated=among(*members), placed=among(*members)))
            left.remove(chosen[-1])
        return chosen

    assert bindings(3) == bindings(3)


def test_with_none_placed_a_trial_is_bound_to_the_oldest_seated_member():
    readers = Readers()
    assert readers.bind("t1", ["m1", "m2"], seated=among("m1", "m2"), placed=among()) == "m1"


def test_while_no_bucket_has_started_trials_are_bound_to_slotted_members_in_no_fixed_order():
    # The run's first trials bind while its first buckets start, before any
    # member is placed: taken oldest first, they were the grid's first points
    # in order again (docs/design.md D4).
    members = [f"m{i}" for i in range(16)]
    firsts = [Readers(seed).bind("t1", members, seated=among(*members), placed=among(),
                                 slotted=among(*members[:8])) for seed in range(400)]
    assert set(firsts) == set(members[:8]) and firsts.count("m0") < 100  # about 50 each


def test_a_member_already_placed_is_bound_before_one_whose_bucket_still_starts():
    readers = Readers()
    assert readers.bind("t1", ["m1", "m2", "m3"], seated=among("m1", "m2", "m3"), placed=among("m3"),
                        slotted=among("m1", "m2", "m3")) == "m3"


def test_candidates_not_seated_are_passed_over():
    readers = Readers()
    assert readers.bind("t1", ["m1", "m2"], seated=among("m2"), placed=among("m1", "m2")) == "m2"


def test_a_trial_with_no_seated_candidate_is_bound_to_nothing():
    readers = Readers()
    assert readers.bind("t1", ["m1"], seated=among(), placed=among()) is None
    assert not readers.is_bound("t1")


def test_a_trial_that_reads_already_keeps_its_member():
    readers = Readers()
    readers.start("t1", "m2")
    assert readers.bind("t1", ["m1", "m2"], seated=among("m1", "m2"), placed=among("m1")) == "m2"


def test_a_trial_that_reads_a_member_of_its_own_is_bound_to_no_candidate():
    readers = Readers()
    readers.start("t1", "t1")
    assert readers.bind("t1", ["m1"], seated=among("m1"), placed=among("m1")) is None
    assert not readers.is_bound("t1")


def test_a_binding_to_a_member_lost_with_its_bucket_is_dropped():
    readers = Readers()
    readers.bind_to("t1", "m1")
    assert readers.bound_member("t1", seated=among()) is None
    assert not readers.is_bound("t1")


def test_a_binding_to_a_seated_member_holds():
    readers = Readers()
    readers.bind_to("t1", "m1")
    assert readers.bound_member("t1", seated=among("m1")) == "m1"


def test_each_reservation_gets_a_new_token():
    readers = Readers()
    first = readers.start("t1", "t1")
    second = readers.start("t1", "t1")
    assert second != first
    assert readers.is_current("t1", second) and not readers.is_current("t1", first)


def test_any_token_is_current_when_none_is_named():
    readers = Readers()
    assert readers.is_current("t1", None)


def test_a_token_is_stale_once_its_trial_left():
    readers = Readers()
    token = readers.start("t1", "t1")
    readers.leave("t1")
    assert not readers.is_current("t1", token)


def test_a_trial_leaving_gives_the_member_it_read_and_unbinds_it():
    readers = Readers()
    readers.bind_to("t1", "m1")
    readers.start("t1", "m1")
    assert readers.leave("t1") == "m1"
    assert not readers.is_reading("t1") and not readers.is_bound("t1")
    assert readers.leave("t1") is None  # idempotent


def test_a_bound_trial_that_never_reserved_leaves_its_bound_member():
    readers = Readers()
    readers.bind_to("t1", "m1")
    assert readers.leave("t1") == "m1"


def test_a_name_no_trial_reads_is_taken_for_a_members_own():
    assert Readers().member_of("m7") == "m7"


def test_a_bound_trial_that_has_not_reserved_is_found_by_its_bound_member():
    readers = Readers()
    readers.bind_to("t1", "m1")
    assert readers.member_of("t1") == "m1"


def test_the_members_read_are_those_trials_reserved_not_those_only_bound():
    readers = Readers()
    readers.bind("t1", ["m1"], seated=among("m1"), placed=among("m1"))
    readers.bind("t2", ["m2"], seated=among("m2"), placed=among("m2"))
    readers.start("t2", "m2")
    readers.start("t3", "t3")  # a trial's own member
    assert readers.members_read() == {"m2", "t3"}


def test_a_member_whose_trial_left_is_no_longer_read():
    readers = Readers()
    readers.start("t1", "m1")
    readers.leave("t1")
    assert readers.members_read() == set()


def test_a_trial_is_bound_to_the_oldest_seated_member_where_that_one_trains_solo():
    # Nothing of a solo member trains ahead: its trials run in the searcher's
    # order, as plain Tune runs the configs (a stock scheduler then sees
    # results in plain Tune's order).
    members = [f"m{i}" for i in range(16)]
    readers, left, chosen = Readers(), list(members), []
    for t in range(4):
        chosen.append(readers.bind(f"t{t}", left, seated=among(*members), placed=among(*members),
                                   solo=among(*members)))
        left.remove(chosen[-1])
    assert chosen == ["m0", "m1", "m2", "m3"]


def test_a_bucket_member_ahead_of_solo_ones_is_still_drawn_at_random():
    members = [f"m{i}" for i in range(16)]
    firsts = [Readers(seed).bind("t1", members, seated=among(*members), placed=among(*members),
                                 solo=among(*members[8:])) for seed in range(400)]
    assert len(set(firsts)) == 16
