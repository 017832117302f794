"""What a run tells its buckets in advance, gathered in the driver (Ray-free).

Two things, both read when ChorusSearch seats its first members:

* **ChorusASHA's rungs.** Tune calls the searcher's and then the scheduler's
  ``set_search_properties`` before it asks for the first trial
  (``ray.tune.tune.run``). ChorusSearch clears the slot and says it seats
  cohorts, ChorusASHA announces its rungs (and warns if no searcher seats
  cohorts), and ChorusSearch reads them when it seats: seated members know
  their rungs before their trials exist, so a cohort is halved in its bucket
  at the rung and never trains past it.
* **The run's stop dict** (:func:`stop_terms`): a ``training_iteration`` cap,
  and criteria on the member's own metrics, which the bucket can check itself.

And one check of the run itself, before any trial starts: that ``num_samples``
covers ChorusSearch's grid (:func:`check_grid_samples`).

(One run at a time per driver process: two Tuners fitting in threads of one
process would share this.)
"""
from __future__ import annotations

import math
import sys
from typing import Any, Mapping

from chorus_tune.tune.values.options import RungSchedule

_announced: RungSchedule | None = None
_seating_search = False
_trial_concurrency: int | None = None
_trial_solo = False


def clear() -> None:
    global _announced, _seating_search
    _announced, _seating_search = None, False


def announce(schedule: RungSchedule | None) -> None:
    global _announced
    _announced = schedule


def announced() -> RungSchedule | None:
    return _announced


def search_seats_cohorts() -> None:
    """Called by ChorusSearch for the run about to start."""
    global _seating_search
    _seating_search = True


def take_seating_search() -> bool:
    """Whether this run's searcher seats cohorts (read once, by the scheduler)."""
    global _seating_search
    seating, _seating_search = _seating_search, False
    return seating


def hand_trial_concurrency(concurrency: int, solo: bool = False) -> None:
    """Called by ChorusSearch as it hands Tune a trial: the trials it runs at
    once. Tune creates that trial next, in this thread, and asks its
    trainable for its resources then (``SearchGenerator.create_trial_if_possible``,
    ``TuneController.add_trial``), so the trial's token holds its share of
    the buckets' cores (:func:`~chorus_tune.tune.rules.resources.trial_token_cpu`).
    ``solo``: the trial trains its member itself (rules/solo.py), so it holds
    one bucket's cores, as a plain Tune trial holds its CPU."""
    global _trial_concurrency, _trial_solo
    _trial_concurrency, _trial_solo = concurrency, solo


def take_trial_concurrency() -> int | None:
    """What :func:`hand_trial_concurrency` handed, once: a trial of Tune's
    default search, in this run or a later one, finds ``None``."""
    global _trial_concurrency
    concurrency, _trial_concurrency = _trial_concurrency, None
    return concurrency


def take_trial_solo() -> bool:
    """Whether the trial :func:`hand_trial_concurrency` handed trains solo, once."""
    global _trial_solo
    solo, _trial_solo = _trial_solo, False
    return solo


def rank_of(metric: Any, mode: Any) -> tuple[str, float] | None:
    """A run's ``(metric, sign)`` (``sign`` +1 for ``mode="max"``, -1 for
    ``"min"``), or ``None`` where either is not given."""
    if isinstance(metric, str) and metric and mode in ("max", "min"):
        return metric, 1.0 if mode == "max" else -1.0
    return None


def stop_terms(stop: Any) -> tuple[int | None, tuple[tuple[str, float], ...]]:
    """What a run's ``stop`` dict lets a bucket decide: ``(cap, criteria)``.

    ``cap``: the ``training_iteration`` every trial ends at (Tune stops at the
    first result with ``training_iteration >= value``, so a fraction rounds
    up). ``criteria``: the other numeric ``(key, value)`` pairs; Tune stops a
    trial at its first result with ``result[key] >= value``. A ``Stopper``
    object never reaches a searcher (Tune passes searchers the dict form only),
    so it gives neither: the bucket learns its effect instead (StopRecord).
    """
    if not isinstance(stop, Mapping):
        return None, ()
    cap, criteria = None, []
    for key, value in stop.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if key == "training_iteration":
            cap = max(1, math.ceil(value))
        else:
            criteria.append((str(key), float(value)))
    return cap, tuple(sorted(criteria))


def check_grid_samples(grid_size: int, num_samples: int | None) -> None:
    """Refuse a run whose ``num_samples`` does not walk ``param_space``'s grid whole.

    With any ``Searcher``, Tune creates ``num_samples`` trials *in all*
    (``SearchGenerator.is_finished``), not ``num_samples`` passes over the
    grid as its default generator does, and a searcher cannot raise that
    count. So under Tune's default ``num_samples=1`` a grid of 16 would run
    one trial. ChorusSearch's sampler walks the grid pass after pass, so
    ``num_samples`` must be a whole number of passes; an endless run
    (``num_samples=-1``, which Tune makes ``sys.maxsize``) walks it for good.
    """
    if grid_size <= 1 or not num_samples or num_samples >= sys.maxsize or num_samples % grid_size == 0:
        return
    passes, rest = divmod(num_samples, grid_size)
    lost = (f"{grid_size - num_samples} of its {grid_size} points would never run" if passes == 0 else
            f"the last pass would run {rest} of its {grid_size} points")
    raise ValueError(
        f"param_space has a grid of {grid_size} points, but num_samples={num_samples}: with a Searcher "
        f"(ChorusSearch included) Tune starts num_samples trials in all, not num_samples passes over the "
        f"grid, so {lost}. Pass TuneConfig(num_samples={grid_size}) to run the grid once, or a multiple "
        f"of {grid_size} (e.g. {grid_size * max(2, passes + 1)}) for that many passes.")
