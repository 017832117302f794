"""The bucket actor's part that moves members to another bucket of their structure
(docs/design.md D3, D11): what it holds, members reserved, taken out with their states and
results, and moved in elsewhere. A part of
:class:`~chorus_tune.tune.actors.bucket_actor.ChorusBucket` (its state is the actor's); which
members move is ``rules/regrouping.py``."""
from __future__ import annotations

import logging
from typing import Any

from chorus_tune.tune.rules.members import Phase
from chorus_tune.tune.rules.regrouping import broken_units, member_view, moved_error
from chorus_tune.tune.values import state_io
from chorus_tune.tune.values.options import Join
from chorus_tune.tune.values.plan import Plan

# The bucket's one log: its __init__ sends it to the actor's own stdout.
logger = logging.getLogger("chorus_tune.tune.actors.bucket_actor")


class RegroupMoves:
    """Members moved between buckets (ChorusBucket's part; see the module)."""

    async def regroup_view(self) -> dict[str, Any]:
        """What the pool's regrouping rule needs of this bucket: its capacity,
        the members in its slots (``regrouping.MemberView``), those placed here
        but not built yet, and those that moved away whose trials still read
        results left here (``draining``)."""
        self._start()
        draining = [m for m in self.moved if (r := self.book.get(m)) is not None and r.phase is not Phase.LEFT]
        return {"capacity": self.core.capacity, "pending": self.book.reserved(), "draining": draining,
                "members": [member_view(r, self.book.limit(r)) for r in self.book.in_slots()]}

    def _holds(self) -> set[str]:
        return {r.member for r in self.book.in_slots()} | set(self.book.reserved())

    async def reserve_moved(self, members: list[str], expected: list[str]) -> bool:
        """Hold slots for ``members``, which move here from another bucket:
        only while this bucket's book holds exactly ``expected`` (the members
        the pool holds here) and it has the free slots. No iteration starts
        until :meth:`move_in` builds them (they join together) or
        :meth:`cancel_moved` lets them go."""
        self._start()
        async with self._lock:
            if self._holds() != set(expected) or len(self.core.free_slots) - len(self.book.reserved()) < len(members):
                return False
            if any((r := self.book.get(m)) is not None and r.phase is not Phase.LEFT for m in members):
                return False  # results of an earlier stay here still drain
            for member in members:
                self.book.reserve(member, Plan()).building = True
        return True

    async def cancel_moved(self, members: list[str]) -> None:
        """The move of ``members`` (reserved by :meth:`reserve_moved`) did not happen."""
        for member in members:
            record = self.book.get(member)
            if record is not None and record.phase is Phase.RESERVED and member not in self._joining:
                self.book.leave(member)
                record.building = False
        self._poke()

    async def take_out(self, moving: dict[str, str | None], expected: list[str], dest: str) -> list[dict] | None:
        """Take ``moving`` (member -> the cohort token it carries) out of their
        slots, between iterations, for bucket ``dest``: each one's state now,
        config, seed, plan, token and trial actor. Refused (``None``) unless
        this book holds exactly ``expected`` (the members the pool holds here),
        every one can move (``regrouping.member_view``) and no cohort is split
        (``regrouping.broken_units``). Results they queued here stay: their
        trials read them here first, then hear :class:`Moved`."""
        self._start()
        async with self._lock:
            in_slots = self.book.in_slots()
            views = {r.member: member_view(r, self.book.limit(r)) for r in in_slots}
            if (self._holds() != set(expected) or any(m not in views or not views[m].movable for m in moving)
                    or broken_units(views.values(), moving)):
                return None
            out = []
            for member, token in moving.items():
                record = self.book.get(member)
                slot = record.slot
                state = self.core.member_state(slot)  # at record.produced: it goes on from there
                held_at = record.hold_at if record.phase is Phase.HELD else None  # it stays held there
                self.book.move_out(member)
                self.core.retire(slot)
                out.append({"member": member, "state": state_io.dumps(state), "config": dict(state["config"]),
                            "seed": int(state["seed"]), "plan": record.plan, "cohort": token,
                            "client": self.clients.get(member), "queued": len(record.queue),
                            "held_at": held_at})
        for item in out:
            member = item["member"]
            self.moved[member] = dest
            self.clients.pop(member, None)  # the new bucket watches its trial now
            if not item["queued"]:
                self._moved_on(member, raise_moved=False)
        self.metrics.members(self.live, self.core.capacity)
        self._poke()
        return out

    async def move_in(self, items: list[dict]) -> None:
        """Build the members :meth:`take_out` gave (reserved by :meth:`reserve_moved`)
        from their states, all in one go: they train their next iteration
        together, and their cohort tokens keep them apart from this bucket's own."""
        self._start()
        for item in items:  # no await in between: the train loop sees all of them building
            member = item["member"]
            record = self.book.get(member)
            if record is None or record.phase is not Phase.RESERVED:
                continue
            self.moved.pop(member, None)
            self.retired.pop(member, None)
            self.evicted.discard(member)
            self.clients[member] = item["client"]
            if member not in self.ever:
                self.ever.append(member)
            self.book.set_plan(member, item["plan"])
            self._start_build(member, Join(config=item["config"], seed=item["seed"], state=item["state"],
                                           plan=item["plan"], cohort=item["cohort"], held_at=item.get("held_at")))

    def _moved_on(self, member: str, raise_moved: bool = True) -> None:
        """``member`` moved away: once its trial has read every result left
        here, it is gone from this bucket (and its trial, asking, hears
        :class:`Moved`); before that its results are read as ever."""
        record = self.book.get(member)
        if record is not None and record.phase is not Phase.LEFT:
            if record.queue:
                return
            self.book.leave(member)  # nothing unread: nothing wasted
            self._resolve(member)
            self.metrics.members(self.live, self.core.capacity)
        if raise_moved:
            raise moved_error(member, self.name)
