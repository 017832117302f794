"""The pool's part that lets members go (docs/design.md D2, D3, "Faults"): a trial that left,
a member its bucket finished, failed or reaped, a solo member whose trial actor died; each
freed slot goes to a waiting member. A part of :class:`~chorus_tune.tune.actors.pool.ChorusPool`
(its state is the pool's); leaves under way are ``rules/leaving.py``."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from ray.exceptions import RayActorError

from chorus_tune.tune.actors.liveness import dead_among
from chorus_tune.tune.rules.placement import Update
from chorus_tune.tune.rules.solo import is_solo_key

# The pool's one log: its _start sends it to the actor's own stdout.
logger = logging.getLogger("chorus_tune.tune.actors.pool")

_SOLO_REAP_S = 1.0  # how often the pool looks for solo members whose trial actor died (a bucket's reap_interval_s)


class Departures:
    """Members out: leaves, finishes, failures and reaping (ChorusPool's part; see the module)."""

    async def trial_left(self, trial_id: str, token: int | None = None, read: int | None = None,
                         finished: bool | None = None) -> None:
        """Trial ``trial_id`` ended (or its actor moved on): the member it read
        leaves, and the trial is bound to nothing. Idempotent. ``token``: the
        reservation's; a late call from an actor that served an earlier run of
        this trial (a restart, a restore in this job) then changes nothing.
        ``read``: the iteration of the last result the trial handed Tune (it
        may have fetched more), for its bucket's waste and stop counts.
        ``finished`` (a solo trial's): whether that result ended its member;
        its continues and stop then count for the run's buckets (RunStops.solo_left)."""
        if not self.readers.is_current(trial_id, token):
            return
        self.plans.pop(trial_id, None)
        member = self.readers.leave(trial_id)
        if member is not None:
            if finished is not None and read and self._is_solo(self.seats.home(member) or ""):
                self._stops.solo_left(int(read), bool(finished))
                for name in list(self.handles):
                    self._send_stops(name)
            await self.leave(member, read=read)

    async def leave(self, member: str, notify_bucket: bool = True, reason: str | None = None,
                    read: int | None = None) -> None:
        """``member`` is no longer read: it leaves its bucket (or stops
        waiting). Idempotent; a no-op for a member the pool never saw.
        ``reason`` (e.g. ``"reaped"``) is recorded in the bucket's history;
        ``read`` as for :meth:`trial_left`."""
        self._start()
        name, update = self._forget(member, reason)
        await self._left(member, name, update, notify_bucket, read)

    def _forget(self, member: str, reason: str | None) -> tuple[str | None, Update]:
        """The pool's own part of ``member`` leaving, with no await: its home
        bucket (``None``: none), and what its freed slot set in motion."""
        self.scouts.release(member)
        name = self.seats.leave(member)
        self._unplaced.pop(member, None)
        future = self._waiting.pop(member, None)
        if future is not None and not future.done():
            future.set_exception(RuntimeError(f"member {member} left before it was placed"))
        self.clients.pop(member, None)
        if reason is not None:
            # A member placed in a bucket that has not yet said it expects it
            # has no home yet: its history is still that bucket's.
            placed_in = self.placement.bucket_of(member) if self.placement is not None else None
            self.history.note(name or placed_in, reason, member)
        update = self.placement.remove(member) if self.placement is not None else Update()
        self.leaving.start(member)  # ended by _left, which always follows
        return name, update

    async def _left(self, member: str, name: str | None, update: Update, notify_bucket: bool = True,
                    read: int | None = None) -> None:
        """The rest of ``member`` leaving (see :meth:`_forget`): its bucket is told, the update applied."""
        try:
            if name is not None and notify_bucket and name in self.handles:
                try:
                    await self.handles[name].leave.remote(member, read=read)
                except RayActorError:
                    pass  # the bucket died: its death watch cleans up
            source = self._draining.pop(member, None)
            if source is not None and source in self.handles:
                # It moved, with results unread in its old bucket: they go too.
                with contextlib.suppress(RayActorError):
                    await self.handles[source].leave.remote(member)
        finally:
            self.leaving.end(member)
        await self._apply(update)
        if name is not None:
            self._later_regroup(name)
            self._later_compact(name)

    async def member_out(self, name: str, member: str, reason: str,
                         error: BaseException | None = None) -> list[str]:
        """Bucket ``name`` says ``member`` no longer needs its slot: it
        ``"finished"`` (its results still drain from the bucket), or ``"failed"``
        (with ``error``) or was ``"reaped"``. The slot goes to a waiting member.
        Returns the members placed in bucket ``name`` now (on their way to it):
        the bucket's next iteration may wait for them (``MemberBook.expect_refill``)."""
        if self.seats.home(member) not in (None, name) and (
                self.placement is None or self.placement.bucket_of(member) != name):
            return []  # it moved on (regrouping): a bucket it left says nothing of it
        self.seats.out(member, reason)
        if reason == "reaped":
            self.history.note(name, reason, member)
        if self.placement is None or self.placement.bucket_of(member) != name:
            return []  # its trial left (``_forget``): no one will ask for it
        if reason == "failed" and error is not None:
            # Kept for its trial, which may not have asked yet: ChorusSearch seats
            # members ahead of their trials, and in a bucket already running one
            # can fail before Tune starts its trial. Asking then, the trial found
            # the member nowhere and failed with an error that said nothing of it.
            self._unplaced[member] = error
        update = self.placement.remove(member)
        await self._apply(update)
        self._later_regroup(name)
        self._later_compact(name)
        return [placed.trial_id for placed in update.placed if placed.bucket == name]

    async def bucket_failed(self, name: str) -> None:
        """A trainable saw bucket ``name`` die: forget it now (its death watch may be later)."""
        await self._bucket_gone(name, died=True)

    async def _reap_solo_loop(self) -> None:
        """A solo member's trial trains it (rules/solo.py), so no bucket watches
        that trial's actor: the pool does. A member whose trial actor died
        leaves, and its place in the budget frees (else the members waiting for
        a bucket would wait for it for good)."""
        while True:
            await asyncio.sleep(_SOLO_REAP_S)
            try:
                solo = [record for record in self.placement.buckets.values()
                        if is_solo_key(record.key)] if self.placement is not None else []
                watched = {member: self.clients[member] for record in solo for member in record.members
                           if self.clients.get(member) is not None}
                if not watched:
                    continue
                dead = await asyncio.to_thread(dead_among, set(watched.values()))
                for member, client in watched.items():
                    if client in dead and self.clients.get(member) == client:
                        logger.info("pool: solo member %s left: the trial actor training it is gone", member)
                        await self.leave(member, reason="reaped")
            except Exception:  # noqa: BLE001 - the reaper must survive anything
                logger.exception("pool: solo reaper")
