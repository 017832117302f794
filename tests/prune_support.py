"""Helpers for the pruning tests that run real Tune sweeps (ChorusASHA, ChorusSearch).

`Recorder` notes every result and completion in the order the driver
processed them (callbacks run right after the scheduler, in the same order);
`replay` then re-decides the whole sweep with reference metrics in place of
the fused ones (each cohort a bucket halved, by the same rule), so a test can
say which trials *should* have been pruned.
"""
from __future__ import annotations

import sys
from collections import defaultdict

import ray.cloudpickle
from ray.tune import Callback

from chorus_tune import reference
from chorus_tune.tune.rules.halving import CohortBracket, select_survivors
from chorus_tune.tune.values import result_keys as rk

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

class Recorder(Callback):
    """Results and completions, in the order the driver processed them."""

    def __init__(self):
        self.events = []  # ("result" | "complete", trial_id, iteration, result)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.events.append(("result", trial.trial_id, result["training_iteration"], dict(result)))

    def on_trial_complete(self, iteration, trials, trial, **info):
        last = trial.last_result or {}
        self.events.append(("complete", trial.trial_id, last.get("training_iteration"), dict(last)))


def reference_metric(task, configs, iterations, metric="val_loss"):
    """{trial_id: {iteration: reference metric}} for each trial's config and seed."""
    out = {}
    for tid, (config, seed) in configs.items():
        history, _ = reference.train(task, config, seed, iterations)
        out[tid] = {i + 1: h[metric] for i, h in enumerate(history)}
    return out


def _bucket_cohorts(events):
    """{(bucket, fused iteration, rung, cohort token): [(trial_id, training_iteration)]} of the results a
    bucket decided.

    The rung is part of the key: in one fused iteration a bucket can halve two
    cohorts, refilled members reaching the first rung while older ones reach
    a later one, and each is halved on its own. Every cohort must be complete
    (each member's result recorded, as many as the bucket says it halved):
    replaying a part of one would decide another cohort than the bucket did.
    """
    cohorts = defaultdict(list)
    sizes = {}
    for kind, tid, it, result in events:
        if kind == "result" and result.get(rk.DECISION) in ("CONTINUE", "STOP"):
            # A cohort moved in from another bucket is halved apart (its token: regrouping.py).
            key = (result[rk.BUCKET], result[rk.BUCKET_ITERATION], it, result.get(rk.COHORT))
            cohorts[key].append((tid, it))
            sizes[key] = result[rk.COHORT_SIZE]
    for key, members in cohorts.items():
        assert len(members) == sizes[key], f"cohort {key}: {len(members)} results recorded of {sizes[key]} halved"
    return cohorts


def replay(events, ref, max_t, reduction_factor, grace_period=1, sign=-1.0):
    """Trial ids the cohort rule stops when fed `ref` metrics in the recorded order:
    each cohort a bucket decided is halved on reference metrics; every other
    result gets ChorusASHA's plain-ASHA rule against what the rung recorded."""
    decided = {}
    for members in _bucket_cohorts(events).values():
        keep = set(select_survivors({tid: sign * ref[tid][it] for tid, it in members}, reduction_factor))
        decided.update({(tid, it): "CONTINUE" if tid in keep else "STOP" for tid, it in members})
    bracket = CohortBracket(grace_period, max_t, reduction_factor)
    stopped = set()
    for kind, tid, it, _result in events:
        if it is None:
            continue
        score = sign * ref[tid][it]
        if kind == "complete":
            bracket.record(tid, it, score)
            bracket.forget(tid)
            continue
        if it >= max_t:
            continue
        if (tid, it) in decided:
            bracket.record(tid, it, score)
            action = decided[(tid, it)]
        else:
            action = bracket.on_result(tid, it, score)
        if action == "STOP":
            stopped.add(tid)
    return stopped


def cohorts_at(events, iteration):
    """The cohorts (frozensets of trial ids) a bucket decided at `iteration`."""
    return {frozenset(tid for tid, _ in members) for members in _bucket_cohorts(events).values()
            if members[0][1] == iteration}
