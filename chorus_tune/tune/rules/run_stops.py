"""Where Tune stopped a run's trials early, shared across the run's buckets (Ray-free; the pool forwards it).

Each bucket learns its decision points (:class:`~chorus_tune.tune.rules.stop_record.StopRecord`)
from the trials it holds; a run's scheduler decides alike in all of them, so
each bucket is also told what the others saw: their counts added up. A
bucket that opens mid-run hears them at once.
"""
from __future__ import annotations

from chorus_tune.tune.rules.stop_record import sum_counts

Counts = dict[int, int]  # iteration -> trials decided there


class RunStops:
    """Each bucket's stop counts as it last sent them (``stopped``,
    ``continued``: its StopRecord's), until the bucket is gone or a new run starts."""

    def __init__(self) -> None:
        self._counts: dict[str, tuple[Counts, Counts]] = {}

    def seen(self, bucket: str, stopped: Counts, continued: Counts) -> None:
        """``bucket``'s counts now: they replace what it sent before (they are its totals, not news)."""
        self._counts[bucket] = (dict(stopped), dict(continued))

    def elsewhere(self, bucket: str) -> tuple[Counts, Counts] | None:
        """What the run's other buckets saw, added up (``None`` when none saw anything:
        there is nothing to tell ``bucket``)."""
        others = [counts for name, counts in self._counts.items() if name != bucket]
        if not others:
            return None
        return sum_counts(c[0] for c in others), sum_counts(c[1] for c in others)

    def forget(self, bucket: str) -> None:
        """``bucket`` is gone: the counts it sent stop counting for the others' future news."""
        self._counts.pop(bucket, None)

    def clear(self) -> None:
        """A new run starts: where the last run's scheduler stopped trials says nothing of this one's."""
        self._counts.clear()
