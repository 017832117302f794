"""The compaction rule (chorus_tune.tune.rules.grouping) and the purity of the policy modules, no Ray."""
import pytest

from chorus_tune.tune.rules.grouping import should_compact


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

    code = ("import sys, chorus_tune.tune.rules.grouping, chorus_tune.tune.rules.halving, "
            "chorus_tune.tune.rules.members, chorus_tune.tune.rules.placement, "
            "chorus_tune.tune.rules.run_stops, chorus_tune.tune.rules.scouts, "
            "chorus_tune.tune.rules.readers, chorus_tune.tune.rules.bucket_history, "
            "chorus_tune.tune.rules.seat_book, chorus_tune.tune.rules.closing, "
            "chorus_tune.tune.rules.wait_status, chorus_tune.tune.rules.opening, "
            "chorus_tune.tune.rules.waits, chorus_tune.tune.rules.regrouping; "
            "sys.exit(1 if 'ray' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
