"""Who shares a bucket, and when a bucket should shrink (Ray-free; the pool applies both)."""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple


class GroupKey(NamedTuple):
    """What the pool groups members by: a bucket holds members of one group.

    ``structural_key`` decides (docs/design.md D9): the trial's sharing key
    (``chorus_tune.stack.sharing_key``, which may not be imported here: this
    module stays torch-free), its structure with the widths that pad left out
    and its width group (``chorus_tune.width_rule.WidthGroups``, judged for
    :func:`width_device`) in their place; ``model_name`` follows from it and
    names the group in logs and bucket names.
    """

    task_id: str
    options: Any  # the run's BucketOptions: buckets of another run's options are not shared
    model_name: str
    structural_key: tuple


def width_device(per_bucket: Mapping[str, float]) -> str:
    """The device type the width rule judges a bucket of these resources for
    (chorus_tune/width_rule.py: its launch-bound factor): ``"cuda"`` where it
    claims a GPU."""
    return "cuda" if per_bucket.get("GPU", 0) > 0 else "cpu"


def should_compact(capacity: int, live: int, waiting: int) -> bool:
    """Whether a bucket should compact to its live members now.

    True when its live members are half its slots or fewer and no trial of its
    key is waiting for a slot (a waiting trial would refill the slots, which is
    cheaper than shrinking and growing again). A bucket with no live member is
    reaped, not compacted. ``waiting`` counts the trials of the bucket's key
    that the search holds back or has released but that have not joined yet.
    """
    return live > 0 and 2 * live <= capacity and waiting <= 0


def split_from(key: GroupKey, known) -> GroupKey | None:
    """A key already ``known`` that ``key`` differs from only in structure (same
    task, options and model): members of the new structure get buckets of their
    own, and the pool says why (docs/design.md D9). ``None``: nothing like it was seen."""
    for other in known:
        if (other.task_id, other.options, other.model_name) == (key.task_id, key.options, key.model_name):
            return other
    return None
