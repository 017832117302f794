"""When a wait has gone on too long (Ray-free; docs/design.md "Faults: every wait ends").

A trial may wait for a bucket as long as the sweep moves: "waiting for a GPU
held by bucket X" is a fine state while X trains, however long that takes. It
is a hang once nothing moves anywhere: no bucket iterates, no member joins,
leaves or finishes. :class:`Stall` tells the two apart from a progress count
(the pool's events plus its buckets' iterations) read now and then, and gives
up after ``limit_s`` without a change, with an error that names what was
waited for.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


class StalledWait(TimeoutError):
    """A wait saw no progress anywhere for its limit (the message names what it waited for)."""


@dataclass
class Stall:
    """Watches one wait: :meth:`seen` each reading; raises once nothing moved for ``limit_s``.

    ``what``: the wait, worded for its error ("trial t1 waited ... for ...").
    ``clock``: seconds, monotonic (a test passes its own).
    """

    limit_s: float
    what: str
    clock: Callable[[], float] = time.monotonic
    _last: object = field(default=None, init=False)
    _since: float | None = field(default=None, init=False)

    def seen(self, progress: object, waits_for: str | None = None) -> None:
        """A reading: ``progress`` (any value that changes when something moves;
        ``None`` when it could not be read) and what the wait is for now."""
        now = self.clock()
        if self._since is None or (progress is not None and progress != self._last):
            self._last, self._since = progress, now
            return
        if now - self._since >= self.limit_s:
            raise StalledWait(f"{self.what} for {self.limit_s:.0f}s with nothing moving in the sweep (no bucket "
                              f"iterated, no member joined, left or finished): it waited for "
                              f"{waits_for or 'an answer from the pool'}")


def fits_a_node(claimed: dict[str, float], nodes: list[dict[str, float]]) -> bool:
    """Whether one of ``nodes`` (each alive node's total resources) could ever
    hold a bucket that claims ``claimed`` (its actor options' GPUs and custom
    resources; CPUs are not claimed, see :mod:`chorus_tune.tune.rules.resources`).
    A bucket no node holds waits for good: Ray leaves such an actor pending."""
    wanted = {k: v for k, v in claimed.items() if v > 0}
    return any(all(node.get(k, 0) + 1e-9 >= v for k, v in wanted.items()) for node in nodes)


class Evicted(RuntimeError):
    """A bucket gave this member's slot to a member waiting for one: its trial
    had stopped asking for results (its state at the last result it read is
    kept: the trial picks it up and rejoins)."""


# A member whose trial has not asked for a result for this long, while another
# member waits for a slot of its structure, gives its slot up. Tune keeps the
# actor of a trial that ended cached for reuse without telling it (reuse_actors):
# its member, never told to leave, held its slot, and the members of a lost
# bucket's trials waited for one for good (issue 20).
EVICT_IDLE_S = 30.0


def idle_members(asked_at: dict[str, float], candidates: list[str], busy: set[str], now: float,
                 idle_s: float = EVICT_IDLE_S) -> list[str]:
    """Of ``candidates`` (members in slots that their trials have read from),
    those whose trial last asked ``idle_s`` or more ago and is not waiting for
    a result now (``busy``), oldest ask first."""
    idle = [m for m in candidates if m not in busy and m in asked_at and now - asked_at[m] >= idle_s]
    return sorted(idle, key=lambda m: asked_at[m])


def asks_to_evict(free: int, same_key: bool, budget_used: bool) -> bool:
    """Whether a started bucket is asked to give up its idle members' slots
    while a member waits for a slot of its key: a full bucket of that key is
    (a slot it frees takes the waiting member); one of another key only when
    the budget is used up (emptied, it closes and its budget opens a bucket of
    the waiting member's key). A bucket of the key with a free slot is not:
    the waiting member is not waiting for it."""
    return free <= 0 if same_key else budget_used
