"""A search's scout trials and their held members (Ray-free; the pool actor keeps one :class:`Scouts`).

ChorusSearch without ``task=`` hands Tune one *scout* trial first
(docs/design.md D10): its first step teaches the pool the run's task. Its
member is held back, not placed, so that it is seated with the first cohort
the search seats next and trains (and meets its rungs) with them. No wait is
endless: a held member is placed alone after ``wait_s``.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Protocol

# A scout's member waits this long for the cohort its search seats next (a
# fraction of a second, normally) before it is placed alone: no wait is endless.
SCOUT_WAIT_S = 30.0

Seat = tuple[str, dict, int]  # (member, config, seed)


class Timer(Protocol):
    def cancel(self) -> Any: ...


class Scouts:
    """Scouts expected, what they taught, and their members held for a cohort.

    ``call_later(delay_s, callback)`` starts a timer (``asyncio``'s
    ``loop.call_later`` in the pool; a test passes its own).
    """

    def __init__(self, call_later: Callable[[float, Callable[[], None]], Timer], wait_s: float = SCOUT_WAIT_S):
        self.wait_s = wait_s
        self._call_later = call_later
        self._expected: dict[str, Seat] = {}  # scout trial id -> the seat its first step turns into
        self._taught: dict[str, tuple[str, Any]] = {}  # scout trial id -> (task id, options) it reserved with
        self._held: dict[str, tuple[Hashable, Timer]] = {}  # member -> (its group key, its fallback timer)

    def expect(self, trial_id: str, seat: Seat) -> None:
        """``trial_id`` is a scout: its first reservation reads the member ``seat``."""
        self._expected[trial_id] = seat

    def is_expected(self, trial_id: str) -> bool:
        """Whether ``trial_id`` is a scout that has not reserved yet."""
        return trial_id in self._expected

    def arrived(self, trial_id: str, task_id: str, options: Any) -> Seat:
        """The scout reserved with ``task_id`` and ``options``: what it taught is
        kept (even if its own config cannot be built), and its seat returned."""
        seat = self._expected.pop(trial_id)
        self._taught[trial_id] = (task_id, options)
        return seat

    def taught(self, trial_id: str) -> tuple[str, Any] | None:
        """``(task id, options)`` the scout reserved with, once it has."""
        return self._taught.get(trial_id)

    def hold(self, member: str, key: Hashable, place_alone: Callable[[str], None]) -> None:
        """Hold ``member`` (of group ``key``) for its cohort; ``place_alone(member)``
        runs once ``wait_s`` has passed (it finds out with :meth:`release`
        whether the member is still held)."""
        self._held[member] = (key, self._call_later(self.wait_s, lambda: place_alone(member)))

    def is_held(self, member: str) -> bool:
        return member in self._held

    def release(self, member: str) -> Hashable | None:
        """``member`` is held no more (its cohort came, it left, or its wait is
        over): its key, or ``None`` when it was not held (then there is nothing
        to do for it). Its timer is cancelled."""
        held = self._held.pop(member, None)
        if held is None:
            return None
        key, timer = held
        timer.cancel()
        return key
