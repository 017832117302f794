"""Survivors move together: which members leave a sparse bucket, and for which bucket
(Ray-free; the pool applies it, docs/design.md D3, D12).

Under ``ChorusASHA`` each bucket halves its cohorts at the rungs (16 -> 4 -> 1
at ``reduction_factor`` 4), so without regrouping a bucket's last survivor
trains on alone while another bucket's does the same beside it. A member's
state is portable and exact (``Bucket.member_state`` / ``Bucket.restore``),
so the pool empties a sparse bucket into other buckets of the same structure
on the same device, and the emptied bucket closes.

Rules, in one place:

* Only between buckets of one structural key on one place (node and device),
  and only while no member of that key waits for a slot (a waiting member
  refills the slots instead, which costs no move).
* Only whole buckets are emptied: a move that leaves its source open saves
  no fused iteration. A bucket is emptied only when every member in it can
  move and every one fits into the free slots of the others; a bucket that
  receives members in a round is not emptied in the same round, and an
  emptied one receives none.
* A member can move (:func:`member_view`) when it trains or is held alone at
  a rung (its hold moves with it; not finished, not being built), its bucket decides every
  step of its run (``Plan.bucket_decides``: ChorusASHA's rungs, or a known
  budget; decisions Tune makes are counted per bucket, and a move would count
  them twice), it is not at its queue's bound, and the results it left in
  an earlier bucket have all been read (its trial reads that bucket's queue
  first; moved again, it would skip them).
* **Cohorts never mix.** A member with a rung still ahead is compared there
  with the members that reach it in the same fused iteration (D11). Members
  that reach rungs together in one bucket move as one *unit*: every member of
  the bucket with a rung ahead and the same cohort token (see below) moves
  with the others, to one bucket, or none does. A unit carries a cohort
  token to its new bucket, and the bucket forms a cohort only of members
  with the same token, so moved members are never compared with the members
  they meet there. Members that were never moved carry no token: within one
  bucket the rule is exactly D11's. A member past its last rung (only its
  budget ahead) is never compared again and moves alone.
* Safe points are the buckets' own: the source takes a unit out under its
  lock (between iterations), only while its book holds exactly the members
  the pool holds there (as compaction requires), and re-checks that every
  unit is whole (:func:`broken_units`). A member whose trial has results
  still to read keeps them in the source bucket: its trial reads them there,
  then hears :class:`Moved` and reads on in the new bucket.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

from chorus_tune.tune.rules.members import MemberRecord, Phase


class Moved(RuntimeError):
    """The member this trial reads moved to another bucket of its structure
    (docs/design.md D3: survivors regroup). Its trial has read every result
    the old bucket held for it; it asks the pool where the member is now and
    reads on there. Torch-free and Ray-free: trial actors catch it (a plain
    message only, as Ray rebuilds it around its own error type)."""


def moved_error(member: str, source: str) -> Moved:
    """The :class:`Moved` bucket ``source`` answers for ``member``."""
    return Moved(f"member {member} moved out of bucket {source} to another bucket of its structure")


def rungs_ahead(record: MemberRecord) -> bool:
    """Whether a cohort decision still lies ahead of ``record``: a rung of its
    plan after the iterations it has computed, short of its budget (the rule
    of :meth:`MemberBook.record`)."""
    plan = record.plan
    return any(r > record.produced and r != plan.budget for r in plan.rungs)


@dataclass(frozen=True)
class MemberView:
    """One member in a slot, as the regrouping rule sees it."""

    member: str
    cohort: str | None = None  # the cohort token it carries (None: never moved)
    rungs_ahead: bool = False  # a cohort decision still lies ahead of it
    movable: bool = True  # see the module docstring
    bucket_decides: bool = True  # its bucket decides its run: it may move once it is movable


def member_view(record: MemberRecord, limit: float) -> MemberView:
    """What the rule needs of a member in a slot; ``limit``: ``MemberBook.limit(record)``."""
    # A member HELD alone at a rung moves too, its hold with it (MemberBook.place's
    # ``held_at``): it waits for ChorusASHA's decision through its trial, which in a
    # 128-trial run's tail is nearly always the case for one member of a sparse bucket,
    # and a bucket is emptied only when every member in it moves.
    waits = record.phase is Phase.HELD
    trains = record.phase is Phase.TRAINING and record.produced < limit
    movable = (waits or trains) and not record.building and record.plan.bucket_decides
    return MemberView(record.member, record.cohort, rungs_ahead(record), movable, record.plan.bucket_decides)


@dataclass(frozen=True)
class BucketView:
    """One open bucket of a key: its slots, the members in them, and whether it takes part.

    ``pending``: members placed there that are not built yet (they hold a slot
    and cannot move). ``ready``: it has started, is neither compacting nor in
    another move, and its book holds exactly the members the pool holds there.
    ``place``: where it runs (node and device); members move only within one.
    """

    name: str
    capacity: int
    members: tuple[MemberView, ...] = ()
    pending: int = 0
    ready: bool = True
    place: Hashable = None

    @property
    def live(self) -> int:
        return len(self.members) + self.pending

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.live)


@dataclass(frozen=True)
class Unit:
    """Members that move together: a cohort with a rung ahead, or one member past its last rung."""

    members: tuple[str, ...]
    cohort: str | None = None  # the token its members carry now
    rungs_ahead: bool = False
    movable: bool = True

    def carries(self, new_token: str) -> str | None:
        """The cohort token its members carry after the move: their own, or
        ``new_token`` for members never moved whose cohort still matters."""
        if self.rungs_ahead and self.cohort is None:
            return new_token
        return self.cohort


@dataclass(frozen=True)
class Move:
    """Units that leave bucket ``source`` for bucket ``dest``."""

    source: str
    dest: str
    units: tuple[Unit, ...] = field(default_factory=tuple)

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(m for unit in self.units for m in unit.members)


def units_of(members: Iterable[MemberView], draining: Iterable[str] = ()) -> list[Unit]:
    """``members`` (of one bucket) in the units that move together, largest
    first: one per cohort token among those with a rung ahead, one per member
    past its last rung. A member in ``draining`` (its trial still reads an
    earlier bucket's results) makes its unit unmovable."""
    draining = set(draining)
    cohorts: dict[str | None, list[MemberView]] = {}
    out: list[Unit] = []
    for view in members:
        if view.rungs_ahead:
            cohorts.setdefault(view.cohort, []).append(view)
        else:
            out.append(Unit((view.member,), view.cohort, False, view.movable and view.member not in draining))
    for cohort, views in cohorts.items():
        movable = all(v.movable and v.member not in draining for v in views)
        out.append(Unit(tuple(v.member for v in views), cohort, True, movable))
    return sorted(out, key=lambda u: -len(u.members))


def broken_units(in_slots: Iterable[MemberView], moving: Iterable[str]) -> list[str]:
    """Of the members in a bucket's slots, those with a rung ahead that stay
    while a member of their cohort (same token) moves: a move that must not
    happen (it would split a cohort). The source checks this under its lock."""
    in_slots = list(in_slots)
    moving = set(moving)
    leaving = {v.cohort for v in in_slots if v.member in moving and v.rungs_ahead}
    return [v.member for v in in_slots if v.rungs_ahead and v.cohort in leaving and v.member not in moving]


def merge_in_reach(buckets: Sequence[BucketView], name: str) -> bool:
    """Whether bucket ``name`` and another bucket of its key on its place could
    become one: together they fit in the slots of either, and every member in
    both is one whose bucket decides its run (only those move). Then ``name``
    does not compact (``grouping.should_compact``): a compacted bucket has no
    slot for the other's members, and one that will empty into the other
    closes instead. Measured (docs/design.md D3): in a 128-trial ChorusASHA
    run the two buckets compacted to 8 and 6 slots while they held 8 and 12
    members, and their tails, 5-6 members each, never met."""
    views = {b.name: b for b in buckets}
    bucket = views.get(name)
    if bucket is None or not all(m.bucket_decides for m in bucket.members):
        return False
    for other in buckets:
        if (other.name == name or other.place != bucket.place or not other.live
                or not all(m.bucket_decides for m in other.members)):
            continue
        if bucket.live + other.live <= max(bucket.capacity, other.capacity):
            return True
    return False


def plan_regroup(buckets: Sequence[BucketView], waiting: int = 0, draining: Iterable[str] = ()) -> list[Move]:
    """Which members move where so that the buckets of one key run full.

    ``buckets``: the key's open buckets, oldest first. ``waiting``: members of
    the key waiting for a slot (then nothing moves: they refill the slots).
    ``draining``: members whose trials still read an earlier bucket's results
    (they do not move again until they have). Returns the moves, in order; a
    bucket all of whose members leave is emptied, and closes.
    """
    if waiting > 0:
        return []
    draining = set(draining)
    places: dict[Hashable, list[BucketView]] = {}
    for bucket in buckets:
        if bucket.ready:
            places.setdefault(bucket.place, []).append(bucket)
    moves: list[Move] = []
    for group in places.values():
        moves.extend(_plan_place(group, draining))
    return moves


def _plan_place(buckets: list[BucketView], draining: set[str]) -> list[Move]:
    order = {b.name: i for i, b in enumerate(buckets)}
    live = {b.name: b.live for b in buckets}
    free = {b.name: b.free for b in buckets}
    units = {b.name: units_of(b.members, draining) for b in buckets}
    pending = {b.name: b.pending for b in buckets}
    emptied: set[str] = set()
    received: set[str] = set()
    moves: list[Move] = []
    while True:
        # The sparsest bucket empties first (of two as sparse, the newer), into the fullest with room.
        sources = sorted((n for n in live if n not in emptied and n not in received and live[n] > 0
                          and pending[n] == 0 and all(u.movable for u in units[n])),
                         key=lambda n: (live[n], -order[n]))
        for source in sources:
            plan = _fit(units[source], {n: free[n] for n in live if n != source and n not in emptied},
                        live, order)
            if plan is None:
                continue
            for dest, moved in plan.items():
                moves.append(Move(source, dest, tuple(moved)))
                size = sum(len(u.members) for u in moved)
                live[dest] += size
                free[dest] -= size
                received.add(dest)
            live[source] = 0
            emptied.add(source)
            break
        else:
            return moves


def _fit(units: list[Unit], free: dict[str, int], live: dict[str, int],
         order: dict[str, int]) -> dict[str, list[Unit]] | None:
    """Every unit into a bucket with room (largest unit first, fullest bucket
    first), or ``None`` when one does not fit anywhere."""
    free = dict(free)
    plan: dict[str, list[Unit]] = {}
    for unit in units:  # largest first (units_of)
        size = len(unit.members)
        fits = [n for n in free if free[n] >= size]
        if not fits:
            return None
        dest = min(fits, key=lambda n: (-(live[n] + sum(len(u.members) for u in plan.get(n, []))), order[n]))
        plan.setdefault(dest, []).append(unit)
        free[dest] -= size
    return plan
