"""How far a member may run ahead of its trial: its *limit*, an iteration number (Ray-free).

Pure functions of a member's record, the run's evidence of where Tune stops
trials (:class:`~chorus_tune.tune.rules.stop_record.StopRecord`) and the queue's
bound; :class:`~chorus_tune.tune.rules.members.MemberBook` asks them, and its
module's docstring states the rules they implement (decisions the bucket
knows, decisions only Tune makes, speculation on evidence, ``run_ahead``).
"""
from __future__ import annotations

import math

from chorus_tune.tune.rules.member_record import MemberRecord
from chorus_tune.tune.rules.stop_record import StopRecord


def member_limit(record: MemberRecord, stops: StopRecord, max_queue: int) -> float:
    """The iteration ``record`` may be computed up to now."""
    plan = record.plan
    hard = hard_limit(record, max_queue)
    if plan.run_ahead == 0:
        return min(hard, record.asked)  # strict lockstep, whatever the bucket knows
    if not plan.bucket_decides:
        return min(hard, tune_decides_limit(record, stops, math.inf if plan.budget is None else plan.budget))
    return hard


def hard_limit(record: MemberRecord, max_queue: int) -> float:
    """What no decision can lift: the budget, a hold at a rung, the queue's bound."""
    limit = math.inf if record.plan.budget is None else record.plan.budget
    if record.hold_at is not None:
        limit = min(limit, record.hold_at)
    return min(limit, record.taken + max_queue)


def tune_decides_limit(record: MemberRecord, stops: StopRecord, cap: float) -> float:
    """How far a member whose decisions only Tune makes may run (the module says why)."""
    plan = record.plan
    if not plan.speculate:
        return min(cap, record.asked + plan.run_ahead)
    start = max(record.asked, 1)  # iteration 1 is never wasted: every started trial reads it
    if cap == math.inf:
        # No cap known: a learned decision point ahead, else the run_ahead bound.
        point = stops.next_point(start)
        return point if point is not None else record.asked + plan.run_ahead
    # Tune decides after each result it reads. Past what its trial asked
    # for, a member goes no further than the first iteration not known
    # clear: a learned decision point, or one too few of the run's trials
    # were seen continued past (Stock ASHA continues a rung's first
    # arrivals, so one continue says nothing; FIFO continues every trial).
    reach = stops.frontier(start, plan.clear_after)
    if stops.any_stopped:
        if record.asked >= 2:
            # Its trial was continued past a decision already (a survivor):
            # it runs up to run_ahead past its ask, never past a learnt
            # point, instead of one round trip per iteration. Only its own
            # trial reads that, so a stop there wastes run_ahead at most.
            # Not as far as the evidence clears: where Tune stops trials,
            # continues clear nothing past a rung not learnt yet (stock ASHA
            # continues a rung's first arrivals; the others it mostly stops).
            # Measured at 128 trials: survivors ran from rung 4 to max_t 16
            # on the first arrivals' continues, and one run wasted 411 of 728.
            point = stops.next_point(start)
            reach = min(record.asked + plan.run_ahead, math.inf if point is None else point)
    else:
        # No trial of the run was stopped early anywhere (FIFO so far):
        # beyond the first iteration, compute one past the evidence, so
        # the bucket trains while the trials read (their round trip hides
        # behind an iteration) instead of idling each iteration for it.
        first = stops.frontier(1, plan.clear_after)
        if first >= 2:
            reach = max(reach, first + 1)
    return min(cap, reach)  # at or after max(asked, 1): never below what the trial asked for
