"""Helpers for the pruning tests that run real Tune sweeps (ChorusASHA, ChorusSearch).

`Recorder` notes every result and completion in the order the driver
processed them (callbacks run right after the scheduler, in the same order);
`replay` then re-decides the whole sweep with reference metrics in place of
the fused ones, so a test can say which trials *should* have been pruned.
"""
from __future__ import annotations

import json
import sys

import ray.cloudpickle
from ray.tune import Callback

from chorus_tune import reference
from chorus_tune.tune.halving import CohortBracket

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

COHORT = "chorus/cohort"


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


def replay(events, ref, max_t, reduction_factor, grace_period=1, sign=-1.0):
    """Trial ids the cohort rule stops when fed `ref` metrics in the recorded order."""
    bracket = CohortBracket(grace_period, max_t, reduction_factor)
    stopped = set()
    for kind, tid, it, result in events:
        if it is None:
            continue
        if kind == "complete":
            bracket.on_result(tid, it, sign * ref[tid][it])
            bracket.forget(tid)
            continue
        if it >= max_t:
            continue
        cohort = None
        if result.get(COHORT):
            cohort = {m: (e["iteration"], sign * ref[m][e["iteration"]])
                      for m, e in json.loads(result[COHORT]).items()}
        if bracket.on_result(tid, it, sign * ref[tid][it], cohort) == "STOP":
            stopped.add(tid)
    return stopped


def cohorts_at(events, iteration):
    """The distinct cohorts (frozensets of trial ids) seen at `iteration`."""
    seen = set()
    for kind, _, it, result in events:
        if kind == "result" and it == iteration and result.get(COHORT):
            members = json.loads(result[COHORT])
            seen.add(frozenset(m for m, e in members.items() if e["iteration"] == iteration))
    return seen
