"""ChorusASHA: asynchronous successive halving that sees whole cohorts (DESIGN.md D11).

The rung arithmetic lives in :mod:`chorus_tune.tune.halving` (no Ray); this
module is the Tune plumbing around it.
"""
from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Callable, Dict, Mapping, Optional, Tuple

from ray.tune.experiment import Trial
from ray.tune.schedulers.async_hyperband import AsyncHyperBandScheduler
from ray.tune.schedulers.trial_scheduler import TrialScheduler

from chorus_tune.tune.halving import STOP, CohortBracket

if TYPE_CHECKING:
    from ray.tune.execution.tune_controller import TuneController

logger = logging.getLogger(__name__)

COHORT_FIELD = "chorus/cohort"

_retire_fn: Optional[Callable[[str], object]] = None


def _retire(trial_id: str) -> None:
    """Retire a member in its bucket now, through the pool (if there is one).

    ``chorus_tune.tune.pool.retire_trial`` is idempotent and a no-op for a
    trial that holds no slot (an ordinary trainable). The import is guarded so
    the scheduler works on plain Tune trainables, and without the pool module.
    """
    global _retire_fn
    if _retire_fn is None:
        try:
            from chorus_tune.tune.pool import retire_trial
        except ImportError:  # the Tune layer is not there: nothing to retire
            return
        _retire_fn = retire_trial
    try:
        _retire_fn(trial_id)
    except Exception:  # a failed early retire only costs time: Tune stops it anyway
        logger.debug("retire_trial(%s) failed", trial_id, exc_info=True)


def parse_cohort(
    value: object,
    time_attr: str,
    metric: str,
    sign: float,
) -> Optional[Dict[str, Tuple[float, float]]]:
    """``{trial_id: (time, signed score)}`` from a result's ``chorus/cohort`` field.

    The field is a JSON string (a dict would be flattened by Tune):
    ``{trial_id: {"iteration": int, <metric>: float, ...}}``. The member's
    ``iteration`` stands for ``training_iteration``; another ``time_attr``
    must be present in the entries themselves. Members lacking the metric or
    the time are left out (they are judged alone when they arrive). Returns
    None when the field is absent or unreadable.
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            logger.warning("unreadable %s field: %.80s", COHORT_FIELD, value)
            return None
    if not isinstance(value, Mapping):
        return None
    out: Dict[str, Tuple[float, float]] = {}
    for tid, entry in value.items():
        if not isinstance(entry, Mapping) or metric not in entry:
            continue
        if time_attr in entry:
            t = entry[time_attr]
        elif time_attr == "training_iteration" and "iteration" in entry:
            t = entry["iteration"]
        else:
            continue
        raw = entry[metric]
        score = math.nan if raw is None else sign * float(raw)
        out[str(tid)] = (float(t), score)
    return out


class ChorusASHA(AsyncHyperBandScheduler):
    """ASHA that decides a bucket's cohort as synchronous successive halving would.

    Each ChorusTrainable result carries ``chorus/cohort``: the metrics of every
    member of its bucket in that lockstep iteration. At the first arrival of a
    cohort at a rung, the whole cohort is recorded and the best
    ``max(1, floor(n / reduction_factor))`` continue, whatever order the
    members' results then reach Tune in. Cohorts are decided independently and
    at once (asynchronous, like ASHA); results without the field (ordinary
    trainables, or a trial alone at its rung) get plain ASHA. See
    :mod:`chorus_tune.tune.halving` for the exact rules.

    A STOP retires the member in its bucket at once (through the pool), so its
    bucket's next lockstep iteration does not wait for Tune to tear the trial
    down; cohort-mates decided STOP are retired at the cohort's first arrival.

    Arguments are those of ``AsyncHyperBandScheduler``.
    """

    def __init__(
        self,
        time_attr: str = "training_iteration",
        metric: Optional[str] = None,
        mode: Optional[str] = None,
        max_t: int = 100,
        grace_period: int = 1,
        reduction_factor: float = 4,
        brackets: int = 1,
        stop_last_trials: bool = True,
    ):
        super().__init__(
            time_attr=time_attr,
            metric=metric,
            mode=mode,
            max_t=max_t,
            grace_period=grace_period,
            reduction_factor=reduction_factor,
            brackets=brackets,
            stop_last_trials=stop_last_trials,
        )
        self._brackets = [
            CohortBracket(grace_period, max_t, reduction_factor, s, stop_last_trials)
            for s in range(brackets)
        ]
        self._num_cohorts = 0  # cohorts decided as a whole (for debug_string)

    def _cohort_of(self, result: Dict, bracket: CohortBracket) -> Optional[Dict]:
        cohort = parse_cohort(
            result.get(COHORT_FIELD), self._time_attr, self._metric, self._metric_op
        )
        if not cohort:
            return None
        # Only members halved in the same bracket form this trial's cohort.
        return {t: v for t, v in cohort.items() if self._trial_info.get(t) is bracket}

    def on_trial_result(
        self, tune_controller: "TuneController", trial: Trial, result: Dict
    ) -> str:
        if self._time_attr not in result or self._metric not in result:
            return TrialScheduler.CONTINUE
        tid = trial.trial_id
        bracket = self._trial_info.get(tid)
        t = result[self._time_attr]
        if bracket is None:  # not added through on_trial_add (should not happen)
            return TrialScheduler.CONTINUE
        if t >= self._max_t and self._stop_last_trials:
            decisions = {tid: STOP}
        else:
            raw = result[self._metric]
            score = math.nan if raw is None else self._metric_op * float(raw)
            decisions = bracket.decide(tid, t, score, self._cohort_of(result, bracket))
            if len(decisions) > 1:
                self._num_cohorts += 1
        for member, action in decisions.items():
            if action == STOP:
                _retire(member)
        action = decisions[tid]
        if action == STOP:
            self._num_stopped += 1
        return action

    def on_trial_complete(
        self, tune_controller: "TuneController", trial: Trial, result: Dict
    ):
        bracket = self._trial_info.pop(trial.trial_id, None)
        if bracket is None:
            return
        if self._time_attr in result and self._metric in result:
            raw = result[self._metric]
            score = math.nan if raw is None else self._metric_op * float(raw)
            # Recorded alone, like stock ASHA records a final result.
            bracket.on_result(trial.trial_id, result[self._time_attr], score)
        bracket.forget(trial.trial_id)

    def on_trial_remove(self, tune_controller: "TuneController", trial: Trial):
        bracket = self._trial_info.pop(trial.trial_id, None)
        if bracket is not None:
            bracket.forget(trial.trial_id)

    def debug_string(self) -> str:
        out = "Using ChorusASHA: num_stopped={}, cohorts={}".format(
            self._num_stopped, self._num_cohorts
        )
        return out + "\n" + "\n".join(b.debug_str() for b in self._brackets)
