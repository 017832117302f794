"""When the pool closes an empty bucket, and when it compacts one (Ray-free; the pool applies both).

A bucket whose last member left is *idle*: it stays open for its options'
``idle_close_s`` (a member of its key may come), and then until its members'
trials have read every result. Until then its actor lives and holds its
resources (its GPU), so it stays in the placement, counted against the budget
and open to a member of its key. Freed before, its budget opened a bucket that
could not start, and the trials waiting for that one kept this one's readers
from running (seen when a lost node's trials restarted: the sweep hung).

A bucket with few live members compacts to them (``grouping.should_compact``),
``compact_after_s`` after a member left: a ``reset_config`` leaves and rejoins
at once, and a bucket must not shrink under the member that refills it.
"""
from __future__ import annotations

from chorus_tune.tune.rules.grouping import should_compact
from chorus_tune.tune.rules.placement import Placement


class Watches:
    """Buckets each watched by one task at a time: the pool keeps one for idle
    buckets waiting to drain, one for buckets closing (a second start is refused)."""

    def __init__(self) -> None:
        self._names: set[str] = set()

    def start(self, name: str) -> bool:
        """Whether the caller watches bucket ``name`` now (not when another task does already)."""
        if name in self._names:
            return False
        self._names.add(name)
        return True

    def end(self, name: str) -> None:
        self._names.discard(name)


def idle_close_s(placement: Placement, name: str) -> float | None:
    """How long idle bucket ``name`` stays open for a member of its key;
    ``None`` when it is no longer in the placement (nothing to close)."""
    record = placement.buckets.get(name)
    return None if record is None else record.key.options.idle_close_s


def stays_idle(placement: Placement, name: str) -> bool:
    """Whether idle bucket ``name`` still heads for closing: not when it left
    the placement (its budget went to another key, which closes it) or was refilled."""
    record = placement.buckets.get(name)
    return record is not None and not record.members


def compact_after_s(placement: Placement | None, name: str) -> float:
    """How long after a member left bucket ``name`` it is looked at for compaction."""
    record = placement.buckets.get(name) if placement is not None else None
    return record.key.options.compact_after_s if record is not None else 0.0


def compaction_due(placement: Placement | None, name: str) -> bool:
    """Whether bucket ``name`` compacts to its live members now: it is open,
    its options let it compact, and :func:`~.grouping.should_compact` says so
    with the members of its key waiting for a slot."""
    record = placement.buckets.get(name) if placement is not None else None
    if record is None or not record.key.options.compact or record.busy:
        return False
    return should_compact(record.capacity, len(record.members), placement.waiting_for(record.key))
