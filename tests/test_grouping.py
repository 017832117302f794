"""The release/refill policy and the compaction rule (chorus_tune.tune.grouping), no Ray."""
import random

import pytest

from chorus_tune.tune.grouping import SlotBook, should_compact


def _book(size=4, max_buckets=None, keys=""):
    book = SlotBook(size, max_buckets)
    for i, k in enumerate(keys):
        book.add(f"s{i}", {"i": i}, k)
    return book


def _drain(book, allow_new=True):
    out = []
    while (w := book.release(allow_new)) is not None:
        out.append(w)
    return out


def test_first_release_opens_a_bucket_for_the_most_waiting_key():
    book = _book(keys="ABB")
    assert book.release().key == "B"
    assert book.buckets == {"B": 1}


def test_compatible_suggestions_are_released_together_to_fill_a_bucket():
    book = _book(size=4, max_buckets=2, keys="ABABABABAB")
    released = [w.key for w in _drain(book)]
    # one bucket of A and one of B, each filled to 4, oldest first
    assert released[:4].count(released[0]) == 4
    assert sorted(released) == ["A"] * 4 + ["B"] * 4


def test_buckets_of_one_key_fill_before_another_opens():
    book = _book(size=3, keys="AAAAAAA")
    _drain(book)
    assert book.buckets == {"A": 3} and book.live == {"A": 7}


def test_max_buckets_holds_suggestions_back():
    book = _book(size=2, max_buckets=1, keys="AAB")
    assert [w.key for w in _drain(book)] == ["A", "A"]
    assert [w.key for w in book.waiting] == ["B"]


def test_a_freed_slot_is_refilled_with_the_same_key():
    book = _book(size=2, max_buckets=2, keys="AABB")
    _drain(book)
    book.add("x", {}, "C")
    book.add("y", {}, "A")
    book.complete("A")
    assert book.release().item_id == "y"


def test_a_freed_slot_is_not_given_to_another_key_when_the_limit_is_reached():
    book = _book(size=2, max_buckets=1, keys="AA")
    _drain(book)
    book.add("c", {}, "C")
    book.complete("A")
    assert book.release() is None


def test_a_key_with_no_live_trial_gives_its_bucket_back():
    book = _book(size=2, max_buckets=1, keys="AA")
    _drain(book)
    book.add("c", {}, "C")
    book.complete("A")
    book.complete("A")
    assert book.release().item_id == "c"
    assert book.buckets == {"C": 1}


def test_refill_only_does_not_open_a_bucket():
    book = _book(keys="A")
    assert book.release(allow_new=False) is None


def test_random_workloads_never_exceed_capacity_or_bucket_limit():
    rng = random.Random(0)
    for _ in range(200):
        size, limit = rng.randint(1, 6), rng.choice([None, 1, 2, 3])
        book = SlotBook(size, limit)
        live = []
        for step in range(60):
            if rng.random() < 0.5:
                book.add(f"s{step}", {}, rng.choice("ABC"))
            if live and rng.random() < 0.3:
                book.complete(live.pop(rng.randrange(len(live))))
            w = book.release(rng.random() < 0.7)
            if w is not None:
                live.append(w.key)
            for k in "ABC":
                assert 0 <= book.live.get(k, 0) <= book.buckets.get(k, 0) * size
                assert book.live.get(k, 0) == live.count(k)
            if limit is not None:
                assert book.open_buckets() <= limit


def test_nothing_waits_while_a_slot_of_its_key_is_free():
    rng = random.Random(1)
    book = SlotBook(4, 2)
    for step in range(300):
        book.add(f"s{step}", {}, rng.choice("AB"))
        if book.live and rng.random() < 0.5:
            book.complete(rng.choice(list(book.live)))
        _drain(book)
        assert all(book.free_slots(w.key) == 0 for w in book.waiting)


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError):
        SlotBook(0)
    with pytest.raises(ValueError):
        SlotBook(4, 0)


@pytest.mark.parametrize(
    "capacity, live, waiting, expected",
    [(16, 8, 0, True), (16, 9, 0, False), (16, 1, 0, True), (16, 8, 1, False),
     (16, 0, 0, False), (8, 4, 0, True), (4, 2, 0, True), (2, 2, 0, False), (1, 1, 0, False)],
)
def test_should_compact_at_half_or_fewer_with_nothing_waiting(capacity, live, waiting, expected):
    assert should_compact(capacity, live, waiting) is expected


def test_a_compacted_bucket_compacts_again_only_after_halving_again():
    cap, live = 16, 8
    assert should_compact(cap, live, 0)
    cap = live  # compacted to its live members
    assert not should_compact(cap, 5, 0)
    assert should_compact(cap, 4, 0)


def test_pure_policy_modules_do_not_import_ray():
    import subprocess
    import sys

    code = ("import sys, chorus_tune.tune.grouping, chorus_tune.tune.halving; "
            "sys.exit(1 if 'ray' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
