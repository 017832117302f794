"""What a run's scheduler lets buckets decide, handed from ChorusASHA to ChorusSearch.

Both live in the driver, and Tune calls the searcher's and then the
scheduler's ``set_search_properties`` before it asks for the first trial
(``ray.tune.tune.run``). ChorusSearch clears the slot, ChorusASHA announces its
rungs, and ChorusSearch reads them when it seats its first members: seated
members know their rungs before their trials exist, so a cohort is halved in
its bucket at the rung and never trains past it. (One run at a time per
driver process: two Tuners fitting in threads of one process would share it.)
"""
from __future__ import annotations

from .options import RungSchedule

_announced: RungSchedule | None = None


def clear() -> None:
    global _announced
    _announced = None


def announce(schedule: RungSchedule | None) -> None:
    global _announced
    _announced = schedule


def announced() -> RungSchedule | None:
    return _announced
