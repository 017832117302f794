"""Which waiting suggestion to release next, so buckets fill and stay full.

The release/refill policy of ``ChorusSearch`` (DESIGN.md D10), and the
compaction rule for buckets, as plain classes that know nothing of Ray.

The book models the pool's buckets from the search's side: a key's buckets
are opened by the search, ``bucket_size`` slots each, and a released trial
holds one slot until it completes (finished, pruned or errored). The pool
fills a bucket to capacity before it opens another of the same key, so the
free slots of a key are ``bucket_size * open_buckets(key) - live(key)``. A
key's buckets count as closed only when none of its trials is live any more:
the model never assumes a bucket was reaped while members may still hold it,
so ``max_buckets`` is never exceeded, at the price of sometimes keeping a
nearly empty bucket's device for its key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Optional


@dataclass
class Waiting:
    """A suggestion held back until a slot of its key is free."""

    item_id: str
    config: Dict[str, Any]
    key: Hashable


@dataclass
class SlotBook:
    """Buffer of suggestions grouped by structural key, with the release policy.

    Policy of :meth:`release`, in order:

    1. **Refill**: the oldest waiting suggestion whose key has a free slot.
    2. **Open a bucket** (only if ``allow_new`` and fewer than ``max_buckets``
       are open): the key with the most suggestions waiting (ties: the key of
       the oldest), its oldest suggestion.
    3. Otherwise nothing.
    """

    bucket_size: int
    max_buckets: Optional[int] = None
    waiting: List[Waiting] = field(default_factory=list)
    live: Dict[Hashable, int] = field(default_factory=dict)
    buckets: Dict[Hashable, int] = field(default_factory=dict)

    def __post_init__(self):
        if self.bucket_size < 1:
            raise ValueError("bucket_size must be at least 1")
        if self.max_buckets is not None and self.max_buckets < 1:
            raise ValueError("max_buckets must be at least 1 (or None)")

    # -- views ---------------------------------------------------------------
    def free_slots(self, key: Hashable) -> int:
        """Slots of this key's open buckets that no live trial holds."""
        return self.buckets.get(key, 0) * self.bucket_size - self.live.get(key, 0)

    def open_buckets(self) -> int:
        """Buckets the search believes are open, over all keys."""
        return sum(self.buckets.values())

    def waiting_by_key(self) -> Dict[Hashable, int]:
        """How many suggestions of each key are held back."""
        out: Dict[Hashable, int] = {}
        for w in self.waiting:
            out[w.key] = out.get(w.key, 0) + 1
        return out

    def can_open(self) -> bool:
        """Whether another bucket may be opened under ``max_buckets``."""
        return self.max_buckets is None or self.open_buckets() < self.max_buckets

    # -- changes -------------------------------------------------------------
    def add(self, item_id: str, config: Dict[str, Any], key: Hashable) -> None:
        """Hold a new suggestion (arrival order is kept)."""
        self.waiting.append(Waiting(item_id, config, key))

    def release(self, allow_new: bool = True) -> Optional[Waiting]:
        """Take the next suggestion to start, per the policy, or None."""
        for i, w in enumerate(self.waiting):
            if self.free_slots(w.key) > 0:
                return self._take(i)
        if not allow_new or not self.waiting or not self.can_open():
            return None
        counts = self.waiting_by_key()
        best = max(counts.values())
        for i, w in enumerate(self.waiting):  # oldest of the most-waiting keys
            if counts[w.key] == best:
                self.buckets[w.key] = self.buckets.get(w.key, 0) + 1
                return self._take(i)
        return None  # unreachable

    def _take(self, i: int) -> Waiting:
        w = self.waiting.pop(i)
        self.live[w.key] = self.live.get(w.key, 0) + 1
        return w

    def complete(self, key: Hashable) -> None:
        """A released trial of ``key`` is gone: its slot is free again."""
        n = self.live.get(key, 0) - 1
        if n > 0:
            self.live[key] = n
        else:
            # No member left: the pool reaps the key's buckets.
            self.live.pop(key, None)
            self.buckets.pop(key, None)

    def discard_waiting(self) -> List[Waiting]:
        """Drop every held suggestion (the run is ending); returns them."""
        out, self.waiting = self.waiting, []
        return out


def should_compact(capacity: int, live: int, waiting: int) -> bool:
    """Whether a bucket should compact to its live members now.

    True when its live members are half its slots or fewer and no trial of its
    key is waiting for a slot (a waiting trial would refill the slots, which is
    cheaper than shrinking and growing again). A bucket with no live member is
    reaped, not compacted. ``waiting`` counts the trials of the bucket's key
    that the search holds back or has released but that have not joined yet.
    """
    return live > 0 and 2 * live <= capacity and waiting <= 0
