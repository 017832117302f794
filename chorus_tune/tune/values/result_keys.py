"""The ``chorus/*`` fields of every ChorusTrainable result, and what they mean.

One place for the names: the bucket writes them, the scheduler reads
``DECISION``, and docs/guide/results-and-checkpoints.md's table is this list.
"""
from __future__ import annotations

MEMBER = "chorus/member"  # the member this trial reads (its trial id, or ChorusSearch's seat id)
BUCKET = "chorus/bucket"  # the bucket actor's name
SLOT = "chorus/slot"  # the member's slot when this result was computed
BUCKET_ITERATION = "chorus/bucket_iteration"  # the bucket's fused iteration that computed this result
ROUTE = "chorus/route"  # "vmap", "batched", "compiled", "eager" or "unfused" (a lone member): how the step ran
LIVE = "chorus/live"  # members trained in the fused iteration that computed this result
ROWS = "chorus/rows"  # rows of the stack that iteration computed: LIVE where it gathered them, else every slot
CAPACITY = "chorus/capacity"  # the bucket's slots then (less after compaction)
SEED = "chorus/seed"  # the member's seed: reference.train(task, config, seed) replays it
CAPACITY_FIT = "chorus/capacity_fit"  # bucket_size="auto" only: {k, a, b, free_bytes, fraction, source, reason}
OOM_RECOVERIES = "chorus/oom_recoveries"  # out-of-memory errors the bucket survived so far (groups got smaller)
COMPACTIONS = "chorus/compactions"  # times the bucket shrank to its live members
AHEAD = "chorus/ahead"  # results of this member already computed behind this one when it was read
WASTED = "chorus/wasted"  # member-iterations this bucket computed that no trial ever read, so far
DECISION = "chorus/decision"  # at a rung: "CONTINUE"/"STOP" decided for the cohort, or "HELD" (alone)
COHORT_SIZE = "chorus/cohort_size"  # at a rung: members of the bucket that reached it together
COHORT_RANK = "chorus/cohort_rank"  # at a rung: this member's rank in its cohort (1 = best)
COHORT = "chorus/cohort"  # at a rung, for members moved in from another bucket: the cohort token they carry
RETIRED = "chorus/retired"  # the member trains no more and this trial asked beyond its last result
ROUTE_REASON = "chorus/route_reason"  # why the bucket runs its route: a chorus_tune.route.RouteReason value
SOLO = "chorus/solo"  # True: the trial trained its member itself, no other member beside it (rules/solo.py)

HELD = "HELD"

ITERATION = "iteration"  # the member's own iteration count (training_iteration once resumed)

ALL = (
    MEMBER,
    BUCKET,
    SLOT,
    BUCKET_ITERATION,
    ROUTE,
    LIVE,
    ROWS,
    CAPACITY,
    CAPACITY_FIT,
    OOM_RECOVERIES,
    SEED,
    COMPACTIONS,
    AHEAD,
    WASTED,
    DECISION,
    COHORT_SIZE,
    COHORT_RANK,
    COHORT,
    RETIRED,
    ROUTE_REASON,
    SOLO,
)
