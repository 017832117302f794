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
    ``continued``: its StopRecord's), until the bucket is gone or a new run starts.

    ``run`` counts the Tune runs in this driver. Counts are tagged with the run
    they are of, both ways (a bucket's report, the others' sums it is sent), so
    that none of an earlier run's counts reach a later one. Why: the pool and
    the buckets are async actors, whose calls Ray does not keep in order, and a
    new run's first buckets may open before the pool hears the run start.
    Seen (32 x 10, a FIFO run, then a stock-ASHA one in the same driver, as
    ``vs_tune.py``'s rows run, four invocations): in one, the second run's
    buckets trained all 16 members of iteration 2 the moment their first
    iteration ended, before any trial of that run could have read it, so
    iteration 1 was clear to them already, on continues that only the first
    run's counts could hold; they trained every member to the end, 225 of
    320 member-epochs wasted (the other three: 1-2 of 76-87).
    """

    def __init__(self) -> None:
        self._counts: dict[str, tuple[Counts, Counts]] = {}
        self.run = 0

    def seen(self, bucket: str, stopped: Counts, continued: Counts, run: int | None = None) -> bool:
        """``bucket``'s counts now: they replace what it sent before (they are its totals, not news).
        Counts of an earlier run than this one are not kept. Whether they were."""
        if run is not None and run != self.run:
            return False
        self._counts[bucket] = (dict(stopped), dict(continued))
        return True

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

    def clear(self) -> int:
        """A new run starts: where the last run's scheduler stopped trials says
        nothing of this one's. Returns the new run's number."""
        self._counts.clear()
        self.run += 1
        return self.run
