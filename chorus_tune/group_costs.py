"""What a bucket's iterations cost per member, by how they trained, measured (docs/design.md D8).

A fused route's cost per member falls as its group grows, and an unfused member's does
not: which is cheaper depends on the group's size, the model, the batch and the machine.
Measured in one run of the PyTorch tutorial's CNN sweep on the 2-core CPU (stock ASHA,
64 trials), a bucket at batch 2 took 10-11 s for an iteration of 2 members on vmap,
while one member alone, unfused, took 2.9-4.8 s; at batch 16, 4 members on vmap took
5.7 s, one alone 0.87 s. Its first iteration, 15 members on vmap, took 2.9 s per member.
So the route probe's choice, made for the whole stack, does not hold for the few members
a stock scheduler lets train at once. A group trains its members one by one, unfused,
once this bucket has measured both and unfused costs less per member at that size.
"""
from __future__ import annotations

from .unfused import ROUTE as UNFUSED

# The weight of the newest measurement: a bucket's timings move with the load
# on the machine, and one slow iteration (another process starting) should not
# decide for the rest of the run.
_NEWEST = 0.5


class GroupCosts:
    """Seconds per member-iteration, by route and group size, as a bucket measures them.

    :meth:`record` takes each completed group's time; :meth:`trains_unfused`
    says whether a group of ``members`` on the bucket's fused route should
    train one member at a time, unfused, instead. It says so only on two
    measurements, never on a guess: an unfused member's (any lone member's
    iteration, whatever the group size) and the fused route's at this size.
    """

    def __init__(self) -> None:
        self._per_member: dict[tuple[str, int], float] = {}

    def record(self, route: str, members: int, seconds: float) -> None:
        """A group of ``members`` trained an iteration on ``route`` in ``seconds``."""
        if members < 1 or seconds <= 0:
            return
        key = (route, 1 if route == UNFUSED else members)
        value = seconds / members
        old = self._per_member.get(key)
        self._per_member[key] = value if old is None else (1 - _NEWEST) * old + _NEWEST * value

    def per_member(self, route: str, members: int) -> float | None:
        """The measured seconds per member-iteration (``None``: not measured)."""
        return self._per_member.get((route, 1 if route == UNFUSED else members))

    def trains_unfused(self, route: str, members: int) -> bool:
        """Whether a group of ``members`` (more than one) should train unfused,
        one at a time, rather than together on ``route``."""
        unfused, fused = self.per_member(UNFUSED, 1), self.per_member(route, members)
        return members > 1 and unfused is not None and fused is not None and unfused < fused
