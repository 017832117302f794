"""Where Tune was seen stopping a run's trials early: the learned decision points (Ray-free).

A bucket learns them from its trials' continues and leaves, and the pool
shares each bucket's counts with the run's others (:mod:`.run_stops`).
"""
from __future__ import annotations

from typing import Iterable


def sum_counts(counts: Iterable[dict[int, int]]) -> dict[int, int]:
    """Per-iteration counts of several buckets, added up."""
    total: dict[int, int] = {}
    for count in counts:
        for key, n in count.items():
            total[key] = total.get(key, 0) + n
    return total


class StopRecord:
    """Where Tune stops this bucket's trials early: the learned decision points.

    Tune's decisions reach a bucket only as their effects: a trial that asks
    for its next result after reading iteration *t* was continued at *t*; one
    that leaves after *t*, short of its member's cap and not finished by the
    bucket, was stopped at *t*. An iteration is a *decision point* once at
    least one trial was stopped there and at least ``min_stop_rate`` of the
    trials decided there were stopped (so one killed trial does not throttle
    a FIFO run for good). Stock ASHA and HyperBand stop at their rungs only, so
    their rungs are learned from the first trials they stop; a stopper that
    ends every trial at *n* is learned as a point at *n*.

    The scheduler is the run's, so the buckets of a run share what they see:
    ``elsewhere`` holds the counts of the run's other buckets (the pool sums
    and forwards them), and a point is judged on all of them together.
    """

    def __init__(self, min_stop_rate: float = 0.1):
        self.min_stop_rate = min_stop_rate
        self.stopped: dict[int, int] = {}
        self.continued: dict[int, int] = {}
        self.elsewhere: tuple[dict[int, int], dict[int, int]] = ({}, {})
        self._points: list[int] = []

    def stop(self, iteration: int) -> None:
        if iteration >= 1:
            self.stopped[iteration] = self.stopped.get(iteration, 0) + 1
            self._learn()

    def cont(self, iteration: int) -> None:
        if iteration >= 1:
            self.continued[iteration] = self.continued.get(iteration, 0) + 1
            if iteration in self.stopped or iteration in self.elsewhere[0]:
                self._learn()

    def seen_elsewhere(self, stopped: dict[int, int], continued: dict[int, int]) -> None:
        """The counts of the run's other buckets (replacing the last ones)."""
        self.elsewhere = ({int(k): v for k, v in stopped.items()}, {int(k): v for k, v in continued.items()})
        self._learn()

    def _learn(self) -> None:
        stopped = sum_counts((self.stopped, self.elsewhere[0]))
        continued = sum_counts((self.continued, self.elsewhere[1]))
        self._points = sorted(
            t for t, n in stopped.items()
            if n / (n + continued.get(t, 0)) >= self.min_stop_rate)

    @property
    def points(self) -> tuple[int, ...]:
        return tuple(self._points)

    def next_point(self, iteration: int) -> int | None:
        """The first learned decision point at or after ``iteration``."""
        for point in self._points:
            if point >= iteration:
                return point
        return None

    def continues(self, iteration: int) -> int:
        """Trials of the run seen continued past ``iteration`` (here and elsewhere)."""
        return self.continued.get(iteration, 0) + self.elsewhere[1].get(iteration, 0)

    def clear(self, iteration: int, need: int) -> bool:
        """Whether ``iteration`` is known clear of Tune's decisions: at least
        ``need`` trials were continued past it, and its stops (if any) did not
        make it a decision point."""
        return self.continues(iteration) >= need and iteration not in self._points

    def frontier(self, start: int, need: int) -> int:
        """The first iteration at or after ``start`` not known clear: a learnt
        decision point, or one too few trials were seen continued past."""
        iteration = start
        while self.clear(iteration, need):
            iteration += 1
        return iteration

    def stopped_at(self, iteration: int) -> int:
        """Trials of the run seen stopped after ``iteration`` (here and elsewhere)."""
        return self.stopped.get(iteration, 0) + self.elsewhere[0].get(iteration, 0)

    @property
    def any_stopped(self) -> bool:
        """Whether Tune was seen stopping any trial of the run early, anywhere."""
        return bool(self.stopped) or any(n > 0 for n in self.elsewhere[0].values())
