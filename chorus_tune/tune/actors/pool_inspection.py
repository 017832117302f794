"""The pool's part that answers questions (docs/design.md D12, "Faults"): what a waiting trial
waits for (and idle members made to give their slots up), where a member is, free slots,
and every bucket's stats. A part of :class:`~chorus_tune.tune.actors.pool.ChorusPool` (its
state is the pool's); the words of a wait are ``rules/wait_status.py``."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Hashable

import ray
from ray.exceptions import RayActorError

from chorus_tune.tune.rules.grouping import GroupKey
from chorus_tune.tune.rules.wait_status import what_it_waits_for, word_wait
from chorus_tune.tune.rules.waits import EVICT_IDLE_S, asks_to_evict

# The pool's one log: its _start sends it to the actor's own stdout.
logger = logging.getLogger("chorus_tune.tune.actors.pool")



class Inspection:
    """What the pool answers: waits, where members are, stats (ChorusPool's part; see the module)."""

    async def wait_status(self, member: str) -> dict[str, Any]:
        """For the trial of ``member``, waiting for its bucket: ``waits_for``
        (what it waits for, in words, for the error if the wait stalls),
        ``progress`` (changes whenever anything in the sweep moves: the pool's
        events and its buckets' iterations) and ``hopeless`` (the wait can
        never end: its bucket claims resources that no alive node has)."""
        wait = what_it_waits_for(member, self.seats.home(member), self.placement, self.scouts.is_held(member))
        if wait.key is not None:  # it waits for a slot: idle members of full buckets give theirs up
            await self._evict_idle(wait.key)
        waits_for, hopeless = word_wait(member, wait, self.placement, self.handles, self._bucket_resources,
                                        _alive_nodes, self.scouts.wait_s)
        return {"waits_for": waits_for, "progress": self._events + await self._iterations(), "hopeless": hopeless}

    async def _evict_idle(self, key: GroupKey) -> None:
        """Members of ``key`` wait for a slot: full buckets of ``key`` give up the
        slots of members whose trials stopped asking (see ``waits.EVICT_IDLE_S``);
        so do buckets of other keys when the budget is used up (emptied, one
        closes and its budget opens a bucket of ``key``)."""
        budget_used = not self.placement.can_open()
        for name, record in list(self.placement.buckets.items()):
            handle = self.handles.get(name)
            if handle is None or not self.history.has_started(name):
                continue  # not started: nobody in it has read anything
            if not asks_to_evict(record.free, record.key == key, budget_used):
                continue
            try:
                evicted = await handle.evict_idle.remote(EVICT_IDLE_S)
            except RayActorError:
                continue
            for member in evicted:
                self.seats.evicted(member, name)
                if self.placement.bucket_of(member) == name:
                    await self._apply(self.placement.remove(member))

    async def _iterations(self) -> int:
        """Iterations run by the buckets that started (one that does not answer in time counts 0)."""
        started = [h for n, h in self.handles.items() if self.history.has_started(n)]

        async def one(handle) -> int:
            try:
                return await asyncio.wait_for(asyncio.wrap_future(handle.progress.remote().future()), 5.0)
            except Exception:  # noqa: BLE001 - busy, or dead (its death watch tells)
                return 0

        return sum(await asyncio.gather(*(one(h) for h in started)))

    async def bucket_of(self, member: str):
        """``(bucket name, handle)`` of the bucket holding ``member`` (a member
        or a trial id), or ``None``."""
        name = self._read_from(self.readers.member_of(member))
        return None if name is None else (name, self.handles.get(name))

    async def free_slots(self, structural_key: Hashable) -> int:
        """Free slots in open buckets whose sharing key (``chorus_tune.stack.sharing_key``) is ``structural_key``."""
        if self.placement is None:
            return 0
        return sum(r.free for r in self.placement.buckets.values() if r.key.structural_key == structural_key)

    async def stats(self) -> dict[str, dict]:
        """Every bucket this pool opened: model, bucket_size, capacity (less after
        compaction), the members it trained (``trials``), its current members,
        whether it closed, died or reaped members; once it started, where it
        runs (``node_id``, ``device``, ``requested_device``, ``gpu_ids``); and,
        read while it is open, wasted member-iterations, iterations and route."""
        out = {}
        for name in self.history.names():  # a copy: a bucket may open while this awaits each one
            record = self.placement.buckets.get(name) if self.placement else None
            members = list(record.members) if record else []
            handle, live = self.handles.get(name), None
            # Only a bucket that started answers: one waiting for resources
            # (a GPU another bucket holds) would hold up the stats until then.
            if handle is not None and self.history.has_started(name):
                try:
                    live = await handle.describe.remote()
                except RayActorError:
                    pass
            out[name] = self.history.report(name, members, live)
        return out



def _alive_nodes() -> list[dict[str, float]]:
    """Each alive node's total resources."""
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
