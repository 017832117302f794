"""Which bucket a trial goes to (Ray-free; the pool actor is an adapter over it).

Rules (docs/design.md D2, D9):
- a trial goes to a bucket of its structural key with a free slot, oldest
  bucket first, so a bucket is filled to capacity before another of the same
  key is opened; a bucket that holds members comes before an empty one (one
  that regrouping emptied, D4, is closing: refilled, it trained its new
  members apart from the bucket its old ones went to);
- a new bucket is opened only within the budget (how many buckets the
  cluster's resources hold at once); otherwise the trial waits, first come
  first served, and is placed as soon as a slot of its key frees or a bucket
  closes;
- an empty bucket is closed at once when a waiting trial needs its budget,
  whether the trial came first or the bucket emptied first, else left open
  for a while for a trial of its own key (the pool closes it after an idle
  grace period);
- a bucket that is compacting offers no slot until its new capacity is known,
  and a trial of its key waits for that rather than opening another bucket.
  Its slots are the bucket actor's to count then: a trial placed in a slot the
  compaction was removing could not join ("bucket is full"), and failed;
- so is a bucket that members move into or out of (regrouping, D3): the
  members move between its records only once the source has taken them out
  (:meth:`Placement.move`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Hashable


@dataclass
class BucketRecord:
    """One bucket as the pool sees it."""

    name: str
    key: Hashable
    capacity: int
    members: list[str] = field(default_factory=list)
    ever: list[str] = field(default_factory=list)  # every trial it ever held, in order
    compacting: bool = False  # between begin_compaction and end_compaction: no free slot
    regrouping: bool = False  # between begin_move and end_move: no free slot

    @property
    def free(self) -> int:
        return 0 if self.compacting or self.regrouping else self.capacity - len(self.members)

    @property
    def busy(self) -> bool:
        """Compacting, or in a move: its slots are the bucket actor's to count."""
        return self.compacting or self.regrouping


@dataclass(frozen=True)
class Placed:
    trial_id: str
    bucket: str
    opened: bool  # the bucket is new: the pool must create its actor
    # The empty buckets of other keys whose budget it took (several where the
    # budget shrank below the buckets open): the pool closes them.
    replaces: tuple[str, ...] = ()


@dataclass
class Update:
    """What a change of membership set in motion."""

    placed: list[Placed] = field(default_factory=list)  # waiting trials now placed
    closed: list[str] = field(default_factory=list)  # empty buckets to close now
    idle: list[str] = field(default_factory=list)  # empty buckets that may close later


class Placement:
    """Slot assignment across a pool's buckets."""

    def __init__(self, max_buckets: int | None = None, prefix: str = "chorus-bucket", spare: int = 0):
        if max_buckets is not None and max_buckets < 1:
            raise ValueError(f"max_buckets must be positive or None; got {max_buckets}")
        if spare < 0:
            raise ValueError(f"spare must be 0 or more; got {spare}")
        self.max_buckets = max_buckets
        # Buckets beyond max_buckets that a structure with no bucket open may
        # open (the pool sets it: rules/resources.spare_buckets, docs/design.md D3).
        self.spare = spare
        self.prefix = prefix
        self.buckets: OrderedDict[str, BucketRecord] = OrderedDict()
        self._where: dict[str, str] = {}
        self._waiting: OrderedDict[str, tuple[Hashable, int]] = OrderedDict()
        self._opened = 0

    # ----- queries ----------------------------------------------------------------------------------
    def bucket_of(self, trial_id: str) -> str | None:
        return self._where.get(trial_id)

    def is_waiting(self, trial_id: str) -> bool:
        return trial_id in self._waiting

    def free_slots(self, key: Hashable) -> int:
        """Free slots in the open buckets of ``key`` (a new bucket may add more)."""
        return sum(b.free for b in self.buckets.values() if b.key == key)

    def waiting_ahead(self, trial_id: str) -> tuple[Hashable, int] | None:
        """``(key, trials of that key queued before it)`` of a queued trial, else ``None``."""
        if trial_id not in self._waiting:
            return None
        key = self._waiting[trial_id][0]
        ahead = 0
        for other, (k, _) in self._waiting.items():
            if other == trial_id:
                return key, ahead
            ahead += k == key
        return key, ahead

    def waiting_for(self, key: Hashable) -> int:
        """Trials of ``key`` queued for a slot."""
        return sum(1 for k, _ in self._waiting.values() if k == key)

    def can_open(self) -> bool:
        """Whether the budget (``max_buckets``, without the spare) has room for another bucket."""
        return self.max_buckets is None or len(self.buckets) < self.max_buckets

    def _limit(self, key: Hashable) -> int | None:
        """The buckets that may be open when ``key`` opens one: ``max_buckets``,
        plus the spare where no bucket of ``key`` is open (a structure that
        would otherwise wait for another's bucket to close)."""
        if self.max_buckets is None:
            return None
        fresh = not any(r.key == key for r in self.buckets.values())
        return self.max_buckets + (self.spare if fresh else 0)

    # ----- changes ----------------------------------------------------------------------------------
    def request(self, trial_id: str, key: Hashable, capacity: int) -> Placed | None:
        """Place ``trial_id``, or queue it (``None``). Idempotent for a placed trial."""
        if trial_id in self._where:
            return Placed(trial_id, self._where[trial_id], False)
        if trial_id in self._waiting:
            return None
        # A request is a waiting trial too: it takes an idle bucket's budget at
        # once, as one queued before that bucket emptied does. Queued instead,
        # it waited out the idle bucket's grace period (5 s by default) for
        # nothing: measured in the suite, a run's first members waited so for
        # the last run's bucket.
        placed = self._try_place(trial_id, key, capacity) or self._take_empty_budget(trial_id, key, capacity)
        if placed is None:
            self._waiting[trial_id] = (key, capacity)
        return placed

    def remove(self, trial_id: str) -> Update:
        """``trial_id`` leaves (or stops waiting). Idempotent; safe for unknown trials."""
        self._waiting.pop(trial_id, None)
        name = self._where.pop(trial_id, None)
        if name is None:
            return Update()
        record = self.buckets[name]
        record.members.remove(trial_id)
        return self._settle()

    def close(self, name: str) -> tuple[list[str], Update]:
        """Close bucket ``name`` (empty, or dead): returns the trials it held and
        what the freed budget set in motion. Idempotent."""
        record = self.buckets.pop(name, None)
        if record is None:
            return [], Update()
        for t in record.members:
            self._where.pop(t, None)
        update = self._settle()
        return list(record.members), update

    def begin_compaction(self, name: str) -> list[str] | None:
        """Bucket ``name`` starts to compact: it offers no slot until
        :meth:`end_compaction`. Returns the members it holds now, which the
        bucket actor must hold in its slots too for the compaction to go
        ahead; ``None`` when it is not open or already compacting."""
        record = self.buckets.get(name)
        if record is None or record.busy:
            return None
        record.compacting = True
        return list(record.members)

    def end_compaction(self, name: str, capacity: int | None) -> Update:
        """Bucket ``name`` compacted to ``capacity`` slots (``None``: it did
        not, and keeps its capacity): its slots are offered again, and the
        trials that waited meanwhile are placed. Safe for a bucket closed meanwhile."""
        record = self.buckets.get(name)
        if record is not None:
            record.compacting = False
            if capacity is not None:
                record.capacity = capacity
        return self._settle()

    def begin_move(self, source: str, dest: str) -> tuple[list[str], list[str]] | None:
        """Members move from bucket ``source`` to bucket ``dest`` of the same
        key (regrouping.py): neither offers a slot nor compacts until
        :meth:`end_move`. Returns the members each holds now (the bucket actors
        must hold exactly those for the move to go ahead); ``None`` when either
        is not open, is busy, or they are of other keys."""
        a, b = self.buckets.get(source), self.buckets.get(dest)
        if a is None or b is None or a is b or a.busy or b.busy or a.key != b.key:
            return None
        a.regrouping = b.regrouping = True
        return list(a.members), list(b.members)

    def move(self, members: list[str], source: str, dest: str) -> None:
        """``members`` left ``source`` for ``dest`` (between :meth:`begin_move` and :meth:`end_move`)."""
        a, b = self.buckets[source], self.buckets[dest]
        if len(b.members) + len(members) > b.capacity:
            raise ValueError(f"bucket {dest} has no room for {len(members)} more members")
        for member in members:
            a.members.remove(member)
            self._put(member, b, opened=False)

    def end_move(self, source: str, dest: str) -> Update:
        """The move is over: both offer their slots again; the trials that
        waited meanwhile are placed (an emptied source is idle). Safe for a
        bucket closed meanwhile."""
        for name in (source, dest):
            if name in self.buckets:
                self.buckets[name].regrouping = False
        return self._settle()

    # ----- internals --------------------------------------------------------------------------------
    def _try_place(self, trial_id: str, key: Hashable, capacity: int) -> Placed | None:
        open_ = [r for r in self.buckets.values() if r.key == key and r.free > 0]
        if open_:
            return self._put(trial_id, next((r for r in open_ if r.members), open_[0]), opened=False)
        limit = self._limit(key)
        if (limit is not None and len(self.buckets) >= limit) or self._compacting(key):
            return None
        self._opened += 1
        record = BucketRecord(f"{self.prefix}-{self._opened}", key, capacity)
        self.buckets[record.name] = record
        return self._put(trial_id, record, opened=True)

    def _take_empty_budget(self, trial_id: str, key: Hashable, capacity: int) -> Placed | None:
        """No slot and no budget: empty buckets of other keys give their budget
        up to ``trial_id``, oldest first, as many as opening one bucket needs
        (they leave the placement; ``Placed.replaces`` names them). More than
        one where the budget shrank below the buckets open: a run at
        ``max_buckets=1`` after one that opened two found one empty bucket not
        enough, and its first trials waited out the other's idle grace period
        (5 s) although both were empty."""
        if self._compacting(key):
            return None
        empty = [r.name for r in self.buckets.values() if not r.members and r.key != key]
        limit = self._limit(key)
        needed = 1 if limit is None else len(self.buckets) - limit + 1
        if not empty or needed > len(empty):
            return None
        taken = tuple(empty[:needed])  # needed >= 1: _try_place found no budget (or max_buckets is None)
        for name in taken:
            self.buckets.pop(name)
        placed = self._try_place(trial_id, key, capacity)
        assert placed is not None, "a bucket's budget was freed for it"
        return replace(placed, replaces=taken)

    def _compacting(self, key: Hashable) -> bool:
        # A member of ``key`` waits for the new capacity (or the move) rather than opening a bucket.
        return any(r.key == key and r.busy for r in self.buckets.values())

    def _put(self, trial_id: str, record: BucketRecord, opened: bool) -> Placed:
        record.members.append(trial_id)
        record.ever.append(trial_id)
        self._where[trial_id] = record.name
        return Placed(trial_id, record.name, opened)

    def _settle(self) -> Update:
        update = Update()
        # First come, first served: a trial that cannot be placed yet does not
        # stop later ones of another key from taking free slots.
        for trial_id, (key, capacity) in list(self._waiting.items()):
            placed = self._try_place(trial_id, key, capacity) or self._take_empty_budget(trial_id, key, capacity)
            if placed is not None:
                del self._waiting[trial_id]
                update.placed.append(placed)
                update.closed.extend(placed.replaces)
        update.idle = [r.name for r in self.buckets.values() if not r.members]
        return update
