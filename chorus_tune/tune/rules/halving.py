"""Cohort successive halving: the rung arithmetic of ``ChorusASHA``, without Ray.

Ray keeps ASHA's rung bookkeeping in ``_Bracket``, apart from the scheduler
plumbing; this module does the same for the cohort-aware rule (docs/design.md D11),
so it can be tested fast, over many arrival orders, with no Ray at all.

Rules, in one place:

* **Rungs** are at ``grace_period * rf**(k + s)`` for ``k = 0, 1, ...`` up to
  ``max_t``, exactly as Ray's ``_Bracket`` places them.
* **A cohort** is every member of one bucket that reaches the same rung in the
  same lockstep iteration. At the first arrival of any of them, the whole
  cohort is recorded and decided at once, as synchronous successive halving
  would decide it: the best ``survivors_count(n, rf)`` continue, the others
  stop. The decisions of the members that have not arrived yet are kept and
  handed out when they do, so the arrival order never changes the outcome.
* **Rounding**: ``survivors_count(n, rf) = max(1, floor(n / rf))``. Floor, as in
  Hyperband's successive halving, with at least one survivor so that a cohort
  smaller than ``rf`` is not wiped out (stock ASHA also lets the first trial
  at a rung continue).
* **Ties** are broken by trial id (smaller id first), so the decision does not
  depend on which member arrived first; a NaN score ranks below every number.
* **A trial that arrives alone** (no cohort, or the only member of its cohort at
  that rung) gets plain ASHA: it continues when its score is at least the
  ``1 - 1/rf`` percentile of everything recorded at that rung (cohorts
  included), and is then recorded. One deliberate difference from stock
  ASHA: a NaN score stops when there is anything to compare against (stock
  ASHA lets NaN continue, because ``nan < cutoff`` is False).
* Different cohorts never wait for each other: each is decided on its own
  arrival (asynchronous across cohorts), and never re-decided later.

Scores are "higher is better" here; the scheduler multiplies by -1 for
``mode="min"``.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

CONTINUE = "CONTINUE"  # the same strings as ray.tune's TrialScheduler
STOP = "STOP"


def survivors_count(n: int, reduction_factor: float) -> int:
    """How many of a cohort of ``n`` continue: ``max(1, floor(n / rf))`` (0 if n is 0)."""
    if n <= 0:
        return 0
    return max(1, int(math.floor(n / reduction_factor + 1e-9)))


def _rank_key(item: Tuple[str, float]) -> Tuple[int, float, str]:
    trial_id, score = item
    bad = score is None or (isinstance(score, float) and math.isnan(score))
    return (1 if bad else 0, 0.0 if bad else -float(score), str(trial_id))


def select_survivors(scores: Mapping[str, float], reduction_factor: float) -> List[str]:
    """The ids that synchronous successive halving keeps from one cohort.

    ``scores``: trial id -> score, higher is better. Returns the best
    ``survivors_count(len(scores), rf)`` ids, best first; ties go to the
    smaller trial id and NaN ranks last.
    """
    ranked = sorted(scores.items(), key=_rank_key)
    k = survivors_count(len(ranked), reduction_factor)
    return [tid for tid, _ in ranked[:k]]


def rung_milestones(
    min_t: float, max_t: float, reduction_factor: float, s: int = 0
) -> List[float]:
    """Rung milestones, descending, placed exactly as Ray's ``_Bracket`` does."""
    max_rungs = int(np.log(max_t / min_t) / np.log(reduction_factor) - s + 1)
    return [min_t * reduction_factor ** (k + s) for k in reversed(range(max_rungs))]


def successive_halving(
    scores_by_rung: Mapping[float, Mapping[str, float]],
    milestones: List[float],
    reduction_factor: float,
    cohort: List[str],
) -> Dict[float, List[str]]:
    """Synchronous successive halving of one cohort, for reference.

    ``scores_by_rung[m][trial_id]`` is a trial's score (higher is better) at
    rung ``m``; ``milestones`` ascending. Returns, for each rung, the trials
    that reached it (the first rung holds the whole cohort). Used by tests to
    say what ``CohortBracket`` must reproduce.
    """
    alive = list(cohort)
    reached: Dict[float, List[str]] = {}
    for m in milestones:
        reached[m] = list(alive)
        alive = select_survivors({t: scores_by_rung[m][t] for t in alive}, reduction_factor)
    return reached


class CohortBracket:
    """One ASHA bracket that decides whole cohorts at once.

    Drop-in for the role Ray's ``_Bracket`` plays (same rung placement, same
    ``_rungs`` layout: ``[(milestone, {trial_id: score}), ...]`` descending),
    with one addition: ``on_result`` takes the trial's cohort,
    ``{trial_id: (time, score)}`` for every member of its bucket in that
    lockstep iteration (the trial itself included or not).
    """

    def __init__(
        self,
        min_t: float,
        max_t: float,
        reduction_factor: float,
        s: int = 0,
        stop_last_trials: bool = True,
    ):
        self.rf = reduction_factor
        self._rungs: List[Tuple[float, Dict[str, float]]] = [
            (m, {}) for m in rung_milestones(min_t, max_t, reduction_factor, s)
        ]
        self._stop_last_trials = stop_last_trials
        # Decisions made for cohort members whose own result has not arrived.
        self._pending: Dict[str, Tuple[int, str]] = {}

    # -- rung lookup (mirrors _Bracket.on_result's loop) --------------------
    def _target(self, trial_id: str, t: float) -> Optional[int]:
        """Index of the rung this result is judged at, or None (no decision)."""
        for idx, (milestone, recorded) in enumerate(self._rungs):
            if t >= milestone and trial_id in recorded and not self._stop_last_trials:
                return None
            if t < milestone or trial_id in recorded:
                continue
            return idx
        return None

    def cutoff(self, recorded: Mapping[str, float]) -> Optional[float]:
        """Stock ASHA's cutoff: the ``1 - 1/rf`` percentile of what is recorded."""
        if not recorded:
            return None
        values = [v for v in recorded.values() if v is not None]
        if not values or all(math.isnan(v) for v in values):
            return None
        return float(np.nanpercentile(values, (1 - 1 / self.rf) * 100))

    # -- decisions -----------------------------------------------------------
    def decide(
        self,
        trial_id: str,
        t: float,
        score: Optional[float],
        cohort: Optional[Mapping[str, Tuple[float, Optional[float]]]] = None,
    ) -> Dict[str, str]:
        """Decide for this result; returns every decision made by this call.

        The arriving trial's own decision is always in the returned dict.
        When this result is the first of a cohort to reach a rung, the dict
        also holds the decision for each other member (so the caller can act
        on a STOP at once); those members get the same decision back when
        their own result arrives.
        """
        pending = self._pending.get(trial_id)
        if pending is not None and t >= self._rungs[pending[0]][0]:
            del self._pending[trial_id]
            return {trial_id: pending[1]}
        idx = self._target(trial_id, t)
        if idx is None:
            return {trial_id: CONTINUE}
        recorded = self._rungs[idx][1]

        members: Dict[str, Optional[float]] = {}
        for tid, (tt, s) in (cohort or {}).items():
            if tid == trial_id or tid in self._pending:
                continue
            if self._target(tid, tt) == idx:
                members[tid] = s
        if members:
            members[trial_id] = score
            clean = {k: (math.nan if v is None else float(v)) for k, v in members.items()}
            keep = set(select_survivors(clean, self.rf))
            out = {}
            for tid, s in clean.items():
                recorded[tid] = s
                action = CONTINUE if tid in keep else STOP
                out[tid] = action
                if tid != trial_id:
                    self._pending[tid] = (idx, action)
            return out

        # Alone at this rung: plain ASHA.
        cut = self.cutoff(recorded)
        action = CONTINUE
        bad = score is None or math.isnan(score)
        if cut is not None and (bad or score < cut):
            action = STOP
        recorded[trial_id] = math.nan if bad else float(score)
        return {trial_id: action}

    @property
    def milestones(self) -> List[float]:
        """The rungs, ascending."""
        return sorted(m for m, _ in self._rungs)

    def record(self, trial_id: str, t: float, score: Optional[float]) -> None:
        """Record ``trial_id``'s score at the rung ``t`` reaches, decided elsewhere
        (by its bucket, for its cohort), so that later lone arrivals are judged
        against it. A no-op where it is recorded already or reaches no rung."""
        idx = self._target(trial_id, t)
        if idx is not None:
            bad = score is None or math.isnan(score)
            self._rungs[idx][1][trial_id] = math.nan if bad else float(score)

    def on_result(
        self,
        trial_id: str,
        t: float,
        score: Optional[float],
        cohort: Optional[Mapping[str, Tuple[float, Optional[float]]]] = None,
    ) -> str:
        """The arriving trial's decision: ``"CONTINUE"`` or ``"STOP"``."""
        return self.decide(trial_id, t, score, cohort)[trial_id]

    def forget(self, trial_id: str) -> None:
        """Drop a decision still waiting for a trial that is gone."""
        self._pending.pop(trial_id, None)

    def debug_str(self) -> str:
        """One line per bracket, like ``_Bracket.debug_str``."""
        iters = " | ".join(
            "Iter {:.3f}: {} recorded, cutoff {}".format(m, len(r), self.cutoff(r))
            for m, r in self._rungs
        )
        return "CohortBracket: " + iters
