"""Where Tune stopped a run's trials early, shared across the run's buckets (Ray-free; the pool forwards it).

Each bucket learns its decision points (:class:`~chorus_tune.tune.rules.stop_record.StopRecord`)
from the trials it holds; a run's scheduler decides alike in all of them, so
each bucket is also told what the others saw: their counts added up. A
bucket that opens mid-run hears them at once.
"""
from __future__ import annotations

from chorus_tune.tune.rules.stop_record import sum_counts

Counts = dict[int, int]  # iteration -> trials decided there
SOLO_TRIALS = "solo trials"  # where the run's solo trials' counts are kept (no bucket has this name)


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

    def solo_left(self, read: int, finished: bool) -> None:
        """A solo trial (rules/solo.py) left after handing Tune ``read`` results:
        counted as a bucket counts its trials' (StopRecord), continued at each
        iteration before its last, and stopped at its last unless that result
        ended it (its cap, a stop criterion). Why: the buckets of a run whose
        first trials trained solo (sent back to buckets where Tune starts a
        process per trial, pool_seating._back_to_buckets) otherwise saw no
        stop, and ran their members ahead as under FIFO: Ray's
        ``mnist_pytorch.py`` as it ships wasted 81 of 223 member-epochs so."""
        stopped, continued = self._counts.setdefault(SOLO_TRIALS, ({}, {}))
        for iteration in range(1, read):
            continued[iteration] = continued.get(iteration, 0) + 1
        if read >= 1 and not finished:
            stopped[read] = stopped.get(read, 0) + 1

    def forget(self, bucket: str) -> None:
        """``bucket`` is gone: the counts it sent stop counting for the others' future news."""
        self._counts.pop(bucket, None)

    def clear(self) -> None:
        """A new run starts: where the last run's scheduler stopped trials says nothing of this one's."""
        self._counts.clear()
