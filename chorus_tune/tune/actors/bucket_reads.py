"""The bucket actor's part that hands results and states to trials (docs/design.md D3, D7):
the results queued for a member, fetched in one call, waited for when not computed yet, and
the member's exact state at the last result its trial read. A part of
:class:`~chorus_tune.tune.actors.bucket_actor.ChorusBucket` (its state is the actor's)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from chorus_tune.tune.actors.bucket_actor_values import (
    MISSING,
    MemberError,
)
from chorus_tune.tune.actors.liveness import ActorId
from chorus_tune.tune.rules.members import Phase
from chorus_tune.tune.rules.regrouping import moved_error
from chorus_tune.tune.rules.waits import Evicted
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values import state_io
from chorus_tune.tune.values.options import Join

# The bucket's one log: its __init__ sends it to the actor's own stdout.
logger = logging.getLogger("chorus_tune.tune.actors.bucket_actor")


class ResultReads:
    """Results and states read by trials (ChorusBucket's part; see the module)."""

    def _held_states(self, record, read: int | None) -> tuple[int, dict[int, Any]]:
        """The states a save may still ask for once ``record``'s member has
        left: the one at the last result read, and, where its trial did not say
        how far Tune read (an eviction), those of the results it fetched."""
        states = {record.taken: record.state_at_taken}
        if read is None:
            fetched = self._fetched.get(record.member, record.taken)
            states.update({e.iteration: e.state for e in record.queue if e.iteration <= fetched})
        return record.taken, states

    async def save(self, member: str, at: int | None = None) -> bytes | None:
        """``member``'s portable state at the last result its trial handed
        Tune (docs/design.md D7), serialised; ``None`` before its first result.
        ``at``: that result's iteration, where the trial fetched beyond it
        (:meth:`next_results`); ``None``: the last result the bucket delivered.
        A state of another iteration is never given instead: a bucket that
        does not hold the one asked for says so."""
        self._start()
        record = self.book.get(member)
        if member in self.moved and (record is None or record.phase is Phase.LEFT):
            raise moved_error(member, self.name)  # its state is the new bucket's to give
        if record is not None and record.phase is not Phase.LEFT:
            self.book.read_to(member, at)
            if at is not None and record.taken != at:
                raise MemberError(f"bucket {self.name} holds no state of member {member} at iteration {at} "
                                  f"(its trial has read to iteration {record.taken})")
            state = record.state_at_taken
        elif member in self.retired:
            taken, states = self.retired[member]
            state = states.get(taken if at is None else at, MISSING)
            if state is MISSING:
                raise MemberError(f"bucket {self.name} holds no state of member {member} at iteration {at} "
                                  f"(it left at iteration {taken})")
        else:
            raise MemberError(f"bucket {self.name} holds no state of member {member}")
        return None if state is None else state_io.dumps(state)

    async def next_results(self, member: str, join: Join | None = None, client: ActorId | None = None,
                           read: int | None = None) -> list[dict[str, Any]]:
        """Every result of ``member`` computed and not yet fetched, oldest
        first: at once if one is, else the next one once it is. What a trial
        fetches in one call and its steps return one at a time (docs/design.md
        D3): a call costs the trial far more than Tune's own work per result.

        ``read``: the iteration of the last result the trial handed Tune
        (``None``: none since it joined). The results fetched stay queued here,
        with their states, until a later call says Tune read them
        (:meth:`MemberBook.read_to`), so a save reads the state of the
        iteration Tune read, and a leave counts what it did not as wasted.
        ``join`` as for :meth:`next_result`."""
        self._start()
        record = self.book.get(member)
        if read is not None and record is not None and member not in self.evicted:
            self.book.read_to(member, read)
        first = await self.next_result(member, join, client)
        record = self.book.get(member)
        if first.get(rk.RETIRED) or record is None or record.phase is Phase.LEFT:
            return [first]
        queued = list(record.queue)
        results = [first] + [{**entry.result, rk.AHEAD: len(queued) - i, rk.WASTED: self.book.wasted}
                             for i, entry in enumerate(queued, start=1)]
        self._fetched[member] = results[-1].get(rk.ITERATION, record.taken)
        return results

    async def next_result(self, member: str, join: Join | None = None,
                          client: ActorId | None = None) -> dict[str, Any]:
        """``member``'s next result: at once if computed, else once it is.

        ``join`` is given by a trial on its first request: the member is built
        then (a member seated by ChorusSearch was built already)."""
        self._start()
        if member in self.moved:
            self._moved_on(member)  # Moved, once its trial has read what it left here
        if member in self.evicted:
            raise Evicted(f"member {member} gave its slot in bucket {self.name} to a waiting member: its trial "
                          "had not asked for a result for a while; it rejoins from its last result")
        record = self.book.get(member)
        if record is None or record.phase is Phase.LEFT:
            raise MemberError(f"member {member} is not in bucket {self.name}")
        self._asked_at[member] = time.monotonic()
        if client is not None:
            self.clients[member] = client
        if record.phase is Phase.RESERVED:
            await self.join(member, join)
        if record.phase is Phase.LEFT:  # its trial left while it was being built
            return self._retired_result(member)
        self.book.attach(member)
        previous = self._waiters.pop(member, None)
        if previous is not None and not previous.done():
            previous.set_exception(MemberError(f"member {member} asked bucket {self.name} again before its "
                                               "last request was answered"))
        entry = self.book.ask(member)  # raises the member's build error
        self._send_stops_news()
        self._resolve_held()  # this ask may be the decision a held read waited for
        if entry is not None:
            self._poke()
            return self._as_read(member, entry)
        if self.book.exhausted(member):
            return self._retired_result(member)
        future = asyncio.get_running_loop().create_future()
        self._waiters[member] = future
        self._recheck_when_held(member)
        self._poke()
        return await future

    def _as_read(self, member: str, entry) -> dict[str, Any]:
        record = self.book.get(member)
        return {**entry.result, rk.AHEAD: len(record.queue), rk.WASTED: self.book.wasted}

    def _retired_result(self, member: str) -> dict[str, Any]:
        record = self.book.get(member)
        last = {} if record is None else {rk.ITERATION: record.taken}
        return {**last, rk.MEMBER: member, rk.BUCKET: self.name, rk.RETIRED: True, "done": True}

    def _resolve(self, member: str) -> None:
        """Answer ``member``'s waiting trial if there is anything to answer."""
        waiter = self._waiters.get(member)
        if waiter is None or waiter.done():
            self._waiters.pop(member, None)
            return
        record, entry = self.book.get(member), None
        if member in self.moved and (record is None or record.phase is Phase.LEFT):
            waiter.set_exception(moved_error(member, self.name))
        elif record is None or record.phase is Phase.LEFT:
            waiter.set_result(self._retired_result(member))
        elif record.phase is Phase.FAILED:
            waiter.set_exception(record.error)
        else:
            entry = self.book.deliver(member)
            if entry is not None:
                waiter.set_result(self._as_read(member, entry))
            elif self.book.exhausted(member):
                waiter.set_result(self._retired_result(member))
            else:
                self._recheck_when_held(member)
                return
        self._waiters.pop(member, None)
        if entry is not None:
            self._resolve_held()  # a read may be the one a held read waited for

    def _resolve_held(self) -> None:
        """Answer the waiting trials the read order held back (rules/read_order.py),
        where the read or decision they waited for has come."""
        for member in [m for m in self.book.held_until if m in self._waiters]:
            self._resolve(member)

    def _recheck_when_held(self, member: str) -> None:
        """A read the read order holds back is answered when its hold ends at
        the latest: nothing else may come to wake it (every wait ends)."""
        until = self.book.held_until.get(member)
        if until is not None:
            record = self.book.get(member)
            if record is not None and record.queue and (member, record.queue[0].iteration) not in self._held_logged:
                self._held_logged.add((member, record.queue[0].iteration))
                logger.info("%s: member %s reads iteration %d after another trial's read there is decided "
                            "(read order, rules/read_order.py)", self.name, member, record.queue[0].iteration)
            delay = max(0.0, until - self.book.clock()) + 0.005
            asyncio.get_running_loop().call_later(delay, self._resolve, member)
