"""When a bucket should shrink to its live members (Ray-free; the pool applies it)."""
from __future__ import annotations


def should_compact(capacity: int, live: int, waiting: int) -> bool:
    """Whether a bucket should compact to its live members now.

    True when its live members are half its slots or fewer and no trial of its
    key is waiting for a slot (a waiting trial would refill the slots, which is
    cheaper than shrinking and growing again). A bucket with no live member is
    reaped, not compacted. ``waiting`` counts the trials of the bucket's key
    that the search holds back or has released but that have not joined yet.
    """
    return live > 0 and 2 * live <= capacity and waiting <= 0
