"""How many of the threads it is offered a bucket trains with (Ray-free; the bucket actor applies it).

On a CPU-only machine the pool shares the cores among the buckets that train
(``resources.shared_threads``): a bucket left training alone on 2 cores is
offered both. Whether a second intra-op thread pays is not known in advance:
it depends on the step's size and on what else runs on the cores. Measured on
the 2-core CPU (a width-64 MLP bucket, 100 steps of batch 64, torch 2.13):
with the other core free, 2 threads took 0.83-0.99x the time of 1 (16 to 2
members); with the other core busy (as Tune's driver and trial actors keep it
through a sweep), 1.7-2.9x, since OpenMP's threads wait on each other at
every op. A wide model gains (the 4-width sweep's width-256 bucket: 2.6 s an
iteration on 2 threads against 4.8 s on 1). So the bucket measures: one
iteration on each count, back to back (one thread first), gives their
ratio a step, and it trains on the faster. The slower is measured again after ``reprobe_after``
iterations, then after twice as many each time it loses again (a probe of
the slower count costs its whole iteration: in a 128-trial ChorusASHA run's
tail, 2 threads took 2.5-4.5x as long as 1), and at once when the rows it
trains have doubled since (more rows make larger ops, which more threads
may split; fewer rows make them smaller, and a count that lost loses more).
More threads that won are measured against one again as soon as two
iterations in a row ran slower a step than one thread did: measured in one
such run, 2 threads won a pair at 0.91 ms a step against 1.82, then took
2.6-5.5 ms a step in 7 of their next 10 iterations.
"""
from __future__ import annotations

_MAX_BACKOFF = 4
_STRIKES = 2  # iterations in a row on more threads, each slower a step than one thread was, before measuring again


class ThreadChoice:
    """The thread count of a bucket's next iteration: one, or all it is
    offered, whichever its own iterations ran faster a step.

    ``gain``: more threads are kept only when at least this much faster a
    step (they take a core others could use). ``reprobe_after``: iterations
    before the slower count is measured again (doubling, up to 4 times, while
    it keeps losing).
    """

    def __init__(self, offered: int = 1, reprobe_after: int = 12, gain: float = 0.9):
        if reprobe_after < 1:
            raise ValueError(f"reprobe_after must be at least 1; got {reprobe_after}")
        self.offered = max(1, int(offered))
        self.reprobe_after = reprobe_after
        self.gain = gain
        self.ratio: float | None = None  # seconds a step on ``offered`` threads / on one
        self._ratio_rows = 0  # the rows it was measured at
        self._age = 0  # iterations since
        self._backoff = 1
        self._last: tuple[int, int, float] | None = None  # (threads, rows, seconds a step) of the last iteration
        self._one_per_step: float | None = None  # seconds a step on one thread, at the last measurement
        self._strikes = 0  # iterations in a row on more threads slower than that

    def offer(self, threads: int) -> None:
        """The pool offers ``threads`` from now on; a new count is measured afresh."""
        threads = max(1, int(threads))
        if threads != self.offered:
            # The offer changes as other buckets open or close, so what ran before
            # ran beside other threads than will now: no timing of it pairs with
            # the next iteration (paired, a bucket's first iteration, offered one
            # thread, made its second, on two, the measured pair).
            self.ratio, self._backoff = None, 1
            self._last, self._one_per_step, self._strikes = None, None, 0
        self.offered = threads

    def choose(self, rows: int) -> int:
        """Threads for an iteration training ``rows`` rows."""
        if self.offered == 1:
            return 1
        if self.ratio is None or rows >= 2 * self._ratio_rows:
            # Unmeasured, or measured at half the rows or fewer: one thread, then all it is
            # offered. One first: a bucket's first iteration holds back the run's first
            # result, and the other cores are busy then (trial actors start, other buckets
            # train). Measured through Tune on the 2-core machine (one evening's runs, 16
            # width-64 MLP members): first iterations took 0.36-1.46 s on one thread (72
            # of them) and 1.16-3.23 s on two (39).
            last = self._last
            return self.offered if last is not None and last[0] == 1 and _alike(last[1], rows) else 1
        faster = self.offered if self.ratio <= self.gain else 1
        if self._age >= self.reprobe_after * self._backoff or (faster != 1 and self._strikes >= _STRIKES):
            return 1 if faster == self.offered else self.offered
        return faster

    def observe(self, threads: int, rows: int, seconds_per_step: float, routes: int = 1) -> None:
        """An iteration of ``rows`` rows on ``threads`` threads took ``seconds_per_step`` a step.

        ``routes``: how many routes it ran. Several (a route probe timing its
        candidates on training's steps, eager among them, or groups on
        different routes) measure no thread count's cost of the bucket's
        route, and are not compared: in the 4-width sweep, a width-256
        bucket's first iteration, timing three routes on 2 threads, took 4.67
        ms a step, its second on one thread and one route 5.07, so one thread
        won and kept the bucket for the rest of the sweep (1.2-1.5 s an
        iteration, alone on 2 cores); compared from its second iteration, it
        chose 2 threads and took 0.93-1.49 s an iteration."""
        self._age += 1
        if routes > 1:
            return
        threads = max(1, int(threads))
        if threads != 1 and self._one_per_step is not None:
            # Slower than one thread was: the other cores are taken now (Tune's
            # driver comes in bursts), and its threads wait on each other.
            self._strikes = self._strikes + 1 if seconds_per_step > self._one_per_step else 0
        last, self._last = self._last, (threads, rows, seconds_per_step)
        if (last is None or last[0] == threads or {last[0], threads} != {1, self.offered}
                or not _alike(last[1], rows) or min(last[2], seconds_per_step) <= 0):
            return
        one, many = (seconds_per_step, last[2]) if threads == 1 else (last[2], seconds_per_step)
        ratio = many / one
        kept = self.ratio is not None and (ratio <= self.gain) == (self.ratio <= self.gain)
        self._backoff = min(_MAX_BACKOFF, self._backoff * 2) if kept else 1
        self.ratio, self._ratio_rows, self._age = ratio, rows, 0
        self._one_per_step, self._strikes = one, 0
        self._last = None  # one pair, one ratio: the iteration after it pairs with nothing


def _alike(a: int, b: int) -> bool:
    """Rows close enough that a step costs about the same: within a quarter."""
    return abs(a - b) <= max(1, max(a, b) // 4)
