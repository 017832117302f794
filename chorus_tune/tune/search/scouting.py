"""ChorusSearch's part that learns the task from the run's first trial (a *scout*).

Without ``task=``, :class:`~.search.ChorusSearch` hands Tune one trial first;
that trial's first step reaches the pool, which learns the task and bucket
options from it; the search then seats the scout's member with the first
cohort, and everything after behaves exactly as with ``task=``. A part of
ChorusSearch (its state is the search's: ``_scout``, ``_learning``, ...), kept
apart so that the drawing and seating read on their own.
"""
from __future__ import annotations

import copy
import logging
import time
from typing import Dict, Optional

from ray.tune.search import Searcher

logger = logging.getLogger(__name__)

# A scout that has not reached the pool after this long is given up on (its
# trainable is not a ChorusTrainable, or its actor cannot start): the run goes
# on unseated, saying so. Measured: a scout's first step reaches the pool 2-5 s
# after Tune creates it on a loaded 2-core machine.
SCOUT_TIMEOUT_S = 60.0


class ScoutLearning:
    """Learns the run's task from its first trial (ChorusSearch's part; see the module)."""

    def _send_scout(self, trial_id: str) -> Optional[Dict]:
        """Hand Tune one trial whose first step teaches the pool the task. Its
        member is seated as any other (this search's seed), but placed only
        with the members seated next, so it trains, and meets its rungs, with
        them."""
        from chorus_tune.tune import client
        from chorus_tune.tune.trial.trainable import task_classes_exist

        if not task_classes_exist():
            # No ChorusTrainable in this process: the run's trainable is a plain
            # one, and this search is a concurrency limiter that samples.
            self._learning = False
            return self._suggest(trial_id)
        pulled = self._pull()
        if pulled is None:
            if self._exhausted or self._budget_spent():
                return Searcher.FINISHED
            return None
        item_id, config = pulled
        client.expect_scout(trial_id, self._seat_of(item_id, config))
        self._scout = trial_id
        self._scout_sent = time.monotonic()
        self._unbound = [(i, c) for i, c in self._unbound if i != item_id]
        self._inner_id[trial_id] = item_id
        self.live_trials.add(trial_id)
        self.num_unfinished_live_trials += 1
        return copy.deepcopy(config)

    def _learn_from_scout(self) -> bool:
        """Whether the scout's task is known now (asking the pool); once it is,
        seat the scout's member with the first cohort."""
        from chorus_tune.tune import client

        learnt = client.scout_task(self._scout)
        if learnt is None:
            if time.monotonic() - self._scout_sent > SCOUT_TIMEOUT_S:
                self._stop_learning(f"its first trial {self._scout} did not reach a bucket in {SCOUT_TIMEOUT_S:.0f} s")
            return False
        self._task_id, self._options = learnt
        self._learning, self._learnt = False, True
        if self._bucket_size_given is None:
            self.bucket_size = self._options.expected_size
        if self.max_buckets is None:
            self.max_buckets = self._options.max_buckets
        self._size_for_cluster()  # the look-ahead, now that the bucket options are known
        # The scout (a running trial) is seated with the first cohort, in one go.
        self._reseat(draw=True)
        logger.info("ChorusSearch learnt its task from trial %s; %d members seated", self._scout,
                    len(self._unbound) + len(self._inner_id))
        return True

    def _stop_learning(self, why: str) -> None:
        self._learning = False
        logger.warning(
            "ChorusSearch has no task= and could not learn one: %s. It runs as a plain concurrency "
            "limiter, seating nothing, so members are not trained ahead of their trials and ChorusASHA "
            "cannot halve cohorts. Give ChorusSearch(task=<the ChorusTrainable class given to tune.Tuner>).",
            why)
