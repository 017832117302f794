"""The replay the pruning sweeps are checked against (tests/prune_support.py).

The Ray tests trust `replay` to say which trials the cohort rule stops; a
wrong replay makes them fail on a right sweep, or pass on a wrong one.
"""
import sys

import pytest

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from chorus_tune.tune.values import result_keys as rk  # noqa: E402

from prune_support import replay  # noqa: E402


def _decided(tid, it, decision, bucket_iteration, cohort_size, bucket="b"):
    return ("result", tid, it, {rk.DECISION: decision, rk.BUCKET: bucket,
                                rk.BUCKET_ITERATION: bucket_iteration, rk.COHORT_SIZE: cohort_size})


def test_two_cohorts_halved_in_one_fused_iteration_are_replayed_apart():
    # Refilled members A-D reach the first rung in the same fused iteration as
    # the older E-H reach the second: the bucket halves each group on its own
    # (rf 4: one survivor each), though E-H's later losses are all lower.
    ref = {t: {1: 1.0 + i / 10} for i, t in enumerate("ABCD")}
    ref.update({t: {4: 0.1 + i / 10} for i, t in enumerate("EFGH")})
    events = [_decided(t, 1, "CONTINUE" if t == "A" else "STOP", 7, 4) for t in "ABCD"]
    events += [_decided(t, 4, "CONTINUE" if t == "E" else "STOP", 7, 4) for t in "EFGH"]
    assert replay(events, ref, max_t=16, reduction_factor=4) == set("BCDFGH")


def test_a_cohort_with_a_result_missing_is_refused():
    ref = {t: {1: 1.0 + i / 10} for i, t in enumerate("ABC")}
    events = [_decided(t, 1, "STOP", 3, 4) for t in "ABC"]
    with pytest.raises(AssertionError, match="3 results recorded of 4 halved"):
        replay(events, ref, max_t=16, reduction_factor=4)
