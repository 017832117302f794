"""Which waiting trial reads first at an iteration Tune has not settled yet (Ray-free; docs/design.md D4).

Speculation (D4) clears an iteration once ``Plan.clear_after`` of the run's
trials were seen continued past it, and learns a decision point from the
trials seen stopped there. Stock ASHA always continues a rung's first arrival,
and each later one at or above its cutoff (a percentile of the scores that
arrived there before it): when the run's first arrivals at a rung come in
ascending order, ASHA continues every one, the bucket cannot tell that from
FIFO, clears the rung and trains every member past it, and the trials ASHA
stops there later waste what was trained (D4, "Where the evidence rule
fails"; 8 runs in 300 of the Ray-free sweep model over 10% wasted at
``reduction_factor`` 4, 45 at 2).

Where several trials wait for a result of the same unsettled iteration, the
order in which they read it is the bucket's to choose. So one that is not
the lowest of them reads first, and once Tune has decided that one (its
trial asked again, or left) or ``hold_s`` has passed, the lowest reads
next: a scheduler that stops on rank stops it, and the point is learned at
once; FIFO continues it, as it continues everything. After that pair, and
wherever the iteration is clear already or a decision point, trials read
in any order. (Not the best first: in the Ray-free model that made stock
ASHA stricter, the best member reaching ``max_t`` in 203 of 300 runs
against 235; docs/design.md D4.)

What it changes in Tune's decisions: only the order of results that were
ready at the same time, which in plain Tune is whatever the processes'
timing makes it. Stock ASHA then stops the lowest of a rung's first waiting
arrivals, which a random order would have let read first, and ASHA
continue, one time in k (k waiting).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping


@dataclass(frozen=True)
class _Lead:
    member: str
    score: float
    at: float  # when it read


class ReadOrder:
    """The read order at the unsettled iterations of one bucket: one that is
    not the lowest first, then the lowest (see the module). ``hold_s``: the
    longest a trial waits for the first reader's decision (every wait ends)."""

    def __init__(self, hold_s: float = 0.5):
        self.hold_s = hold_s
        self._lead: dict[int, _Lead] = {}
        self._paired: set[int] = set()

    def hold(self, member: str, iteration: int, score: float, rivals: Mapping[str, float],
             decided: Callable[[str], bool], now: float) -> float | None:
        """``None`` when ``member`` may read its result at ``iteration`` now
        (then it counts as read); else the seconds it waits at most before
        asking again. ``score``: its result's, higher is better; ``rivals``:
        the scores of the other members whose trials wait for a result of the
        same iteration, computed already; ``decided(m)``: whether Tune's
        decision on ``m``'s result there has reached the bucket."""
        if not self.pending(iteration):
            return None
        lowest = all((score, member) < (s, m) for m, s in rivals.items())
        lead = self._lead.get(iteration)
        if lead is None:
            if rivals and lowest:
                return self.hold_s  # another leads; this one reads after it, below it
            self._lead[iteration] = _Lead(member, score, now)
            return None
        if lead.member == member:
            return None
        left = lead.at + self.hold_s - now
        if not decided(lead.member) and left > 0:
            return left
        if lowest and score < lead.score:
            self._paired.add(iteration)  # the pair Tune decides on rank: the order's work there is done
            return None
        if any(s < lead.score for s in rivals.values()):
            return self.hold_s  # the lowest reads next
        return None

    def pending(self, iteration: int) -> bool:
        """Whether reads at ``iteration`` are still ordered (no pair read there yet)."""
        return iteration not in self._paired
