"""The bucket actor's part that takes members in and lets them go (docs/design.md D2, D4):
places held for members, members built (new, or from a state), leaves with their unread
results counted, compaction between iterations. A part of
:class:`~chorus_tune.tune.actors.bucket_actor.ChorusBucket` (its state is the actor's); the
member book's rules are ``rules/members.py``."""
from __future__ import annotations

import asyncio
import logging

from chorus_tune.tune.actors.bucket_actor_values import (
    MAX_QUEUE,
    RETIRED_KEEP,
    MemberError,
    state_bytes,
)
from chorus_tune.tune.actors.liveness import ActorId
from chorus_tune.tune.rules.members import Phase
from chorus_tune.tune.values import state_io
from chorus_tune.tune.values.options import Join
from chorus_tune.tune.values.plan import Plan

# The bucket's one log: its __init__ sends it to the actor's own stdout.
logger = logging.getLogger("chorus_tune.tune.actors.bucket_actor")


class Membership:
    """Members in and out (ChorusBucket's part; see the module)."""

    async def expect(self, member: str, client: ActorId | None = None, join: Join | None = None) -> str:
        """Hold a place for ``member``. With ``join`` (a member seated by
        ChorusSearch) it is built now, else on its trial's first request.
        Idempotent."""
        self._start()
        self._expect(member, client, join)
        return self.name

    async def expect_all(self, members: list[tuple[str, ActorId | None, Join | None]]) -> str:
        """:meth:`expect` for each ``(member, client, join)``, in one go: no
        iteration can start between them, so members seated together are all
        being built when the first one is (and train their first iteration together)."""
        self._start()
        for member, client, join in members:
            self._expect(member, client, join)  # not a coroutine: the train loop cannot run in between
        return self.name

    def _expect(self, member: str, client: ActorId | None, join: Join | None) -> None:
        record = self.book.get(member)
        fresh = record is None or record.phase not in (Phase.RESERVED, Phase.TRAINING, Phase.HELD)
        self.book.reserve(member, Plan() if join is None else join.plan)
        if fresh or client is not None:
            # A member id seen before (a restarted trial, a re-seat) starts
            # afresh: the trial actor that read it before may be dead.
            self.clients[member] = client
        self.retired.pop(member, None)
        self.evicted.discard(member)
        if fresh:
            self._fetched.pop(member, None)
        self.moved.pop(member, None)
        if member not in self.ever:
            self.ever.append(member)
        if join is not None and member not in self._joining:
            self._start_build(member, join)

    async def watch(self, member: str, client: ActorId | None) -> None:
        """``client`` (a trial actor's id) reads ``member`` now: if it dies, the
        reaper drops the member. The pool says so when a trial is bound to a
        member seated before it, which it may never read (its actor can die
        first), so the member would hold its slot for good."""
        record = self.book.get(member)
        if record is not None and record.phase is not Phase.LEFT and client is not None and member not in self.moved:
            self.clients[member] = client

    def _start_build(self, member: str, join: Join) -> asyncio.Task:
        self.book.get(member).building = True
        task = asyncio.get_running_loop().create_task(self._build(member, join))
        self._joining[member] = task
        return task

    async def join(self, member: str, join: Join) -> None:
        """Build ``member`` into a slot (fresh, or from ``join.state``). A model
        that cannot be built fails this member only; its trial hears why."""
        self._start()
        record = self.book.get(member)
        if record is None or record.phase is not Phase.RESERVED:
            return
        task = self._joining.get(member)
        if task is None:
            if join is None:
                raise MemberError(f"member {member} asked bucket {self.name} for a result before joining")
            task = self._start_build(member, join)
        await asyncio.shield(task)

    async def _build(self, member: str, join: Join) -> None:
        try:
            state = state_io.loads(join.state) if join.state is not None else None
            async with self._lock:
                record = self.book.get(member)
                if record is None or record.phase is not Phase.RESERVED:
                    return  # it left while waiting for the lock
                if state is None:
                    slot = await self._in_thread(self.core.add, dict(join.config), join.seed)
                else:
                    slot = await self._in_thread(self.core.restore, state, dict(join.config))
                if record.phase is not Phase.RESERVED:
                    # Its trial left while the model was built (a member with no
                    # slot leaves without the lock): no slot may outlive it.
                    self.core.retire(slot)
                    return
                if self.book.get(member).plan == Plan():
                    self.book.set_plan(member, join.plan)  # unless a scheduler's plan came meanwhile
                self.book.place(member, slot, iteration=0 if state is None else int(state["iteration"]),
                                state=state, held_at=join.held_at)
                self.book.get(member).cohort = join.cohort  # moved in: its cohort's token (regrouping.py)
                if len(self.core.live_slots) == 1 and self.core.fused_steps == 0:  # first member: structure known
                    logger.info("%s: structure %s; per member: %s; shared configuration: %s", self.name,
                                self.model_name, ", ".join(self.core.stack.settings) or "nothing",
                                "; ".join(self.core.describe_configuration()))
                if self.core.stack.padded:  # what it pays for sharing a bucket of other widths (D9)
                    logger.info("%s: member %s: %s", self.name, member, self.core.describe_padding(slot))
                if self.book.max_queue == MAX_QUEUE:
                    self._size_queue(slot)
        except Exception as exc:  # noqa: BLE001 - the factory (or state) is this member's problem only
            logger.warning("%s: member %s could not join: %s", self.name, member, exc)
            self.book.fail(member, exc)
            self._resolve(member)
            self._notify_pool(member, "failed", exc)
        finally:
            self._joining.pop(member, None)
            record = self.book.get(member)
            if record is not None:
                record.building = False
        self.metrics.members(self.live, self.core.capacity)
        self._poke()

    def _size_queue(self, slot: int) -> None:
        # Every waiting result keeps its member's state: bound what that costs.
        per_state = max(1, state_bytes(self.core.member_state(slot)))
        budget = self.options.ahead_memory_mb * 2**20
        self.book.max_queue = int(max(1, min(MAX_QUEUE, budget // (per_state * self.core.capacity))))

    async def leave(self, member: str, keep_state: bool = True, read: int | None = None) -> bool:
        """``member``'s trial is gone: its slot (if any) is freed, what it
        computed and nobody read counts as wasted. ``read``: the iteration of
        the last result its trial handed Tune (it may have fetched more:
        :meth:`next_results`). Idempotent; returns whether it was here."""
        self._start()
        try:
            return await self._leave(member, keep_state, read)
        finally:
            # A member that has left is watched no more, whichever leave did it:
            # a watch (the pool binding its trial) may come while a leave waits
            # for the running iteration, and a client kept for a member that left
            # would be "reaped" once that trial actor ends.
            record = self.book.get(member)
            if record is None or record.phase is Phase.LEFT:
                self.clients.pop(member, None)

    async def _leave(self, member: str, keep_state: bool, read: int | None = None) -> bool:
        record = self.book.get(member)
        if record is None or record.phase is Phase.LEFT:
            return False
        self.book.read_to(member, read)  # what Tune read counts as read, the rest as wasted
        # Its stop counts now, not after the running iteration frees the slot:
        # the trials Tune continues meanwhile count at once, and their continues
        # must not clear the point this stop teaches (docs/design.md D4).
        self.book.count_stop(member)
        self._send_stops_news()
        self._resolve_held()  # Tune's stop may be the decision a held read waited for
        if keep_state and record.state_at_taken is not None:
            self.retired[member] = self._held_states(record, read)
            while len(self.retired) > RETIRED_KEEP:
                self.retired.popitem(last=False)
        fetched = self._fetched.pop(member, None)
        if read is not None and fetched is not None and fetched > read:
            logger.debug("%s: %s leaves at iteration %d, its trial had fetched to %d", self.name, member, read,
                         fetched)
        self.clients.pop(member, None)
        wasted = self.book.wasted
        if record.in_slot:
            async with self._lock:  # slots change only between iterations
                now = self.book.get(member)
                if now is None or now.phase is Phase.LEFT:
                    return False  # a leave that came meanwhile (the reaper's, say) has done it
                slot = self.book.leave(member)
                if slot is not None:
                    self.core.retire(slot)
        else:
            self.book.leave(member)  # no slot: nothing for a running iteration to see
        if self.book.wasted > wasted:
            logger.info("%s: member %s left with %d result(s) unread, wasted %d", self.name, member,
                        self.book.wasted - wasted, self.book.wasted)
        self._send_stops_news()  # a stop the leave itself counted (Tune stopped a trial early)
        self._resolve(member)
        self.metrics.members(self.live, self.core.capacity)
        self.metrics.wasted(self.book.wasted)
        self._poke()
        return True

    async def compact(self, expected: list[str] | None = None) -> int | None:
        """Shrink to the members in slots, between iterations: finished slots
        stop costing compute. Refused (``None``) while a member waits to be
        built, and when ``expected`` (the members the pool holds here) are not
        exactly the members in slots: a leave or a join the pool sent is still
        on its way (Ray does not order an async actor's calls), and shrinking
        to this bucket's count would leave the pool offering a slot that does
        not exist. Returns the new capacity."""
        self._start()
        async with self._lock:
            if self.book.reserved() or not self.book.in_slots():
                return None
            if expected is not None and {r.member for r in self.book.in_slots()} != set(expected):
                return None
            if len(self.book.in_slots()) == self.core.capacity:
                return self.core.capacity
            remap = await self._in_thread(self.core.compact)
            self.book.renumber(remap)
            self.compactions += 1
        logger.info("%s: compacted to %d slots", self.name, self.core.capacity)
        self.metrics.compacted(self.live, self.core.capacity)
        return self.core.capacity
