"""Who a bucket waits for before its next iteration (Ray-free, DESIGN D4).

A bucket runs an iteration only when every member it expects has asked for
it. A member is *expected* from the moment the pool reserves it a slot (before
its first request: that is what lets trials that start together train
together from their first iteration), until it leaves, is reaped or is
dropped. The bucket actor is a thin adapter over this class; the rules live
here so they can be tested directly.
"""
from __future__ import annotations

import math
import time
from typing import Callable


class Lockstep:
    """The lockstep bookkeeping of one bucket.

    ``gather_s``: after a member is newly expected, a bucket that still has
    free slots waits this long for more arrivals before running (trials that
    Tune starts together arrive a few hundred milliseconds apart).
    """

    def __init__(self, capacity: int, gather_s: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.capacity = capacity
        self.gather_s = gather_s
        self._clock = clock
        self._expected: dict[str, float] = {}
        self._requested: dict[str, float] = {}
        self._last_arrival = -math.inf

    # ----- membership -------------------------------------------------------------------------------
    @property
    def expected(self) -> list[str]:
        return list(self._expected)

    def expect(self, member: str) -> None:
        """Reserve a place for ``member``: iterations now wait for it. Idempotent."""
        if member in self._expected:
            return
        if len(self._expected) >= self.capacity:
            raise ValueError(f"bucket is full: {self.capacity} members expected")
        now = self._clock()
        self._expected[member] = now
        self._last_arrival = now

    def drop(self, member: str) -> bool:
        """Stop waiting for ``member``. Returns whether it had a pending request. Idempotent."""
        self._expected.pop(member, None)
        return self._requested.pop(member, None) is not None

    # ----- requests ---------------------------------------------------------------------------------
    def request(self, member: str) -> None:
        if member not in self._expected:
            raise KeyError(f"{member} is not a member of this bucket")
        self._requested.setdefault(member, self._clock())

    @property
    def requested(self) -> list[str]:
        return list(self._requested)

    def missing(self) -> list[str]:
        """Expected members that have not asked for the next iteration, oldest first."""
        return [m for m in self._expected if m not in self._requested]

    def waiting_for_s(self) -> float:
        """How long the oldest pending request has waited (0 when none)."""
        if not self._requested:
            return 0.0
        return self._clock() - min(self._requested.values())

    def ready_in(self) -> float | None:
        """Seconds until an iteration may run: 0 now, ``None`` while a member is missing
        or nobody asked."""
        if not self._requested or self.missing():
            return None
        if len(self._expected) >= self.capacity:
            return 0.0
        return max(0.0, self._last_arrival + self.gather_s - self._clock())

    def take(self) -> list[str]:
        """Start an iteration: the members in it, and the requests are consumed."""
        members = list(self._requested)
        self._requested.clear()
        return members
