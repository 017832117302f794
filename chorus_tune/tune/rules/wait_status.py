"""What a trial waiting for its bucket waits for, in words (Ray-free; the pool's ``wait_status``).

A trial's first step waits for its member's bucket (``await_placement``), and
a wait that stalls ends with an error that names what it waited for
(docs/design.md "Faults: every wait ends"; :class:`~.waits.Stall`). The pool
decides here, from its own records and the alive nodes' resources it passes
in, which wait it is (:func:`what_it_waits_for`), then words it
(:func:`word_wait`): the bucket it waits to start and who holds the resources
meanwhile, the cohort a scout waits for, or the slot a member waits for.
A bucket that claims resources no alive node has waits for good: *hopeless*.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Container, Mapping

from chorus_tune.tune.rules.placement import Placement
from chorus_tune.tune.rules.resources import bucket_actor_options
from chorus_tune.tune.rules.waits import fits_a_node

HOUSED, BUCKET, COHORT, SLOT, UNKNOWN = "housed", "bucket", "cohort", "slot", "unknown"


@dataclass(frozen=True)
class Wait:
    """Which wait a member is in: ``housed`` in ``bucket`` (none), waiting for
    ``bucket`` to start, for a scout's ``cohort``, for a ``slot`` of ``key``
    (``ahead``: members of ``key`` queued before it), or ``unknown`` to the pool."""

    kind: str
    bucket: str | None = None
    key: Any = None
    ahead: int = 0


def what_it_waits_for(member: str, home: str | None, placement: Placement | None, scout_held: bool) -> Wait:
    """The wait of ``member``: ``home`` is the bucket holding it (if any),
    ``scout_held`` whether it is a scout's member held for its cohort."""
    if home is not None:
        return Wait(HOUSED, bucket=home)
    name = placement.bucket_of(member) if placement is not None else None
    if name is not None:
        return Wait(BUCKET, bucket=name)
    if scout_held:
        return Wait(COHORT)
    if placement is not None and placement.is_waiting(member):
        key, ahead = placement.waiting_ahead(member)
        return Wait(SLOT, key=key, ahead=ahead)
    return Wait(UNKNOWN)


def claimed(per_bucket: Mapping[str, float]) -> dict[str, float]:
    """What a bucket of resources ``per_bucket`` claims of a node: its GPUs and custom resources."""
    options = bucket_actor_options(per_bucket)
    return {"GPU": options["num_gpus"], **options.get("resources", {})}


def word_wait(member: str, wait: Wait, placement: Placement | None, started: Container[str],
              resources_of: Callable[[Any], Mapping[str, float]], nodes: Callable[[], list[dict[str, float]]],
              scout_wait_s: float) -> tuple[str, bool]:
    """``(what member waits for, in words; hopeless)``. ``started``: the buckets
    whose actors the pool made; ``resources_of(options)``: a bucket's resources;
    ``nodes()``: each alive node's total resources (asked only for a bucket's wait)."""
    if wait.kind == HOUSED:
        return f"nothing: member {member} is in bucket {wait.bucket}", False
    if wait.kind == BUCKET:
        claims = claimed(resources_of(placement.buckets[wait.bucket].key.options))
        hopeless = not fits_a_node(claims, nodes())
        holders = [f"{b} ({len(r.members)} members)" for b, r in placement.buckets.items()
                   if b != wait.bucket and b in started]
        return (f"bucket {wait.bucket} to start: it claims {claims}, "
                + ("which no alive node has" if hopeless else f"held now by {holders or 'nothing'}")), hopeless
    if wait.kind == COHORT:
        return (f"the cohort ChorusSearch seats with scout member {member} (placed alone after "
                f"{scout_wait_s:.0f} s)"), False
    if wait.kind == SLOT:
        buckets = [f"{b} ({len(r.members)}/{r.capacity})" for b, r in placement.buckets.items()]
        return (f"a slot in a bucket of {wait.key.model_name} ({wait.ahead} member(s) queued before it; "
                f"{len(buckets)} of {placement.max_buckets} bucket(s) open"
                + (f" (and {placement.spare} more for a structure with none)" if placement.spare else "")
                + f": {buckets})"), False
    return f"member {member}, which the pool does not know", False
