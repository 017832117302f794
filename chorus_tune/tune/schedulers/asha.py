"""ChorusASHA: asynchronous successive halving that sees whole cohorts (docs/design.md D11).

The rung arithmetic lives in :mod:`chorus_tune.tune.rules.halving` (no Ray), the
cohort decision itself in the buckets (:mod:`chorus_tune.tune.rules.members`); this
module is the Tune plumbing around them.
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Dict, Optional

from ray.tune.experiment import Trial
from ray.tune.schedulers.async_hyperband import AsyncHyperBandScheduler
from ray.tune.schedulers.trial_scheduler import TrialScheduler

from chorus_tune.tune.rules.halving import CONTINUE, STOP, CohortBracket
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values import run_plan
from chorus_tune.tune.values.options import RungSchedule

if TYPE_CHECKING:
    from ray.tune.execution.tune_controller import TuneController

logger = logging.getLogger(__name__)


class ChorusASHA(AsyncHyperBandScheduler):
    """ASHA whose buckets decide each cohort as synchronous successive halving would.

    Stock ASHA records the members of a bucket one at a time as they reach a
    rung together, and the first arrivals always continue, so too many are
    promoted. ChorusASHA gives the run its rungs: each bucket halves the
    members that reach a rung in the same fused iteration right there (the
    best ``max(1, floor(n / reduction_factor))`` continue), so survivors train
    on without waiting for Tune and the stopped never train past the rung.
    Each result carries the decision made for it (``chorus/decision``); this
    scheduler returns it to Tune, so Tune's view and the bucket's agree, and
    records the score at the rung. A member that reaches a rung alone is held
    there and decided here, against everything recorded at that rung (plain
    ASHA). See :mod:`chorus_tune.tune.rules.halving` for the exact rules.

    Buckets decide only what they can know: with one bracket, ``time_attr``
    ``"training_iteration"`` and ``stop_last_trials=True``. Otherwise every
    decision is Tune's, and members run at most ``run_ahead`` iterations
    ahead of their trials. On ordinary trainables it is plain ASHA.

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
        self._reduction_factor = reduction_factor
        self._stop_at: Optional[int] = None  # a training_iteration stopper of the run
        self._num_bucket_decided = 0  # results whose decision a bucket made (for debug_string)
        self._seating_search = False  # the run's searcher seats cohorts (ChorusSearch)
        self._warned_no_cohorts = False

    # -- what the buckets may decide ----------------------------------------
    def rung_schedule(self) -> Optional[RungSchedule]:
        """The rungs buckets decide themselves, or None when only Tune can."""
        if (len(self._brackets) != 1 or self._time_attr != "training_iteration"
                or not self._stop_last_trials or self._metric is None):
            return None
        # A training_iteration stopper below max_t ends every trial first.
        max_t = int(min(self._max_t, self._stop_at or self._max_t))
        rungs = sorted({int(m) for m in self._brackets[0].milestones if m < max_t and m == int(m)})
        return RungSchedule(rungs=tuple(rungs), max_t=max_t,
                            reduction_factor=float(self._reduction_factor), metric=self._metric,
                            sign=float(self._metric_op))

    def set_search_properties(self, metric: Optional[str], mode: Optional[str], **spec) -> bool:
        self._stop_at, _ = run_plan.stop_terms(spec.get("stop"))
        ok = super().set_search_properties(metric, mode, **spec)
        run_plan.announce(self.rung_schedule())
        self._seating_search = run_plan.take_seating_search()
        return ok

    def on_trial_add(self, tune_controller: "TuneController", trial: Trial):
        super().on_trial_add(tune_controller, trial)
        schedule = self.rung_schedule()
        chorus = _is_chorus(trial)
        if chorus and not self._seating_search and not self._warned_no_cohorts:
            self._warned_no_cohorts = True
            logger.warning(
                "ChorusASHA runs without ChorusSearch: each trial joins a bucket only when Tune starts it, "
                "so the members that reach a rung together are only the trials running at once (about one "
                "per CPU), and most rungs are decided one trial at a time, as stock ASHA does (it promotes "
                "too many). Pass search_alg=ChorusSearch(...) (wrapping your searcher, if any) so cohorts "
                "are seated together and halved in their bucket.")
        if schedule is not None and chorus:
            # A member that joins with its trial (no ChorusSearch) learns its rungs here.
            from chorus_tune.tune import client

            client.announce_rungs(trial.trial_id, schedule)

    # -- decisions -----------------------------------------------------------
    def on_trial_result(
        self, tune_controller: "TuneController", trial: Trial, result: Dict
    ) -> str:
        if self._time_attr not in result or self._metric not in result:
            return TrialScheduler.CONTINUE
        tid = trial.trial_id
        bracket = self._trial_info.get(tid)
        if bracket is None:  # not added through on_trial_add (should not happen)
            return TrialScheduler.CONTINUE
        t = result[self._time_attr]
        raw = result[self._metric]
        score = math.nan if raw is None else self._metric_op * float(raw)
        decided = result.get(rk.DECISION)
        if decided in (CONTINUE, STOP):
            # The bucket halved this member's cohort at the rung: record, agree.
            bracket.record(tid, t, score)
            self._num_bucket_decided += 1
            action = decided
        elif t >= self._max_t and self._stop_last_trials:
            action = STOP
        else:
            action = bracket.on_result(tid, t, score)
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
            bracket.record(trial.trial_id, result[self._time_attr], score)
        bracket.forget(trial.trial_id)

    def on_trial_remove(self, tune_controller: "TuneController", trial: Trial):
        bracket = self._trial_info.pop(trial.trial_id, None)
        if bracket is not None:
            bracket.forget(trial.trial_id)

    def debug_string(self) -> str:
        out = "Using ChorusASHA: num_stopped={}, decided in buckets={}".format(
            self._num_stopped, self._num_bucket_decided
        )
        return out + "\n" + "\n".join(b.debug_str() for b in self._brackets)


def _is_chorus(trial: Trial) -> bool:
    try:
        from chorus_tune.tune.trial.trainable import ChorusTrainable

        cls = trial.get_trainable_cls()
        return isinstance(cls, type) and issubclass(cls, ChorusTrainable)
    except Exception:  # noqa: BLE001 - an unregistered or function trainable: not ours
        return False
