"""The pool's part that keeps buckets full (docs/design.md D3, D4, D11): a sparse bucket's
survivors move into another bucket of their structure, and a bucket of few members compacts.
A part of :class:`~chorus_tune.tune.actors.pool.ChorusPool` (its state is the pool's); which
members move is ``rules/regrouping.py``, when to compact ``rules/closing.py``."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from ray.exceptions import RayActorError

from chorus_tune.tune.rules.closing import compact_after_s, compaction_due
from chorus_tune.tune.rules.grouping import GroupKey
from chorus_tune.tune.rules.regrouping import BucketView, Move, merge_in_reach, plan_regroup

# The pool's one log: its _start sends it to the actor's own stdout.
logger = logging.getLogger("chorus_tune.tune.actors.pool")

# How often the pool looks again for sparse buckets to regroup: a member that could not move
# when a member left (being built, held at a rung, a join still on its way) may move later.
_REGROUP_POLL_S = 2.0
_COMPACT_TRIES = 3  # a compaction the bucket refuses is tried this often in all (its membership was moving)


class Regrouping:
    """Survivors regrouped, buckets compacted (ChorusPool's part; see the module)."""

    def _later_compact(self, name: str) -> None:
        # Later, not now: a bucket must not shrink under the member that refills it.
        asyncio.get_running_loop().create_task(self._maybe_compact(name, compact_after_s(self.placement, name)))

    async def _maybe_compact(self, name: str, delay_s: float = 0.0, tries: int = _COMPACT_TRIES) -> None:
        await asyncio.sleep(delay_s)
        record = self.placement.buckets.get(name) if self.placement is not None else None
        if record is not None and compaction_due(self.placement, name):
            # Emptied into the other buckets of its key, it closes instead; and
            # a compacted bucket has no free slot left for others' survivors.
            await self._regroup(record.key)
            if merge_in_reach(self._regroup_views.get(record.key, ()), name):
                return  # not yet movable (held back, draining, building): a later leave looks again
        handle = self.handles.get(name)
        if handle is None or not compaction_due(self.placement, name):
            return
        # The bucket offers no slot while it compacts (placement.py): placed in
        # one that the compaction removed, a member could not join.
        before = self.placement.buckets[name].capacity
        expected = self.placement.begin_compaction(name)
        capacity = None
        try:
            capacity = await handle.compact.remote(expected)
        except RayActorError:
            pass
        finally:
            update = self.placement.end_compaction(name, capacity)
        if capacity is not None and capacity != before and name in self.placement.buckets:
            logger.info("pool: bucket %s compacted to %d", name, capacity)
            self.history.compacted(name, capacity)
        await self._apply(update)
        if capacity is None and tries > 1 and name in self.handles:
            # Refused: a leave or join is still on its way to it. Looked at again shortly.
            asyncio.get_running_loop().create_task(
                self._maybe_compact(name, compact_after_s(self.placement, name), tries - 1))

    def _later_regroup(self, name: str) -> None:
        record = self.placement.buckets.get(name) if self.placement is not None else None
        if record is not None and record.key.options.regroup:
            asyncio.get_running_loop().create_task(self._regroup(record.key))

    async def _regroup_loop(self) -> None:
        while True:
            await asyncio.sleep(_REGROUP_POLL_S)
            if self.placement is None:
                continue
            counts: dict[GroupKey, int] = {}
            for record in self.placement.buckets.values():
                if record.members and record.key.options.regroup:
                    counts[record.key] = counts.get(record.key, 0) + 1
            for key, buckets in counts.items():
                if buckets > 1:
                    await self._regroup(key)

    async def _regroup(self, key: GroupKey) -> None:
        """Empty sparse buckets of ``key`` into the others (one regrouping per key at a time)."""
        if not key.options.regroup:
            return
        if key in self._regrouping:
            self._regroup_again.add(key)  # looked at again once the one running ends
            return
        self._regrouping.add(key)
        try:
            while True:
                self._regroup_again.discard(key)
                for move in await self._plan_regroup(key):
                    if not await self._move(move):
                        break  # something changed under it: the next look decides afresh
                if key not in self._regroup_again:
                    return
        except Exception:  # noqa: BLE001 - a regrouping that fails leaves every member where it was
            logger.exception("pool: regrouping %s", key.model_name)
        finally:
            self._regrouping.discard(key)

    async def _plan_regroup(self, key: GroupKey) -> list[Move]:
        self._regroup_views.pop(key, None)  # a look that sees no buckets leaves no stale ones
        if self.placement is None or self.placement.waiting_for(key):
            return []
        names = [n for n, r in self.placement.buckets.items()
                 if r.key == key and r.members and n in self.handles and self.history.has_started(n)]
        if len(names) < 2:
            return []

        async def view(name: str):
            try:
                return await asyncio.wait_for(asyncio.wrap_future(self.handles[name].regroup_view.remote().future()),
                                              10.0)
            except Exception:  # noqa: BLE001 - busy or dead: it takes no part this time
                return None

        views, draining = [], set()
        for name, seen in zip(names, await asyncio.gather(*(view(n) for n in names))):
            record = self.placement.buckets.get(name)
            if seen is None or record is None:
                continue
            draining.update(seen["draining"])
            holds = {m.member for m in seen["members"]} | set(seen["pending"])
            # As compaction requires: its book holds exactly the members the pool holds there.
            ready = not record.busy and holds == set(record.members) and seen["capacity"] == record.capacity
            views.append(BucketView(name, record.capacity, tuple(seen["members"]), len(seen["pending"]), ready,
                                    self.history.place_of(name)))
        self._regroup_views[key] = views
        for member, source in list(self._draining.items()):
            if source in names and member not in draining:
                del self._draining[member]  # its trial read what it left there
        return plan_regroup(views, self.placement.waiting_for(key), draining | set(self._draining))

    async def _move(self, move: Move) -> bool:
        """Move ``move``'s members: the destination holds their slots, the
        source takes them out between iterations (their queued results stay
        there for their trials), the destination builds them from their
        states. Whether they moved; a refusal anywhere leaves every member where it was."""
        source, dest = move.source, move.dest
        held = self.placement.begin_move(source, dest)
        if held is None:
            return False
        expected_source, expected_dest = held
        members = list(move.members)
        items, housed, held_slots = None, [], False
        src, dst = self.handles.get(source), self.handles.get(dest)
        try:
            if src is None or dst is None or not await dst.reserve_moved.remote(members, expected_dest):
                return False
            held_slots = True  # until move_in: the destination trains nobody while it holds them
            tokens = {}
            for unit in move.units:
                self._tokens += 1
                tokens.update(dict.fromkeys(unit.members, unit.carries(f"{source}/{self._tokens}")))
            items = await src.take_out.remote(tokens, expected_source, dest)
            if items is None:
                return False
            # A member whose trial left meanwhile stays behind (its old bucket was told).
            gone = [m for m in members if self.placement.bucket_of(m) != source]
            items = [item for item in items if item["member"] not in gone]
            # A KeyError if either closed meanwhile: only a bucket that died does.
            self.placement.move([item["member"] for item in items], source, dest)
            await dst.move_in.remote(items)
            held_slots = False
            if gone:
                await dst.cancel_moved.remote(gone)
            for item in items:
                if self.placement.bucket_of(item["member"]) != dest:
                    # It left while its new bucket was told (its leave went to the old one).
                    with contextlib.suppress(RayActorError):
                        await dst.leave.remote(item["member"], keep_state=False)
                    continue
                self.seats.house(item["member"], dest)
                housed.append(item["member"])
                if item["queued"]:
                    self._draining[item["member"]] = source
                client = self.clients.get(item["member"])
                if client is not None and item["client"] is None:
                    dst.watch.remote(item["member"], client)  # bound to its trial while it moved
        except (RayActorError, KeyError) as exc:
            # A bucket died (its death watch cleans up). Members taken out whose
            # new bucket died are lost with it, as its own members are.
            logger.warning("pool: moving %s from bucket %s to %s failed: %s", members, source, dest, exc)
            for item in items or ():
                if self.seats.home(item["member"]) != dest:
                    self._unplaced[item["member"]] = RuntimeError(
                        f"member {item['member']} was lost moving from bucket {source} to {dest}: {exc}")
            return False
        finally:
            if held_slots:
                # Refused, or it failed half way: the destination lets the slots go
                # (a member move_in reached is built, not let go).
                with contextlib.suppress(RayActorError):
                    await dst.cancel_moved.remote(members)
            update = self.placement.end_move(source, dest)
            await self._apply(update)
        self._events += 1
        if not housed:
            return False
        self.history.regrouped(source, dest, housed)
        record = self.placement.buckets.get(dest)
        logger.info("pool: regrouped %s from bucket %s to bucket %s (%d of %d slots held there now)", housed,
                    source, dest, len(record.members) if record else 0, record.capacity if record else 0)
        if self.placement.buckets.get(source) is not None and self.placement.buckets[source].members:
            self._later_compact(source)
        # The destination too: two sparse buckets merged can still leave it half empty,
        # and no member leaving it may come to look again before its members finish.
        self._later_compact(dest)
        return True

    async def moved_to(self, member: str, source: str, timeout_s: float = 60.0):
        """``(bucket name, handle)`` where ``member`` trains now, once it moved out of bucket ``source``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if member in self._unplaced:
                raise self._unplaced[member]
            name = self.seats.home(member)
            if name is not None and name != source and name in self.handles:
                return name, self.handles[name]
            if name is None or asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"member {member} moved out of bucket {source}, and the pool holds it nowhere")
            await asyncio.sleep(0.02)  # the move is still on its way (its new bucket is building it)
